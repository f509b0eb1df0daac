"""The `slotkeeper` command: mitmdump (or mitmweb) with the addon, in reverse mode in front of one llama-server.

    slotkeeper --upstream http://127.0.0.1:8080 [--listen 127.0.0.1:8081] [--save-dir DIR] [--web]
               [-- mitmproxy options, e.g. --set slots_policy=seed]
    slotkeeper --addon-path        # the addon file, for `mitmdump -s`

The flags are `make run`'s (`slotkeeper.launch.mitmdump.mitm_argv`). The process becomes mitmdump (`exec`), so
signals and the exit status are its own; before that, a malformed `--upstream` or `--listen` exits 2 and a
missing mitmdump 1, with one line on stderr.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import urlsplit

from slotkeeper.launch.mitmdump import ADDON, mitm_argv

USAGE_ERROR = 2
NOT_FOUND = 1


class UsageError(ValueError):
    """A malformed argument: its one-line message goes to stderr, the exit status is 2."""


# A host name as DNS spells it (letters, digits, hyphens, dots): anything else in `--listen` would reach
# mitmproxy's mode spec, where `@` or `:` change what the spec means.
HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def parse_upstream(url: str) -> str:
    """`http(s)://host[:port]` without path, query or user, normalised (no trailing slash), else `UsageError`."""
    example = "http://127.0.0.1:8080"
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        raise UsageError(f"--upstream {url!r} is not a URL like {example} ({e})") from None
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"--upstream {url!r} needs the scheme http:// or https://, like {example}")
    if not parts.hostname:
        raise UsageError(f"--upstream {url!r} names no host, like {example}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise UsageError(f"--upstream {url!r}: only scheme, host and port, like {example} "
                         "(mitmproxy's reverse mode takes no path)")
    if port == 0:
        raise UsageError(f"--upstream {url!r}: port 0")
    return f"{parts.scheme}://{parts.netloc}"


def parse_listen(spec: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:PORT` for IPv6) or a bare `PORT` on 127.0.0.1, else `UsageError`."""
    host, sep, port_s = spec.strip().rpartition(":")
    if not sep:
        host = "127.0.0.1"
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise UsageError(f"--listen {spec!r} is not HOST:PORT with a port in 1..65535, like 127.0.0.1:8081")
    if not host:
        raise UsageError(f"--listen {spec!r} names no host (write 127.0.0.1:{port}, or 0.0.0.0:{port} for every "
                         "interface)")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not valid_host(bare, bracketed=bare != host):
        raise UsageError(f"--listen {spec!r}: {host!r} is not an IP address or host name "
                         "(write [::1]:PORT for IPv6)")
    return bare, port


def valid_host(host: str, *, bracketed: bool) -> bool:
    """An IPv4 address or host name, or an IPv6 address (which `HOST:PORT` must bracket)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return not bracketed and HOSTNAME.match(host) is not None
    return bracketed == (ip.version == 6)


def parse_port(flag: str, port: int) -> int:
    """A TCP port the process can listen on and print as it is (0 would be any port, not the one printed)."""
    if not 1 <= port <= 65535:
        raise UsageError(f"{flag} {port} is not a port in 1..65535")
    return port


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="slotkeeper",
        description="mitmdump with the slotkeeper addon in front of one llama-server (reverse proxy)",
        epilog="Arguments after -- go to mitmdump/mitmweb as they are (e.g. -- --set slots_policy=seed).")
    ap.add_argument("--upstream", metavar="URL", help="the llama-server, e.g. http://127.0.0.1:8080")
    ap.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:8081",
                    help="where the proxy listens (default 127.0.0.1:8081)")
    ap.add_argument("--save-dir", metavar="DIR",
                    help="llama-server's --slot-save-path: turns on session paging and prefix checkpoints")
    ap.add_argument("--web", action="store_true", help="mitmweb instead of mitmdump")
    ap.add_argument("--web-port", type=int, default=8082, help="mitmweb's UI port with --web (default 8082)")
    ap.add_argument("--addon-path", action="store_true", help="print the addon's path (for mitmdump -s) and exit")
    ap.add_argument("--dry-run", action="store_true", help="print the mitmdump command line instead of running it")
    return ap


def command(argv: list[str]) -> tuple[list[str], list[str]]:
    """The mitmdump argv for `argv` (the `slotkeeper` arguments) and the lines to print before it runs."""
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = build_parser().parse_args(own)
    if not a.upstream:
        raise UsageError("--upstream URL is required (e.g. --upstream http://127.0.0.1:8080)")
    upstream = parse_upstream(a.upstream)
    host, port = parse_listen(a.listen)
    web_port = parse_port("--web-port", a.web_port)
    options: dict[str, object] = {}
    if a.save_dir:
        options["slots_save_dir"] = str(Path(a.save_dir).expanduser().resolve())
    mitm = mitm_argv(upstream, port, options, web=a.web, web_port=web_port, extra=extra, host=host)
    shown = f"[{host}]" if ":" in host else host
    ui = f", mitmweb UI on http://127.0.0.1:{web_port}" if a.web else ""
    lines = [f"slotkeeper proxy on http://{shown}:{port} -> {upstream}{ui}",
             f"  live slot page: http://{shown}:{port}/_slots/",
             "  " + shlex.join(mitm)]
    return mitm, lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[:argv.index("--")] if "--" in argv else argv
    if "--addon-path" in own:
        print(ADDON)
        return 0
    try:
        mitm, lines = command(argv)
    except UsageError as e:
        print(f"slotkeeper: {e}", file=sys.stderr)
        return USAGE_ERROR
    except RuntimeError as e:  # mitm_binary: neither next to this interpreter nor on PATH
        print(f"slotkeeper: {e} (pip install 'mitmproxy>=11.0.2,<13' next to slotkeeper)", file=sys.stderr)
        return NOT_FOUND
    if "--dry-run" in own:
        print(shlex.join(mitm))  # quoted: what a shell runs as these exact arguments
        return 0
    print("\n".join(lines), flush=True)
    sys.stderr.flush()
    os.execve(mitm[0], mitm, {**os.environ, "PYTHONUNBUFFERED": "1"})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
