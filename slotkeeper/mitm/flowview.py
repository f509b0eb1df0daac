"""The view addon: what a user sees of each request in mitmweb and in the answer's headers.

At the response headers it tells the client which slot and session served it (`x-slot-id`,
`x-slot-session`); when the answer is complete it writes the flow's comment (`s=… slot=… why | cache …`) and
its marker (⚡ hit, 🔶 partial, 🐌 miss, ❌ error), rendered by `slotlogic.wording` from the request's report.
"""

from __future__ import annotations

from mitmproxy import http

from slotkeeper.mitm.runtime import Runtime, guarded
from slotlogic import wording
from slotlogic.decisions import Report
from slotlogic.events import Stage


class FlowView:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    @guarded(Stage.RESPONSE_HEADERS)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        req = self.rt.open.get(flow.id)
        if req is None or flow.response is None:
            return
        added = [(b"x-slot-session", req.ticket.session.short.encode())]
        if req.ticket.slot is not None:
            added.insert(0, (b"x-slot-id", str(req.ticket.slot).encode()))
        flow.response.headers.fields += tuple(added)

    @guarded(Stage.RESPONSE)
    def response(self, flow: http.HTTPFlow) -> None:
        report = self._annotate(flow)
        if (report is not None and report.ticket.learn is not None and report.slot is not None
                and flow.response is not None and flow.response.raw_content is not None and flow.live):
            # a pending request (affinity) learned its slot from the buffered answer, which is not sent yet
            flow.response.headers.fields += ((b"x-slot-id", str(report.slot).encode()),)

    @guarded(Stage.RESPONSE)
    def error(self, flow: http.HTTPFlow) -> None:
        self._annotate(flow)

    def _annotate(self, flow: http.HTTPFlow) -> Report | None:
        report = self.rt.reports.get(flow.id)
        if report is not None:
            flow.comment = wording.comment(report)
            flow.marked = wording.marker(report)
        return report
