"""A llama-server with a Hermes-style tool-calling chat template, for the Anthropic tool-use tests.

Why: SmolLM2's own template cannot render tools, so llama-server never parses a tool call from it. With
this ChatML + `<tool_call>` template (tests/hermes_tools.jinja) the server recognises the tool-call format,
builds the grammar and parses calls, and the same tiny model can be made to call a tool. The variant
tests/hermes_think.jinja opens `<think>` in the generation prompt, so the server parses the output as
reasoning (a separate server: the server's template analysis then treats every answer as thinking).
Run: `python -m tests.hermes_server --port N [--template FILE]` (embedded xllamacpp), or `LLAMA_SERVER_BIN`
is exec'd with `--jinja --chat-template-file`.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from bench.real.llama_server import LlamaServer, ServerConfig, model_path

TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")
THINK_TEMPLATE = Path(__file__).with_name("hermes_think.jinja")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--template", default=str(TEMPLATE))
    a = ap.parse_args()
    binary = os.environ.get("LLAMA_SERVER_BIN")
    if binary:
        cfg = ServerConfig(port=a.port, slots=1, threads=a.threads)
        argv = [*cfg.binary_argv(binary), "--jinja", "--chat-template-file", a.template]
        os.execv(binary, argv)
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = model_path()
    p.n_parallel = 1
    p.n_ctx = 4096
    p.port = a.port
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads
    p.use_jinja = True
    p.chat_template = Path(a.template).read_text()
    server = xllamacpp.Server(p)
    print(f"llama-server (xllamacpp, hermes template) listening on {server.listening_address}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


class HermesServer(LlamaServer):
    """LlamaServer, started through this module (one slot) with `template`."""

    def __init__(self, template: Path = TEMPLATE, **kw: object) -> None:
        super().__init__(**kw)
        self.template = template

    def start(self, timeout: float = 120.0) -> HermesServer:
        import subprocess
        import sys

        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        argv = [sys.executable, "-m", "tests.hermes_server", "--port", str(self.cfg.port),
                "--threads", str(self.cfg.threads), "--template", str(self.template)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.wait_healthy(timeout)
        return self


if __name__ == "__main__":
    main()
