"""The mitmdump command line the `slotkeeper` command runs; nothing here runs inside the proxy. The launchers of
llama-server and of mitmdump as a child process are the tests' and the bench's (`bench.real`)."""
