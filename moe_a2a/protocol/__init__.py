"""The protocol between a rank's model process, its kernels, its proxy processes and its peers.

    words.py    every flag, shard word, immediate and packed status word, with its host codec
    device.py   the same codecs as Triton helpers, for the kernels
    segment.py  the shared segment's flags, shard words and error area, with release/acquire accesses
    plan.py     the arithmetic of who writes what where, from the exchanged count rows
    board.py    the failure board's store, written without torch (a proxy whose model process died)

docs/protocol.md is the single account of the steps; this package is the code of it. Nothing here
imports torch (the proxy process imports `words`, `segment`, `plan` and `board`).
"""
