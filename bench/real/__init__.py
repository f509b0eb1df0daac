"""Real parts the tests, the bench and the recording tools start (llama-server, mitmdump with the addon, agent
clients, pi, a long-context model copy, headless Chromium, redis-server; `make run`'s stack): not installed with
slotkeeper."""
