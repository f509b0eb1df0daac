"""Send a small synthetic agent workload to a proxy or server, to have real traffic to look at in mitmweb.

Why: a mitmweb flow list (comments, markers) or `/_slots/status` only says something with several sessions
and follow-up turns in it. This reuses tools/record.py's workload (bench.workload's generator, tool outputs
cut short) so it costs about a minute of prefill on 2 CPUs.

    .venv/bin/python tools/traffic.py http://127.0.0.1:8081 --sessions 3 --turns 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from record import run, shrink

from bench.workload import generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="base URL, e.g. http://127.0.0.1:8081 (the proxy)")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args(argv)
    run(a.url, shrink(generate("traffic", seed=a.seed, sessions=a.sessions, turns=a.turns, subagent_turns=0,
                               max_tokens=8)))
    print(f"sent {a.sessions} sessions x {a.turns} turns to {a.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
