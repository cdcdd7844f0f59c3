"""Host proxy: libfabric ctypes shim, TransferEngine, bootstrap helpers."""
