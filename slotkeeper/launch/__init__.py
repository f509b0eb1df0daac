"""Starting the processes around the proxy: llama-server, mitmdump/mitmweb and real agent clients.

Shared by `make run`, the tests, the benchmark and the recording tool; nothing here runs inside the proxy.
"""
