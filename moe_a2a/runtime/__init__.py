"""The model process's host side of one rank, below `AllToAll`.

    placement.py  where the send/recv buffers live: one class per placement
    wiring.py     construction, collectively: segment, proxies, placement, bootstrap, kernel views
    status.py     what kernels and proxies report, as exceptions; the host's own waits
    tracing.py    timestamps of the halves and the proxy's steps
"""
