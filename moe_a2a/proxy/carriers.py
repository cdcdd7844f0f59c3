"""The proxy's engine for its spec: over libfabric (`fabric.py`, the engines' default carrier), or for
transport "emulated" over the emulated NIC (`emulated.py`); and how its GPU buffers are registered with it
(by DMA-BUF fd where the driver gives one, else by address)."""
from __future__ import annotations

import logging
import os

from . import libfabric as lf
from .engine import EMULATED, TransferEngine

_log = logging.getLogger("moe_a2a.proxy")


def make_engine(spec, on_gpu: bool) -> TransferEngine:
    """The proxy's engine for `spec` (`protocol.proxy_spec.ProxySpec`): over libfabric, or for transport
    "emulated" over the emulated NIC (its CUDA carrier when the buffers are GPU memory)."""
    if spec.provider != EMULATED:
        return TransferEngine(spec.provider, domains=spec.domains, timeout_s=spec.timeout_s,
                              idle_yield=spec.idle_yield, hmem=on_gpu, local_only=spec.local_only)
    from .emulated import EmulatedCarrier  # only a run over the emulated NIC loads it
    from .nic_settings import parse_nic_settings

    # Every engine that connects to us claims a ring: every proxy of every rank (ourselves included).
    senders = spec.layout.world_size * max(1, spec.shards) + 1
    carrier = EmulatedCarrier(cuda_device=spec.fd_buffers[1] if on_gpu else None,
                              nic=parse_nic_settings(spec.emulated_nic), max_senders=senders)
    return TransferEngine(carrier=carrier, timeout_s=spec.timeout_s, idle_yield=spec.idle_yield)


def dmabuf_fd(addr: int, nbytes: int, driver=None) -> tuple[int | None, str]:
    """(a DMA-BUF fd of the GPU memory ``[addr, addr + nbytes)``, from ``cuMemGetHandleForAddressRange``, or
    None; what happened, for the log). None where the driver, the kernel (Linux >= 5.12) or the allocation
    gives none: the caller registers by address. ``driver``: ``cuda.bindings.driver`` (tests pass a fake)."""
    try:
        if driver is None:
            from cuda.bindings import driver
        kind = driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        rc, fd = driver.cuMemGetHandleForAddressRange(addr, nbytes, kind, 0)
    except Exception as exc:  # noqa: BLE001 - an older driver or cuda-python: no DMA-BUF, said why
        return None, f"no cuMemGetHandleForAddressRange ({type(exc).__name__}: {exc})"
    if rc != driver.CUresult.CUDA_SUCCESS:
        return None, f"cuMemGetHandleForAddressRange: {rc!r}"
    return int(fd), "DMA-BUF fd"


def register_gpu_buffers(engine, buffers, accesses, ordinal: int, max_write_bytes: int, driver=None) -> list:
    """Register the proxy's GPU buffers (objects with ``addr`` and ``size``) with ``accesses``: by DMA-BUF fd
    when the driver gives one and the engine's libfabric has ``FI_MR_DMABUF`` (API >= 1.20): EFA's libfabric up
    to 2.4 registers GPU memory by address only through a peer-memory module, which hosts with DMA-BUF alone
    lack. Else by address. The fds are closed once registered (the registration holds the DMA-BUF). One INFO
    line says which path each buffer took. The regions, in order."""
    info = getattr(engine, "info", None)
    with_dmabuf = info is not None and info.api_version >= lf.FI_VERSION(1, 20)
    regions, how = [], []
    for buf, access in zip(buffers, accesses):
        fd, why = dmabuf_fd(buf.addr, buf.size, driver) if with_dmabuf else (
            None, "no FI_MR_DMABUF below libfabric API 1.20" if info is not None else "not over libfabric")
        try:
            regions.append(engine.register(buf.addr, buf.size, access, cuda_device=ordinal, dmabuf_fd=fd,
                                           max_write_bytes=max_write_bytes))
        finally:
            if fd is not None:
                os.close(fd)
        how.append("DMA-BUF" if fd is not None else f"address ({why})")
    _log.info("GPU buffers registered with the NIC by %s", ", ".join(how))
    return regions
