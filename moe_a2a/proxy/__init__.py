"""What runs in the proxy process, and nothing else: torch-free (tests/proxy/test_torch_free.py).

    worker.py        the proxy process: one call's steps (run_epoch)
    engine.py        TransferEngine: regions, peers, posting, immediate counts, waits (one engine)
    carriers.py      make_engine: the proxy's engine over libfabric or the emulated NIC; its GPU buffers
                     registered by DMA-BUF fd or by address
    fabric.py        the libfabric carrier: endpoints, registrations, write templates, CQs
    fabric_chunks.py registrations over a provider's limit, in overlapping chunks, and their posting path
    libfabric.py     the ctypes shim over libfabric: loading, fi_getinfo, the objects (endpoints, MRs, CQs)
    libfabric_abi.py the libfabric header mirrored for ctypes: constants, structs, ops prototypes
    emulated.py      the emulated NIC's carrier (an instrument): copies on one host, immediates via inboxes
    inbox.py         the emulated NIC's inbox (receiver) and rings (senders)
    backing.py       the emulated NIC's view of a buffer: the file or cuMem FD a peer maps
    nic_settings.py  MOE_A2A_EMULATED_NIC: the emulated NIC's latency and bandwidth
    topology.py      which NICs a rank drives, which core its proxy takes

The model process's side (starting a proxy, the bootstrap) is in `runtime/`; what both share (the segment,
memory helpers, `ProxySpec`) in `protocol/`.
"""

from . import fabric as _fabric  # noqa: E402,F401  (registers libfabric as the engines' default carrier)
