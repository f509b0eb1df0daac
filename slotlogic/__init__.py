"""slotkeeper's pure decision core: no sockets, no files, no mitmproxy."""

__version__ = "0.1.0"
