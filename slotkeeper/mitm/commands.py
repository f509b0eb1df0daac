"""The commands addon: `slots.status`, `slots.release`, `slots.pin`, `slots.cleanup`.

They run in mitmproxy's console (`:slots.status`) and through mitmweb's command API. Commands are
synchronous in mitmproxy, so each acts on this process's memory at once and leaves the state file to a
background transaction: a command never blocks the event loop on the file lock.
"""

from __future__ import annotations

import json

from mitmproxy import command

from slotkeeper.mitm.runtime import Runtime
from slotlogic import wording


class Commands:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    @command.command("slots.status")
    def status(self) -> str:
        """The slot table and per-session summary as text."""
        data = self.rt.status([up.status_now() for up in self.rt.upstreams.values()])
        lines = [line for up in self.rt.upstreams.values()
                 for line in wording.summary(up.url, up.keeper.outcomes.summary())]
        return json.dumps(data, indent=1) + "\n" + "\n".join(lines)

    @command.command("slots.release")
    def release(self, session: str) -> str:
        """Forget a session (its 8-hex id from the log): its slot is free for the next new session."""
        done = [line for up in self.rt.upstreams.values() for line in up.sync.release(session)]
        return "released: " + (", ".join(done) or f"no session matches {session!r}")

    @command.command("slots.pin")
    def pin(self, session: str, slot: int) -> str:
        """Move a known session (its 8-hex id from the log) to a slot of your choice."""
        for up in self.rt.upstreams.values():
            total = up.keeper.total_slots or 0
            if not 0 <= slot < total:
                return f"slot {slot} is out of range 0..{total - 1} on {up.url}"
        done = [line for up in self.rt.upstreams.values() for line in up.sync.move(session, slot)]
        return "pinned: " + (", ".join(done) or f"no session matches {session!r}")

    @command.command("slots.cleanup")
    def cleanup(self) -> str:
        """Delete stale prefix-checkpoint files now (only prefix-<16 hex>.bin in slots_save_dir)."""
        deleted: list[str] = []
        for up in self.rt.upstreams.values():
            if up.checkpoints is not None:
                deleted += up.checkpoints.cleanup_sync()
        return "deleted: " + (", ".join(deleted) or "nothing")
