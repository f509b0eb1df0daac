"""slotkeeper: a mitmproxy addon that pins every agent session to its own llama-server KV-cache slot.

    mitmdump -s addon.py --mode reverse:http://127.0.0.1:8080@127.0.0.1:8081 --set connection_strategy=lazy

This file is the entry point: the addons below, one concern each, share one `Runtime` (slotkeeper/mitm/runtime.py),
the way mitmproxy's own addons share the master. Their order is the order of every hook: the local API
answers its own paths before pinning sees them; the views render a request after pinning has finished it.
Decisions live in the pure package `slotlogic`; I/O to llama-server and to disk in `slotkeeper/drivers/`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `mitmdump -s` from any cwd

from slotkeeper.mitm.commands import Commands
from slotkeeper.mitm.flowview import FlowView
from slotkeeper.mitm.localapi import LocalApi
from slotkeeper.mitm.pinning import Pinning
from slotkeeper.mitm.requestlog import RequestLog
from slotkeeper.mitm.runtime import Runtime
from slotkeeper.mitm.watchdog import Watchdog


def make_addons() -> list[object]:
    """A fresh set of addons around a fresh runtime (tests build one per case)."""
    rt = Runtime()
    return [LocalApi(rt), Pinning(rt), Watchdog(rt), FlowView(rt), RequestLog(rt), Commands(rt)]


addons = make_addons()
