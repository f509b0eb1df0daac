"""The I/O the proxy does at run time, performing what `slotlogic` decides: HTTP calls to llama-server
(`llama_http`), the shared state and index files (`store_file`), slot file saves and restores for session
paging (`page_runner`) and prefix checkpoints (`checkpoint_runner`), all driven per server by `upstream`."""
