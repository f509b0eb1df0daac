"""slotkeeper's benchmark harness (`make bench`, `python -m bench --help`).

Replays deterministic coding-agent workloads against fresh llama-servers, directly (`stock`) and through
mitmdump with the addon under each slot policy, and reports the prefill each configuration caused (as the
server reports it), its ratio to the physical limit, latency, and the proxy's own per-request overhead.
"""
