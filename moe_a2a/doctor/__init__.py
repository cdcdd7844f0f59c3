"""`moe-a2a doctor`: what to run first on a new cluster. Is this host ready for moe_a2a, and if not, why?

Two halves:

- **Facts** (`collect_facts`): a JSON-able dict of what this host has, gathered without starting any
  process: the libfabric loaded (`proxy.libfabric.library_info`) and the EFA installer's prefix, what
  `fi_getinfo` answers for tcp, shm, efa and verbs to the hints the engine itself uses (domains, fabric,
  API, caps, mr_mode, PCI address of each NIC, `FI_HMEM`), the RDMA devices of `/sys/class/infiniband`
  and their `/dev/infiniband/uverbs*` nodes, the kernel modules of `/proc/modules` that matter
  (efa, ib_core, nvidia_peermem, ...), the kernel's DMA-BUF and peer-memory symbols (`/proc/kallsyms`, as
  libfabric's verbs provider reads them), `/dev/gdrdrv`, the GPUs NVML lists with their PCIe bridges
  (sysfs), the NICs' bridges, `RLIMIT_MEMLOCK`, the page size, the `FI_*` / `MOE_A2A_*` variables, and the
  registration sizes of a configuration (`config.A2AConfig` / `Layout`; default DeepSeek-V3 decode at 64
  ranks, 8 per node).
- **Checks** (`run_checks`): pure functions of the facts, each returning a `Check` (name, verdict
  "ok" / "warn" / "fail", detail, fix). Tests drive them with recorded facts (tests/data/doctor/: a p5
  and a ConnectX node written from documentation and libfabric's source, not captured on hardware).

Exit status of `moe-a2a doctor`: 0 when no check fails (warnings allowed: a CPU machine without RDMA
devices exits 0 with a warning), 1 when at least one check fails, 2 for a bad flag. docs/transport.md,
"Bring-up checklist", shows the expected output per host kind.

torch is imported only to size the registrations (`A2AConfig` validates its dtypes with torch); the GPU
facts come from NVML (pynvml), not torch.
"""
from __future__ import annotations

# The files: facts.py (gathering), the checks by subject: fabric.py (libfabric and its providers),
# devices.py (RDMA devices, GPUs, the NIC map), registration.py (GPU memory and registration sizes),
# limits.py (memlock, the environment); common.py (Check, the constants), report.py (verdicts, text, JSON,
# the command). The names below are what cli.py and the tests use.
from .common import (CAP_BITS, DECODE, DEFAULT_NODE, DEFAULT_TOKENS, DEFAULT_WORLD,  # noqa: F401
                     CUDART_NAME, EFA_INSTALLER_MANIFEST, EFA_INSTALLER_PREFIX, EFA_REMOTE_WRITE_MR_MAX_PAGES, KSYM_DMABUF,
                     KSYM_PEER_MEMORY, MODULES, MR_MODE_BITS, PEER_MEMORY_MODULES, PROVIDERS, RDMA_PROVIDERS,
                     SCHEMA, VERDICTS, Check, bit_names)
from .devices import check_gpus, check_nic_map, check_proxy_gpu, check_rdma_cm, check_rdma_devices  # noqa: F401
from .fabric import (check_efa_installer, check_libfabric, check_local_provider,  # noqa: F401
                     check_rdma_provider, check_transport)
from .facts import (collect_facts, cudart_facts, efa_installer_facts, gpu_facts, interface_addresses,  # noqa: F401
                    kallsyms_facts, library_facts, module_facts, provider_facts, rdma_cm_facts, rdma_device_facts,
                    registration_sizes)
from .limits import ENV_NOTES, check_environment, check_memlock  # noqa: F401
from .registration import check_fi_hmem, check_gpu_peer_memory, check_gpu_registration, check_registration  # noqa: F401
from .report import exit_code, format_text, load_facts, report, run, run_checks, summary  # noqa: F401
