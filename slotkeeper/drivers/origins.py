"""A server's origin, `scheme://host:port`: the one spelling every part of the proxy keys servers by.

An IPv6 host is written in brackets (`http://[::1]:8080`), as URLs require: a bare `::1` would make the port
part of the address, and the URL parsers that read it back would refuse it or read another port.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def origin(scheme: str, host: str, port: int) -> str:
    """`scheme://host:port`, an IPv6 host in brackets."""
    bare = host.removeprefix("[").removesuffix("]")
    return f"{scheme}://[{bare}]:{port}" if ":" in bare else f"{scheme}://{bare}:{port}"


def base_of(url: str) -> str:
    """`scheme://host:port` of a URL (a llama-swap model's server URL included), the default port spelled out."""
    p = urlsplit(url)
    return origin(p.scheme, p.hostname or "", p.port or (443 if p.scheme == "https" else 80))


def parts(base: str) -> tuple[str, str, int]:
    """(scheme, host without brackets, port) of an origin `origin` wrote."""
    p = urlsplit(base)
    return p.scheme, p.hostname or "", p.port or (443 if p.scheme == "https" else 80)
