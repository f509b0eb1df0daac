"""A deterministic in-process llama-server and generated agent traffic, for proving slotkeeper loses nothing.

`llama.py` models the server's slots, `transport.py` lets the real drivers talk to it over httpx, `clock.py`
gives the asyncio loop and the `time` functions one virtual clock, `harness.py` drives the real addons,
`traffic.py` generates seeded agent traffic and `sweep.py` runs many workloads (`make bench ARGS=--sim`).
docs/simulator.md says what is modelled and what is not.
"""
