"""slotkeeper: the mitmproxy addon (`slotkeeper.addon`), its addons (`slotkeeper.mitm`), the I/O drivers
(`slotkeeper.drivers`) and the mitmdump command line (`slotkeeper.launch`). The pure core is
the top-level package `slotlogic`."""
