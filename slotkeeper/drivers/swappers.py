"""The two model swappers a pool may front, as their own APIs show them: llama-swap, and llama-server's router
mode (`--models-dir`, `--models-max`).

Why apart: what a request unloads is decided from what the swapper says it holds (`slotlogic.swap_out`); this
part knows how each one says it. llama-swap: `GET /running` lists the loaded models with a `state` (`ready`,
`starting`, `stopping`), and a model's own server is reached through `/upstream/<model>/…`. The router: its
`/props` says `"role": "router"` and `max_instances` (its `--models-max`); `GET /models` gives each model's
`status.value` (`loaded`, `loading`, `unloaded`); a model is reached by naming it (`?model=` on a GET, `model` in
a POST body: `llama_http.ModelClient`). Asking either never loads a model.
"""

from __future__ import annotations

from urllib.parse import quote

from slotkeeper.drivers.llama_http import ROUTER_MODEL
from slotkeeper.drivers.pool_health import Member
from slotlogic import numbers
from slotlogic.swap_models import MAX_NAME

READY = {"ready": True, "starting": False, "loaded": True, "loading": False}  # a state or status -> ready


async def detect(member: Member) -> None:
    """Whether `member` is a llama-swap (it answers `/running`), a router (its `/models` give each model a
    `status`; its `/props` then says `role: router` and `max_instances`) or a llama-server; asked once. A plain
    llama-server is never asked `/props` here: a busy one answers it only after a long prefill, and its own
    upstream asks it anyway."""
    if member.swap is not None:
        return
    data = await member.client.get_json("/running")
    if isinstance(data, dict) and isinstance(data.get("running"), list):
        member.swap = True
        return
    models = await member.client.get_json("/models")
    rows = models.get("data") if isinstance(models, dict) else None
    if not (isinstance(rows, list) and any(isinstance(r, dict) and isinstance(r.get("status"), dict) for r in rows)):
        member.swap = False
        return
    props = await member.client.get_json("/props")
    member.router = isinstance(props, dict) and props.get("role") == "router"
    member.swap = member.router
    if member.router and isinstance(props, dict):
        member.max_loaded = numbers.count(props.get("max_instances"))


def model_url(member: Member, model: str) -> str:
    """The URL of `model`'s own server behind `member` (its origin, for a llama-server)."""
    if not member.swap or not model:
        return member.url
    name = quote(model, safe="")
    return f"{member.url}{ROUTER_MODEL}{name}" if member.router else f"{member.url}/upstream/{name}"


async def loaded(member: Member) -> dict[str, bool] | None:
    """The models `member` holds (loaded or loading) and whether each is ready; None when it did not answer as
    its kind does."""
    if member.router:
        data = await member.client.get_json("/models")
        rows = data.get("data") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            return None
        pairs = [(e.get("id"), e.get("status")) for e in rows if isinstance(e, dict)]
        states = [(name, s.get("value")) for name, s in pairs if isinstance(s, dict)]
    else:
        data = await member.client.get_json("/running")
        rows = data.get("running") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            return None
        states = [(e.get("model"), e.get("state")) for e in rows if isinstance(e, dict)]
    return {name: READY[state] for name, state in states
            if isinstance(name, str) and 0 < len(name) <= MAX_NAME and isinstance(state, str) and state in READY}

