"""The pi workload's plumbing that needs no pi: prompts per window and prompts recovered from saved flows."""

import json

from mitmproxy import http, io
from mitmproxy.test import tflow

from bench import pi_workload


def test_windows_get_distinct_first_prompts_and_shared_follow_ups():
    a, b = pi_workload.prompts(0, 2), pi_workload.prompts(1, 2)
    assert a[0] != b[0] and a[1] == b[1] and len(pi_workload.prompts(0, 9)) == 4


def test_bodies_from_saved_flows_in_request_order(tmp_path):
    path = tmp_path / "f.mitm"
    with path.open("wb") as fp:
        w = io.FlowWriter(fp)
        for i, t in ((2, 20.0), (1, 10.0)):
            body = {"messages": [{"role": "user", "content": f"m{i}"}], "tools": [{"n": i}], "id_slot": 0}
            req = http.Request.make("POST", "http://127.0.0.1:8080/v1/chat/completions", json.dumps(body))
            req.timestamp_start = t
            w.add(tflow.tflow(req=req, resp=True))
        w.add(tflow.tflow(req=http.Request.make("GET", "http://127.0.0.1:8080/props")))
    got = pi_workload.bodies_from_flows(path)
    assert got == [([{"role": "user", "content": "m1"}], [{"n": 1}]), ([{"role": "user", "content": "m2"}], [{"n": 2}])]
