"""Real parts the tests, the bench and the recording tools start (agent clients, pi, a long-context model copy,
headless Chromium, redis-server): not installed with slotkeeper."""
