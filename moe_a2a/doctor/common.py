"""What the facts and the checks share: the constants, `Check` (one verdict), and how a check reads the facts."""
from __future__ import annotations

from dataclasses import dataclass

SCHEMA = 1
VERDICTS = ("ok", "warn", "fail")
PROVIDERS = ("tcp", "shm", "efa", "verbs")
RDMA_PROVIDERS = ("efa", "verbs")

# EFA: one memory registration that allows remote write may span at most 2^20 pages (4 GiB at 4 KiB pages),
# libfabric PR #10402 ("The EFA limit for single MR that enables remote write is 1M pages aka 4GB for
# regular pages"). The device reports its own byte limit too (ibv max_mr_size = max_mr_pages * PAGE_SIZE,
# Linux drivers/infiniband/hw/efa/efa_verbs.c), not read here.
EFA_REMOTE_WRITE_MR_MAX_PAGES = 1 << 20
EFA_INSTALLER_PREFIX = "/opt/amazon/efa"
EFA_INSTALLER_MANIFEST = "/opt/amazon/efa_installed_packages"  # "# EFA installer version: X" on its first lines

# The sizes registered by default: DeepSeek-V3 decode (as `moe-a2a bench kernels --preset decode`).
DEFAULT_WORLD, DEFAULT_NODE, DEFAULT_TOKENS = 64, 8, 128
DECODE = dict(num_experts=256, experts_per_token=8, hidden_dim=7168)

# Kernel modules that matter, as /proc/modules names them.
MODULES = ("efa", "efa_nv_peermem", "ib_core", "ib_uverbs", "mlx5_core", "mlx5_ib", "nvidia", "nvidia_peermem",
           "nv_peer_mem", "gdrdrv")
PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem", "efa_nv_peermem")
# Kernel symbols libfabric's verbs provider looks for (prov/verbs/include/linux/verbs_osd.h): the peer-memory
# API of MLNX_OFED (what nvidia-peermem plugs into) and DMA-BUF memory registration (Linux >= 5.12).
KSYM_PEER_MEMORY, KSYM_DMABUF = "ib_register_peer_memory_client", "ib_umem_dmabuf_get"
# libfabric's CUDA support loads the CUDA runtime by its unversioned name (issue 44's reading of src/hmem_cuda.c):
# pip's CUDA wheels ship only libcudart.so.<major>, so a proxy may find none although torch runs.
CUDART_NAME = "libcudart.so"
# EFA's libfabric registers GPU memory by address through a peer-memory module only, up to 2.4 (issue 44's
# reading of prov/efa at v2.4/v2.5); with DMA-BUF alone the proxy registers by DMA-BUF fd (FI_MR_DMABUF, API 1.20).
EFA_DMABUF_BY_ADDRESS_SINCE = (2, 5)
EFA_GPU_MIN = (1, 20)  # efa with cuMem GPU buffers (or FI_EFA_SET_CUDA_SYNC_MEMOPS=0): proxy/libfabric_abi.py

# fi_info caps and mr_mode bits by name (rdma/fabric.h), for facts a person can read.
CAP_BITS = {"FI_MSG": 1, "FI_RMA": 2, "FI_TAGGED": 3, "FI_ATOMIC": 4, "FI_MULTICAST": 5, "FI_COLLECTIVE": 6,
            "FI_READ": 8, "FI_WRITE": 9, "FI_RECV": 10, "FI_SEND": 11, "FI_REMOTE_READ": 12,
            "FI_REMOTE_WRITE": 13, "FI_MULTI_RECV": 16, "FI_TRIGGER": 20, "FI_FENCE": 21, "FI_AV_USER_ID": 41,
            "FI_PEER": 43, "FI_HMEM": 47, "FI_VARIABLE_MSG": 48, "FI_RMA_PMEM": 49, "FI_SOURCE_ERR": 50,
            "FI_LOCAL_COMM": 51, "FI_REMOTE_COMM": 52, "FI_SHARED_AV": 53, "FI_RMA_EVENT": 56, "FI_SOURCE": 57,
            "FI_NAMED_RX_CTX": 58, "FI_DIRECTED_RECV": 59}
MR_MODE_BITS = {"FI_MR_BASIC": 0, "FI_MR_SCALABLE": 1, "FI_MR_LOCAL": 2, "FI_MR_RAW": 3, "FI_MR_VIRT_ADDR": 4,
                "FI_MR_ALLOCATED": 5, "FI_MR_PROV_KEY": 6, "FI_MR_MMU_NOTIFY": 7, "FI_MR_RMA_EVENT": 8,
                "FI_MR_ENDPOINT": 9, "FI_MR_HMEM": 10, "FI_MR_COLLECTIVE": 11}


def bit_names(value: int, table: dict[str, int]) -> list[str]:
    """Names of the bits set in `value` (unknown bits as "0x..")."""
    names = [name for name, bit in table.items() if value >> bit & 1]
    rest = value & ~sum(1 << b for b in table.values())
    return names + ([hex(rest)] if rest else [])


@dataclass(frozen=True)
class Check:
    """One verdict: `name`, `verdict` ("ok", "warn", "fail"), `detail` (what was found), `fix` (what to
    do; empty when nothing)."""
    name: str
    verdict: str
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Check {self.name}: verdict {self.verdict!r} not in {VERDICTS}")



def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _devices(facts: dict, kind: str) -> list[dict]:
    """RDMA devices of `kind`: "efa" (driver efa) or "verbs" (any other driver: mlx5_core, ...)."""
    devs = facts.get("rdma_devices") or []
    return [d for d in devs if (d.get("driver") == "efa") == (kind == "efa")]


def _domains(facts: dict, provider: str) -> list[dict]:
    return (facts.get("fi_getinfo", {}).get(provider) or {}).get("domains") or []


def _rdma_provider(facts: dict) -> str | None:
    """The RDMA provider moe_a2a would use here: efa, else verbs, else None."""
    return next((p for p in RDMA_PROVIDERS if _domains(facts, p)), None)


def _version(text: str | None) -> tuple[int, int]:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0


def _env_true(value: str | None) -> bool | None:
    """libfabric's boolean parsing (1/true/yes/on, 0/false/no/off); None when unset or unreadable."""
    if value is None:
        return None
    v = value.strip().lower()
    return True if v in ("1", "true", "yes", "on", "y") else False if v in ("0", "false", "no", "off", "n") else None

