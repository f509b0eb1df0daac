"""The `mitmdump -s addon.py` entry of a repository checkout (slotkeeper-addon-shim): the addon itself is
`slotkeeper/addon.py`, which an installed package carries too (`slotkeeper --addon-path` prints its path).

    mitmdump -s addon.py --mode reverse:http://127.0.0.1:8080@127.0.0.1:8081 --set connection_strategy=lazy
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `mitmdump -s` from any cwd

from slotkeeper.addon import make_addons

addons = make_addons()
