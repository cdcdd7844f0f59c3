"""Latency MODEL of moe_a2a dispatch / combine (a model, NOT a measurement where it predicts).

Predicts one dispatch and one combine of the decode configuration (T=128 tokens/rank, H=7168 fp8 + 56
fp32 scales, K=8 of E=256 experts, bf16 combine) at EP16/32/64 with 8 GPUs per node on two fabrics:

- ``"efa"``: AWS EFA, 2 x 200 Gb/s NICs per GPU, peers sharded across the NICs in contiguous ranges
  (moe_a2a/proxy/engine.py: peer i -> domain i*D//N);
- ``"cx7"``: ConnectX-7, one 400 Gb/s NIC per GPU;

and, to check the model against what we measured, on ``"emulated"``: the emulated NIC between simulated
nodes whose ranks share ONE H200 under MPS (the configuration of docs/results/gpu-2026-12-02-mps/), and on
``"shm"``: libfabric's shm provider, host-staged buffers (the proxy bench's provider).

How: a critical-path walk of ONE call of the protocol (docs/protocol.md, section 3), all ranks in
lock-step (every rank starts each half together, so what a rank receives from its peers happens at the
same time as what it sends them). The GPU plans every remote write. Same-node peers synchronise inside
the kernels (release-store an epoch word, the consumer spins on it). With remote peers a one-program
kernel ``plan_private_writes`` runs between route and pack and writes the PRIVATE write table; at
SEND_READY the proxy (one Python process per NIC on EFA, posting serially) posts it, one write per remote
peer (the count row at its head); it counts the peers' immediates and raises COUNT_ROWS_READY;
``plan_remainder_and_combine_writes`` (head of the dispatch recv half) waits for it, copies and checks the
count rows, writes the REMAINDER and COMBINE tables and raises REMAINDER_PLANNED; the proxy posts the
REMAINDER table only when a remainder is needed (then it waits for REMAINDER_PLANNED: a GPU -> proxy ->
GPU round trip), and raises DISPATCH_RECV_READY; at combine it posts the COMBINE table and raises
COMBINE_RECV_READY once every peer's write is in. Each consumer / producer kernel is preceded by a
one-warp wait kernel. The proxy does no arithmetic.

Each event carries the breakdown (term -> µs) of the path that led to it; joining two branches keeps the
later one, so the terms of a phase are its critical-path contributions and sum to the phase total.

Before it predicts, :func:`calibration` sets it against measured configurations: (a) node-local on 2 x H200
(graph replay, decode; (a2), (a3) the same on other leases); (e) ``python -m benchmarks.proxy``: the proxy alone
against synthetic peers (1 x H200 host, shm); and the cross-node calibration of this protocol, 1 x H200
shared by W ranks under MPS (2026-12-02, graph replay, kernel waits): (f) the W ranks on one node, (g) the
same ranks as simulated nodes over the emulated NIC (fabric ``"emulated"``: the real proxies, each remote
write a CUDA copy between the ranks' buffers on the one GPU), (h) the node-local reproduction. Fitting
data are the W=2 runs and the node-local runs; (g) at W=4 and W=8 and (h) are held out (:data:`HELD_OUT`:
no constant is read from them). Every constant below is in :data:`PROVENANCE` (measured, with file and
date; derived from measured ones; the workload's configuration; or ASSUMPTION).

Issue 32's levers are options of the walk, their kernels charged as measured at 2 ranks; issue 46's runs of
them on one H200 under MPS are set against it with every row held out (:func:`issue46_rows`: within 25 %, or
the term the walk lacks named); and ``relay=True`` walks issue 46's relay (one write per remote node, the NVLink
fan-out and the node-level reduce as GPU terms), timed so far only with 8 ranks sharing one GPU
(:func:`relay_runs`, held out): elsewhere predictions only.

Run from the repository root (the page docs/latency-model.md shows its tables):

    python -m benchmarks.latency_model --png docs/latency-model.png --json /tmp/latency-model.json
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
from dataclasses import dataclass, field, replace

import numpy as np

from moe_a2a.bench._util import fraction, nonneg_float

# ---- workload: the decode configuration (docs/design.md, Benchmarks) ----------------------------------
TOKENS = 128                      # T, tokens per rank
TOPK = 8                          # K, distinct experts per token
NUM_EXPERTS = 256                 # E
DISPATCH_ROW_BYTES = 7392         # 7168 B fp8 + 56 fp32 scales
COMBINE_ROW_BYTES = 14336         # 7168 bf16
ROUTE_ROW_BYTES = 4 * NUM_EXPERTS  # one int32 count per expert: the routing row each rank sends
GPUS_PER_NODE = 8                 # p5en / DGX H200
# The three levers of issue 32 (moe_a2a/reference.py, `Wire` and `row_bytes`): a dispatch row per (token,
# rank) carries per k an int32 local expert and position, and its K fp32 weights when the combine is reduced at the
# sender (16-byte padded); an fp8 combine row is 7168 B of e4m3 + 56 fp32 scales (128-element blocks).
RANK_ROW_IDS_BYTES = 8 * TOPK     # 64 B: per k an int32 local expert and an int32 position
RANK_ROW_WEIGHTS_BYTES = 4 * TOPK  # 32 B
FP8_COMBINE_ROW_BYTES = 7392      # 7168 + 56 x 4
# The relay (issue 46): a GPU's weighted partial of a token goes to the relay in fp32 (the
# combine "reduced inside the experts' node in fp32"); a bf16 partial would halve these NVLink bytes.
RELAY_PARTIAL_ROW_BYTES = 2 * COMBINE_ROW_BYTES   # ASSUMPTION: 7168 fp32

# ---- GPU side, H200 (measured) ----------------------------------------------------------------------
# Kernel GPU time inside a CUDA graph, rank 0 of a 64-rank layout, all rows in local memory
# (docs/results/kernels.json). Under uniform routing a rank handles T*K rows at any W, so
# these do not scale with W; rows that cross NVLink or PCIe are charged on top (see _gpu).
K_ROUTE_TOKENS = 4.58
K_PACK_TOKENS = 3.26
K_UNPACK_TOKENS = 8.66
K_PACK_COMBINE = 7.60
K_REDUCE_COMBINE = 4.07
LAUNCH_GPU_US = 1.43              # one empty launch in a graph: the one-warp wait kernels (kernels.json)
HALF_GAP_US = 4.0                 # between one half's graph and the next on the kernel timeline: 4.0/5.0
                                  # (e2e_graph_x2.json trace), 3.4/3.6 µs (e2e_graph_x2_n1.json trace)
HBM_COPY_GBPS = 4261.0            # device copy (kernels.json): the HBM floor, for reference only
NVLINK_GBPS = 358.0               # GPU0 -> GPU1 copy of 64 MiB, 2 x H200 NV18 (assumption: no raw file)
PEER_FLAG_RTT_US = 2.7            # GPU <-> GPU flag through peer memory (assumption: no raw file)
FLAG_RTT_US = 6.14                # GPU -> proxy process -> GPU through pinned host memory (flags.json)
# Host-staged buffers: the row kernels read / write pinned host memory over PCIe. Pooled over the four
# row kernels of both ranks in the e2e_graph_x2_n1.json trace: 89.0 MB in 1767 µs (span - kernel time).
HOST_STAGED_GBPS = 50.0
# The write-plan kernels are ONE program: it reads the count rows in [16, W, L] tiles (16 KB of loads in
# flight per step at E=256), one PCIe round trip per step when they are in host memory. No GPU timing of
# these kernels exists yet: the rate is assumed, a sixth of HOST_STAGED_GBPS
# (~2 µs per 16 KB step).
PLAN_PCIE_GBPS = 8.0              # ASSUMPTION

# ---- the provider's own cost: transport micro-benchmarks on the GPU host (2026-11-30) ------------------
# docs/results/transport_gpu_host.json (2 x H200 host, shm provider, fi_writemsg replaced by a no-op for
# the Python cost).
POST_US = 1.49                    # the engine's Python per write (that day's engine), 63 targets, median
SHM_POST_C_US = 0.78              # shm provider's own C per write: scatter-63 post 2.27/write - POST_US
# The receiving proxy's copy over shm (the shm fabric only: the data lands when the receiving proxy copies
# it): 18.5 MB in 2078 µs over the three data writes of the e2e_graph_x2_n1.json trace (452.7, 878.3,
# 747.2 µs; a 2 x H200 run of 2026-11-30 whose protocol has since changed: the copy rate is the provider's)
SHM_COPY_GBPS = 8.9
# What-if only, not our implementation: a C helper posting a whole table (docs/transport.md "Not done").
POST_US_C_HELPER = 0.2            # ASSUMPTION

# ---- the proxy: `python -m benchmarks.proxy` (1 x H200 host, shm, H=64, 2026-12-01) ---------------------------
# docs/results/emulated/proxy_shm.json: the real proxy process against synthetic peers whose writes are in
# before each call; the tables as the kernels write them; H=64 rows (80 B), so the loop is timed, not bytes.
BENCH_POST_PRIVATE_US = 2.81      # post_us_per_write.dispatch_private, W=64 (63 writes): Python + shm's C
BENCH_POST_COMBINE_US = 2.51      # post_us_per_write.combine, W=64
IMM_US = 0.294                    # parts.dispatch_imms_rows_us / 63, W=64: counting one peer's private imm
COMBINE_IMM_US = 0.203            # parts.combine_imms_us / 63, W=64
DISPATCH_STEPS_US = 8.41          # the dispatch's fixed steps (flags, trace stamps, the REMAINDER check):
                                  # dispatch_host_us at W=2 - BENCH_POST_PRIVATE_US - IMM_US
COMBINE_STEPS_US = 4.36           # combine_host_us at W=2 - BENCH_POST_COMBINE_US - COMBINE_IMM_US
REMAINDER_ROW_US = 0.35           # the REMAINDER table's loop visits every peer's row (skipping empty ones):
                                  # (remainder_us W=256 - remainder_us W=64 - 5.47 writes x 2.81) / 255
# The Python part of a post, for the NIC fabrics (their provider's own cost is NIC_POST_C_US): the new
# bench's shm post per write less shm's C cost per write (transport_gpu_host.json, the same host).
POST_PY_PRIVATE_US = BENCH_POST_PRIVATE_US - SHM_POST_C_US
POST_PY_COMBINE_US = BENCH_POST_COMBINE_US - SHM_POST_C_US
# The proxy's steps between COUNT_ROWS_READY and DISPATCH_RECV_READY with no remainder (the REMAINDER
# check, the writes-posted count, trace stamps, the flag): the same Python whatever carries the writes.
BENCH_W2_STEPS_US = 2.29          # proxy_shm.json W=2: parts.remainder_us 0.81 + parts.dispatch_tail_us 1.48

# ---- the emulated NIC on ONE H200 shared by W ranks under MPS (2026-12-02) ------------------------------
# docs/results/gpu-2026-12-02-mps/: `moe-a2a bench e2e --graph --no-nccl --world W --node N --transport T
# --iters 100 --warmup 10`, graph replay, kernel waits (gpu_wait="kernel"), several rank processes on the
# one GPU under MPS (SMs, HBM and copy engines shared by the W ranks), one proxy per rank. Fitting data:
# the node-local runs (N = W, mapped memory, no proxy) at W = 2, 4, 8, which give how much slower the
# GPU side is when W ranks share the GPU, and the W=2 run over the emulated NIC (W2-N1), whose traced call
# gives the proxy's in-run costs and the carrier's latency. Held out: W4-N2, W8-N4, mps_node_local.py.
MPS_NODE_LOCAL_W2_US = 78.1       # e2e_graph_w2n2_auto.json: slowest rank's dispatch + combine median
MPS_NODE_LOCAL_W4_US = 164.9      # e2e_graph_w4n4_auto.json
MPS_NODE_LOCAL_W8_US = 284.6      # e2e_graph_w8n8_auto.json
# The proxy inside the W2-N1 run (one traced call per rank, graph replay, kernel waits), mean of 2 ranks:
EMU_RUN_STEPS_US = 3.79           # count_rows_received -> dispatch_received: 4.38 / 3.20 (rank 0 / 1)
EMU_RUN_PRIVATE_POST_US = 27.24   # send_ready_seen -> private_posted, one write: 31.52 / 22.95
EMU_RUN_COMBINE_POST_US = 28.75   # combine_send_seen -> combine_posted, one write: 33.82 / 23.68
MPS_EMULATED_W2_US = 260.2       # e2e_graph_w2n1_emulated.json: slowest rank's dispatch + combine median
EMU_LATENCY_US = 27.16            # a peer's X_posted -> this rank's count_rows_received / combine_received
                                  # (lock-step: the peer posted when we did), mean of the 4 (2 ranks x 2 phases)
# The CUDA carrier's host cost per posted write, alone (2 processes on the H200, zero-length writes: the
# engine's post, the immediate's stream write, an event): docs/results/emulated/emulated_gpu_tests_helper.txt
EMU_POST_US = 4.0                 # host time per zero-length write, [3.87, 4.12] µs on the 2 ranks, mean

# How much slower the proxy's work is inside a run than in the bench, measured with kernel waits and graph
# replay: the steps after COUNT_ROWS_READY, which no carrier takes part in, in the W2-N1 run over the
# bench's at W=2. The predictions use this factor (`--speed run`).
PROXY_IN_RUN_FACTOR = EMU_RUN_STEPS_US / BENCH_W2_STEPS_US
# The emulated carrier's fixed cost per posted table (beyond its writes), at bench speed: the in-run post
# of one write over the factor, less one write.
EMU_PRIVATE_TABLE_US = EMU_RUN_PRIVATE_POST_US / PROXY_IN_RUN_FACTOR - EMU_POST_US
EMU_COMBINE_TABLE_US = EMU_RUN_COMBINE_POST_US / PROXY_IN_RUN_FACTOR - EMU_POST_US

# The factor measured before, with host waits: the proxy's posts inside `bench e2e --trace-proxy` over shm
# (docs/results/emulated/e2e_shm_trace.json: W=2 on ONE H200, host waits, eager, decode sizes), mean of the
# two ranks' medians, against the bench at W=2 (one write per table). `--speed host-waits` charges it.
RUN_PRIVATE_POST_US = 14.98       # proxy.private_post: 13.92 (rank 0), 16.03 (rank 1)
RUN_COMBINE_POST_US = 16.61       # proxy.combine_post: 10.39, 22.82
BENCH_W2_PRIVATE_POST_US = 5.74   # proxy_shm.json W=2: parts.dispatch_post_us
BENCH_W2_COMBINE_POST_US = 5.10   # proxy_shm.json W=2: parts.combine_post_us
PROXY_HOST_WAITS_FACTOR = ((RUN_PRIVATE_POST_US + RUN_COMBINE_POST_US)
                           / (BENCH_W2_PRIVATE_POST_US + BENCH_W2_COMBINE_POST_US))

# The emulated NIC's settings (MOE_A2A_EMULATED_NIC, docs/transport.md): a write's immediate is counted only
# once the copy has landed AND its release time has passed: the host-clock schedule of its proxy's one NIC
# (b / bandwidth after the previous write, from its post) plus the latency. Issue 46's EFA-like runs set them so.
EMU_NIC_EFA_LIKE_LATENCY_US = 12.0  # MOE_A2A_EMULATED_NIC=12us,25GBps
EMU_NIC_EFA_LIKE_GBPS = 25.0
# EFA at the run's stretch (`run.sh mps relay`, relay_scaled/): 12us,25GBps with the latency times and the
# bandwidth over `emulated_stretch(8)` (~7.2, rounded), so the wire's share of the call is EFA's with a GPU a rank.
EMU_NIC_EFA_SCALED_LATENCY_US = 87.0  # MOE_A2A_EMULATED_NIC=87us,3.5GBps
EMU_NIC_EFA_SCALED_GBPS = 3.5
# The carrier's host cost per write with settings on (the schedule kept per write): zero-length writes,
# "NIC 20us,10GBps" [4.35, 4.07] µs (emulated_gpu_tests_helper.txt), mean
EMU_POST_PACED_US = 4.21

# ---- issue 32's kernels, per wire variant: `python3 benchmarks/gpu/wire_kernels.py --world 2 --preset decode`
# (1 x H200 under MPS, 2 ranks of one node, graph replay, median GPU time per launch position, the data
# kernels after their separate wait kernels; docs/results/gpu-2026-12-02-s11/lease3/, commit 446d984; the
# per-route fp8 pack at 9d27bf2). The walk charges a variant its kernels' difference from per_route's in the
# same run (the wait kernels left out: their time is the peers'), over the W=2 sharing factor: what the
# variant's kernels add to (or take from) the route rows' kernels of kernels.json.
W2_SEND_ROUTE_US = 18.09          # per_route: route_tokens (block 2.59 + fixup 3.52) + pack 11.98
W2_SEND_RANK_US = 30.48           # per_rank_dispatch: route 2.62 + 4.67, first route per rank 2.38, route again
                                  # 1.70 + 5.50, stamp 4.43, pack 9.18 (three more launches)
W2_UNPACK_US = 12.77              # per_route: unpack
W2_EXPAND_US = 14.64              # per_rank_dispatch: the expand of rows per (token, rank)
W2_COMBINE_PACK_US = 25.62        # per_route: combine pack (one row per route)
W2_REDUCE_BY_SOURCE_US = 34.78    # sender_reduced: the reduce by source at the experts' rank, bf16 rows
W2_REDUCE_BY_SOURCE_FP8_US = 33.78  # sender_reduced_fp8: the same, fp8 rows
W2_REDUCE_US = 8.10               # per_route: reduce (K rows a token)
W2_REDUCE_RANK_US = 6.26          # sender_reduced: reduce of rows per (token, rank), bf16
W2_REDUCE_RANK_FP8_US = 6.56      # sender_reduced_fp8: the same, fp8 rows
W2_FP8_COMBINE_PACK_US = 55.14    # fp8_combine (wire_kernels_fp8_decode.json, 9d27bf2): the route rows' fp8 pack
W2_FP8_REDUCE_US = 8.80           # fp8_combine: reduce of fp8 route rows

# ---- NIC fabrics: nothing here is measured by us (no EFA or InfiniBand host) --------------------------
EFA_NICS = 2                      # 2 x 200 Gb/s per GPU (the article: "two 200 Gbps NICs are aggregated")
EFA_NIC_GBPS = 200 / 8            # line rate, GB/s
# Lower bound implied by pplx-garden's EFA combine at EP64 (12.8 MB remote per rank in <= 391 µs:
# >= 0.66 of line rate); the article's "EFA is 2x slower than CX7 at 256 KB" would mean ~0.45.
EFA_BW_EFFICIENCY = 0.70          # ASSUMPTION (--efa-efficiency 0.45: the article's reading)
EFA_MSG_LATENCY_US = 12.0         # ASSUMPTION: public EFA small-message latencies are ~10-15 µs
CX7_NICS = 1
CX7_NIC_GBPS = 400 / 8            # line rate, GB/s (ConnectX-7 datasheet)
CX7_BW_EFFICIENCY = 0.90          # ASSUMPTION: >= 100 KB RC writes near line rate
CX7_MSG_LATENCY_US = 2.5          # ASSUMPTION: typical ib_write_lat figures
NIC_POST_C_US = 0.3               # ASSUMPTION: the efa / verbs provider's own cost per posted write

FABRICS = ("efa", "cx7")
WORLDS = (16, 32, 64)
# The proxy's speed: as inside our graph runs with kernel waits (the default), as in its benchmark, or as
# inside the eager run with host waits.
SPEEDS = ("run", "bench", "host-waits")
# Critical-path terms (predict() returns every one, zero where unused).
TERMS = ("kernels", "plan_kernels", "pcie", "nvlink", "flags", "proxy_post", "proxy_imms", "proxy_steps", "wire",
         "fanout", "node_reduce")
# The relay's own GPU terms (zero without it): its forward kernel and the rows it pushes to the node's GPUs
# over NVLink; the partials' NVLink bytes to the relay and its summing kernel.
RELAY_TERMS = ("fanout", "node_reduce")
# The project's targets for dispatch + combine on EFA (µs).
ISSUE_TARGETS_US = {16: 400.0, 32: 500.0, 64: 600.0}
# Issue 46's targets for the relay (model, EFA, dispatch + combine µs): bf16 combine, and fp8 combine.
RELAY_TARGETS_US = {"bf16": {16: 250.0, 32: 400.0, 64: 550.0}, "fp8": {16: 200.0, 32: 300.0, 64: 420.0}}

_RUN = "docs/results/e2e_graph_x2_n1.json (trace, 2 x H200, 2026-11-30)"
_TGH = "docs/results/transport_gpu_host.json (2026-11-30)"
_MPS = "docs/results/gpu-2026-12-02-mps"
_MPS_W2 = f"{_MPS}/e2e_graph_w2n1_emulated.json (bench e2e --graph, 1 x H200 under MPS, W2-N1, trace, 2026-12-02)"
_EGH = "docs/results/emulated/emulated_gpu_tests_helper.txt (2026-12-01)"
_KJ = "docs/results/kernels.json (2026-11-29)"
_WK = ("docs/results/gpu-2026-12-02-s11/lease3/wire_kernels_decode.json (benchmarks/gpu/wire_kernels.py --world 2 "
       "--preset decode, 1 x H200 under MPS, commit 446d984, 2026-12-02)")
_WK_FP8 = ("docs/results/gpu-2026-12-02-s11/lease3/wire_kernels_fp8_decode.json (the same script, --wires "
           "fp8_combine, commit 9d27bf2, 2026-12-02)")
_PSHM = "docs/results/emulated/proxy_shm.json (bench proxy, 1 x H200 host, shm, H=64, 2026-12-01)"
_ESHM = "docs/results/emulated/e2e_shm_trace.json (bench e2e --trace-proxy, shm, W=2, 2026-12-01)"
# Where every constant comes from: name -> (kind, source). kind: measured | derived (from measured
# ones) | config (the workload's definition) | assumption. Checked by tests/benchmarks/test_latency_model.py.
PROVENANCE = {
    "TOKENS": ("config", "decode: 128 tokens per rank (docs/design.md, Benchmarks)"),
    "TOPK": ("config", "decode: top-8"),
    "NUM_EXPERTS": ("config", "decode: 256 experts"),
    "DISPATCH_ROW_BYTES": ("config", "7168 B fp8 + 56 fp32 scales (docs/protocol.md, section 5)"),
    "COMBINE_ROW_BYTES": ("config", "7168 bf16 (docs/protocol.md, section 5)"),
    "ROUTE_ROW_BYTES": ("config", "one int32 per expert (docs/protocol.md, 2.1)"),
    "GPUS_PER_NODE": ("config", "8 H200 per node (p5en, DGX H200)"),
    "RANK_ROW_IDS_BYTES": ("config", "issue 32: a per-(token, rank) dispatch row carries per k an int32 local "
                                     "expert and an int32 position (A2AConfig.rank_meta_bytes, reference.row_bytes)"),
    "RANK_ROW_WEIGHTS_BYTES": ("config", "issue 32: and the K fp32 weights when the combine is reduced at the sender"),
    "RELAY_PARTIAL_ROW_BYTES": ("assumption", "issue 46: the relay's partials travel in fp32 (7168 x 4 B; the "
                                              "combine reduced inside the experts' node in fp32); bf16 would halve "
                                              "them"),
    "FP8_COMBINE_ROW_BYTES": ("config", "issue 32: fp8 combine row, 7168 B e4m3 + 56 fp32 scales (128-element "
                                        "blocks, as the dispatch's)"),
    "K_ROUTE_TOKENS": ("measured", f"{_KJ}: route_tokens, decode, graph replay"),
    "K_PACK_TOKENS": ("measured", f"{_KJ}: pack_tokens_by_expert"),
    "K_UNPACK_TOKENS": ("measured", f"{_KJ}: unpack_tokens_by_expert"),
    "K_PACK_COMBINE": ("measured", f"{_KJ}: pack_combine_by_source"),
    "K_REDUCE_COMBINE": ("measured", f"{_KJ}: reduce_combined_tokens"),
    "LAUNCH_GPU_US": ("measured", f"{_KJ}: launch_us (an empty launch in a graph); also the launch of each "
                                  "write-plan kernel"),
    "HALF_GAP_US": ("measured", "kernel timelines of docs/results/e2e_graph_x2.json and e2e_graph_x2_n1.json "
                                "(2026-11-30): dispatch end -> combine start 4.0, 5.0, 3.4, 3.6 µs"),
    "HBM_COPY_GBPS": ("measured", f"{_KJ}: copy_bw_GBps (floor only)"),
    "NVLINK_GBPS": ("assumption", "a 2 x H200 measurement of 2026-11-30 (64 MiB copy_, GPU0 -> GPU1), raw file "
                                  "lost (docs/benchmarks.md, hardware and host-side costs)"),
    "PEER_FLAG_RTT_US": ("assumption", "a 2 x H200 measurement of 2026-11-30 (GPU-to-GPU flag round trip through "
                                       "peer memory), raw file lost (docs/benchmarks.md, hardware and host-side costs)"),
    "FLAG_RTT_US": ("measured", "docs/results/flags.json (2026-11-29): median GPU -> proxy -> GPU"),
    "HOST_STAGED_GBPS": ("measured", f"{_RUN}: pack, unpack, combine pack, reduce spans of both ranks, "
                                     "bytes / (span - kernel time) = 50.4 GB/s (the only host-staged GPU "
                                     "run; its protocol has since changed, the PCIe rate has not; "
                                     "`--host-staged` only)"),
    "PLAN_PCIE_GBPS": ("assumption", "one-program write-plan kernel reading count rows from host memory, "
                                     "16 KB per ~2 µs step (no GPU timing of these kernels yet)"),
    "POST_US": ("measured", f"{_TGH}: shm python_post, 63 peers, median (that day's engine; only to split "
                            "the shm post into Python and C: SHM_POST_C_US)"),
    "SHM_POST_C_US": ("derived", f"{_TGH}: shm scatter 63 peers post per write 2.27 - POST_US"),
    "SHM_COPY_GBPS": ("measured", f"{_RUN}: posted (sender) -> received (receiver) of the 3 data writes (the "
                                  "shm fabric only)"),
    "POST_US_C_HELPER": ("assumption", "what-if: a C helper posting a table in one call"),
    "BENCH_POST_PRIVATE_US": ("measured", f"{_PSHM}: post_us_per_write.dispatch_private at W=64 (63 writes)"),
    "BENCH_POST_COMBINE_US": ("measured", f"{_PSHM}: post_us_per_write.combine at W=64"),
    "IMM_US": ("measured", f"{_PSHM}: parts.dispatch_imms_rows_us median / 63 remote peers at W=64 "
                           "(18.5 µs; the immediates already in)"),
    "COMBINE_IMM_US": ("measured", f"{_PSHM}: parts.combine_imms_us median / 63 at W=64 (12.8 µs)"),
    "DISPATCH_STEPS_US": ("derived", f"{_PSHM}: dispatch_host_us median at W=2 (11.52) - BENCH_POST_PRIVATE_US "
                                     "- IMM_US"),
    "COMBINE_STEPS_US": ("derived", f"{_PSHM}: combine_host_us median at W=2 (7.07) - BENCH_POST_COMBINE_US "
                                    "- COMBINE_IMM_US"),
    "REMAINDER_ROW_US": ("derived", f"{_PSHM}: (parts.remainder_us at W=256 (106.1) - at W=64 (1.0) - "
                                    "remainder_writes_per_call at W=256 (5.47) x BENCH_POST_PRIVATE_US) / 255"),
    "POST_PY_PRIVATE_US": ("derived", "BENCH_POST_PRIVATE_US - SHM_POST_C_US: the Python part of a post, for "
                                      "EFA / CX7 (chosen over POST_US: it times the current post_table path)"),
    "POST_PY_COMBINE_US": ("derived", "BENCH_POST_COMBINE_US - SHM_POST_C_US"),
    "RUN_PRIVATE_POST_US": ("measured", f"{_ESHM}: proxy.private_post medians 13.92 / 16.03 (rank 0 / 1), mean"),
    "RUN_COMBINE_POST_US": ("measured", f"{_ESHM}: proxy.combine_post medians 10.39 / 22.82, mean"),
    "BENCH_W2_PRIVATE_POST_US": ("measured", f"{_PSHM}: parts.dispatch_post_us median at W=2"),
    "BENCH_W2_COMBINE_POST_US": ("measured", f"{_PSHM}: parts.combine_post_us median at W=2"),
    "PROXY_HOST_WAITS_FACTOR": ("derived", "(RUN_PRIVATE_POST_US + RUN_COMBINE_POST_US) / "
                                           "(BENCH_W2_PRIVATE_POST_US + BENCH_W2_COMBINE_POST_US): in-run posts "
                                           "over the bench's, shm, W=2, host waits (`--speed host-waits`)"),
    "BENCH_W2_STEPS_US": ("measured", f"{_PSHM}: parts.remainder_us (0.81) + parts.dispatch_tail_us (1.48) "
                                      "medians at W=2"),
    "MPS_NODE_LOCAL_W2_US": ("measured", f"{_MPS}/e2e_graph_w2n2_auto.json (bench e2e --graph, 1 x H200 under "
                                         "MPS, W2-N2, 2026-12-02): decode, slowest rank's total median"),
    "MPS_NODE_LOCAL_W4_US": ("measured", f"{_MPS}/e2e_graph_w4n4_auto.json (W4-N4, 2026-12-02): decode, slowest "
                                         "rank's total median"),
    "MPS_NODE_LOCAL_W8_US": ("measured", f"{_MPS}/e2e_graph_w8n8_auto.json (W8-N8, 2026-12-02): decode, slowest "
                                         "rank's total median"),
    "EMU_RUN_STEPS_US": ("measured", f"{_MPS_W2}: decode, count_rows_received -> dispatch_received, mean of "
                                     "the 2 ranks (4.38, 3.20)"),
    "EMU_RUN_PRIVATE_POST_US": ("measured", f"{_MPS_W2}: decode, send_ready_seen -> private_posted (one write), "
                                            "mean of the 2 ranks (31.52, 22.95)"),
    "EMU_RUN_COMBINE_POST_US": ("measured", f"{_MPS_W2}: decode, combine_send_seen -> combine_posted (one "
                                            "write), mean of the 2 ranks (33.82, 23.68)"),
    "MPS_EMULATED_W2_US": ("measured", f"{_MPS_W2}: decode, slowest rank's total median (rank 0)"),
    "EMU_GPU_FACTOR": ("derived", f"solved so that the walk gives MPS_EMULATED_W2_US ({_MPS}/"
                                  "e2e_graph_w2n1_emulated.json): the GPU side of a call with remote peers on the "
                                  "shared GPU over the same ranks' node-local call there"),
    "EMU_LATENCY_US": ("measured", f"{_MPS_W2}: decode, the peer's private_posted -> count_rows_received and "
                                   "combine_posted -> combine_received, mean of the 4"),
    "EMU_POST_US": ("measured", f"{_EGH}: CUDA carrier, NIC 0, host time per zero-length write [3.87, 4.12] "
                                "µs, mean"),
    "EMU_NIC_EFA_LIKE_LATENCY_US": ("config", "issue 46's EFA-like runs: MOE_A2A_EMULATED_NIC=12us,25GBps (latency "
                                              "per write; docs/transport.md, the emulated NIC)"),
    "EMU_NIC_EFA_LIKE_GBPS": ("config", "issue 46's EFA-like runs: MOE_A2A_EMULATED_NIC=12us,25GBps (bandwidth per "
                                        "NIC, i.e. per proxy)"),
    "EMU_NIC_EFA_SCALED_LATENCY_US": ("config", "issue 46's runs at EFA's share: MOE_A2A_EMULATED_NIC=87us,3.5GBps "
                                                "(12 µs times emulated_stretch(8), rounded)"),
    "EMU_NIC_EFA_SCALED_GBPS": ("config", "issue 46's runs at EFA's share: MOE_A2A_EMULATED_NIC=87us,3.5GBps "
                                          "(25 GB/s over emulated_stretch(8), rounded)"),
    "BENCH_MASKED_ROUTES": ("config", "moe_a2a/bench/demo.py make_inputs, routing 'random': each route -1 with "
                                      "probability 0.1 (the bytes check of issue 46's runs only; the walk leaves "
                                      "it out)"),
    "EMU_POST_PACED_US": ("measured", f"{_EGH}: CUDA carrier, NIC 20us,10GBps, host time per zero-length write "
                                      "[4.35, 4.07] µs, mean"),
    **{name: ("measured", f"{_WK}: {what}") for name, what in (
        ("W2_SEND_RANK_US", "per_rank_dispatch, the dispatch send half's kernels (route 2.62 + 4.67, first route "
                            "per rank 2.38, route 1.70 + 5.50, stamp 4.43, pack 9.18)"),
        ("W2_SEND_ROUTE_US", "per_route, route 2.59 + 3.52 + pack 11.98"),
        ("W2_UNPACK_US", "per_route, unpack"),
        ("W2_EXPAND_US", "per_rank_dispatch, expand"),
        ("W2_COMBINE_PACK_US", "per_route, combine pack"),
        ("W2_REDUCE_BY_SOURCE_US", "sender_reduced, the reduce by source (combine send)"),
        ("W2_REDUCE_BY_SOURCE_FP8_US", "sender_reduced_fp8, the reduce by source (combine send)"),
        ("W2_REDUCE_US", "per_route, reduce (combine receive)"),
        ("W2_REDUCE_RANK_US", "sender_reduced, reduce (combine receive)"),
        ("W2_REDUCE_RANK_FP8_US", "sender_reduced_fp8, reduce (combine receive)"))},
    "W2_FP8_COMBINE_PACK_US": ("measured", f"{_WK_FP8}: fp8_combine, the route rows' fp8 combine pack"),
    "W2_FP8_REDUCE_US": ("measured", f"{_WK_FP8}: fp8_combine, reduce (combine receive)"),
    "PROXY_IN_RUN_FACTOR": ("derived", "EMU_RUN_STEPS_US / BENCH_W2_STEPS_US: the proxy's steps after "
                                       "COUNT_ROWS_READY inside the W2-N1 graph run (kernel waits) over the "
                                       "bench's at W=2"),
    "EMU_PRIVATE_TABLE_US": ("derived", "EMU_RUN_PRIVATE_POST_US / PROXY_IN_RUN_FACTOR - EMU_POST_US: the "
                                        "emulated carrier's fixed cost per PRIVATE table post, bench speed"),
    "EMU_COMBINE_TABLE_US": ("derived", "EMU_RUN_COMBINE_POST_US / PROXY_IN_RUN_FACTOR - EMU_POST_US"),
    "EFA_NICS": ("config", "2 x 200 Gb/s per GPU (Perplexity's article; p5en)"),
    "EFA_NIC_GBPS": ("assumption", "line rate 200 Gb/s (datasheet value, not measured by us)"),
    "EFA_BW_EFFICIENCY": ("assumption", "lower bound implied by pplx-garden's EFA combine at EP64 (not ours)"),
    "EFA_MSG_LATENCY_US": ("assumption", "public EFA small-message latencies, ~10-15 µs"),
    "CX7_NICS": ("config", "one ConnectX-7 per GPU"),
    "CX7_NIC_GBPS": ("assumption", "line rate 400 Gb/s (ConnectX-7 datasheet, not measured by us)"),
    "CX7_BW_EFFICIENCY": ("assumption", ">= 100 KB RC writes near line rate"),
    "CX7_MSG_LATENCY_US": ("assumption", "typical ib_write_lat figures"),
    "NIC_POST_C_US": ("assumption", "efa / verbs provider cost per fi_writemsg (a WQE and a doorbell)"),
}


def constants() -> dict:
    """Every numeric module constant (what PROVENANCE must cover)."""
    return {k: v for k, v in globals().items()
            if k.isupper() and not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool)}


# ---- fabrics -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fabric:
    name: str
    nics: int
    gbps: float                   # effective GB/s per NIC; shm: the receiving proxy's copy rate
    latency_us: float             # one-way per-message latency
    post_c_us: float              # the provider's own cost per posted write
    receiver_copies: bool         # shm: data lands only when the receiving proxy copies it (while it polls)
    host_staged: bool             # buffers in pinned host memory: every row kernel crosses PCIe
    # The emulated NIC: its post_c_us is the carrier's whole host cost per write (the engine's Python
    # included), plus a fixed cost per posted table; its ranks share one GPU (the setup's gpu_share).
    table_us: tuple = (0.0, 0.0)  # (PRIVATE, COMBINE) fixed cost per posted table, bench speed


def fabric(name: str, efa_efficiency: float | None = None) -> Fabric:
    if name == "efa":
        eff = EFA_BW_EFFICIENCY if efa_efficiency is None else efa_efficiency
        return Fabric("efa", EFA_NICS, EFA_NIC_GBPS * eff, EFA_MSG_LATENCY_US, NIC_POST_C_US, False, False)
    if name == "cx7":
        return Fabric("cx7", CX7_NICS, CX7_NIC_GBPS * CX7_BW_EFFICIENCY, CX7_MSG_LATENCY_US, NIC_POST_C_US,
                      False, False)
    if name == "shm":
        return Fabric("shm", 1, SHM_COPY_GBPS, 0.0, SHM_POST_C_US, True, True)
    if name == "emulated":
        # one proxy per rank = one CUDA stream = one NIC; a write is a copy inside the one GPU's HBM
        # its latency was measured at W=2 (the wire's copies run on the shared GPU: it scales with gpu_share,
        # setup() makes that setup(2, "emulated", node=1).gpu_share there)
        return Fabric("emulated", 1, HBM_COPY_GBPS, EMU_LATENCY_US, EMU_POST_US, False, False,
                      (EMU_PRIVATE_TABLE_US, EMU_COMBINE_TABLE_US))
    raise ValueError(f"fabric must be one of {FABRICS + ('shm', 'emulated')}, got {name!r}")


# ---- critical-path bookkeeping ------------------------------------------------------------------------
@dataclass(frozen=True)
class Path:
    """A point in time with the breakdown (term -> µs) of the path that led to it."""
    parts: dict = field(default_factory=dict)

    @property
    def t(self) -> float:
        return sum(self.parts.values())

    def add(self, term: str, us: float) -> "Path":
        parts = dict(self.parts)
        parts[term] = parts.get(term, 0.0) + float(us)
        return Path(parts)


def later(*paths: Path) -> Path:
    return max(paths, key=lambda p: p.t)


def mix(a: Path, b: Path, p: float) -> Path:
    """The expected path: ``a`` with probability 1 - p, ``b`` with probability p (term by term)."""
    keys = dict.fromkeys(list(a.parts) + list(b.parts))
    return Path({k: (1 - p) * a.parts.get(k, 0.0) + p * b.parts.get(k, 0.0) for k in keys})


# ---- routing statistics (uniform routing: each token picks K distinct experts uniformly) --------------
def p_token_hits_rank(world: int) -> float:
    """Probability that a token has at least one of its K experts on a given rank (L = E/W of the E):
    1 - C(E - L, K) / C(E, K)."""
    L = NUM_EXPERTS // world
    return 1.0 - math.comb(NUM_EXPERTS - L, TOPK) / math.comb(NUM_EXPERTS, TOPK)


def expected_distinct_ranks(world: int, node: int | None = None) -> dict:
    """Ranks a token's K experts land on, in expectation: ``all`` = W * p_token_hits_rank(W), ``remote`` =
    those on other nodes ((W - node) * p), and the rows a rank sends per token: K routes against that many
    rank rows (``dedup`` = K / all, the factor a per-(token, rank) row saves)."""
    node = min(world, GPUS_PER_NODE if node is None else node)
    p = p_token_hits_rank(world)
    return {"world": world, "all": world * p, "remote": (world - node) * p, "routes": float(TOPK),
            "remote_routes": TOPK * (world - node) / world, "dedup": TOPK / (world * p)}


def p_token_hits_node(world: int, node: int = GPUS_PER_NODE) -> float:
    """Probability that a token has at least one of its K experts on a given node of ``node`` ranks (E * node
    / W of the E experts): 1 - C(E - E*node/W, K) / C(E, K)."""
    per_node = NUM_EXPERTS * min(node, world) // world
    return 1.0 - math.comb(NUM_EXPERTS - per_node, TOPK) / math.comb(NUM_EXPERTS, TOPK)


def expected_distinct_nodes(world: int, node: int = GPUS_PER_NODE) -> dict:
    """Nodes a token's K experts land on, in expectation, against the ranks: ``remote_nodes`` = (nodes - 1) *
    p_token_hits_node, ``remote_ranks`` = (W - node) * p_token_hits_rank; ``fewer`` = remote_ranks /
    remote_nodes, the factor by which one row per (token, node) cuts the network rows of one per (token, rank)."""
    node = min(node, world)
    nodes = world // node
    remote_nodes = (nodes - 1) * p_token_hits_node(world, node)
    remote_ranks = (world - node) * p_token_hits_rank(world)
    return {"world": world, "nodes": nodes, "remote_ranks": remote_ranks, "remote_nodes": remote_nodes,
            "fewer": remote_ranks / remote_nodes if remote_nodes else float("nan")}


def relay_stats(world: int, node: int = GPUS_PER_NODE) -> dict:
    """The relay's rows per call and rank, all ranks alike (each GPU is the relay of its local index), in
    expectation: ``writes`` per phase (one per remote node), ``rows_per_write`` (the tokens that hit that
    node), ``rows_in`` (a relay receives as many), ``fanout_rows`` (rows per (token, rank) it forwards to the
    node's other GPUs over NVLink) of ``fanout_all`` it writes (its own included), ``partial_rows`` (fp32
    partials an expert GPU sends to other GPUs, the relays of the tokens' home ranks) of ``partials_in`` a
    relay sums (its own included)."""
    node = min(node, world)
    nodes, p, q = world // node, p_token_hits_rank(world), p_token_hits_node(world, node)
    return {"nodes": nodes, "writes": nodes - 1, "p_rank": p, "p_node": q, "rows_per_write": TOKENS * q,
            "rows_in": (nodes - 1) * TOKENS * q, "fanout_all": (nodes - 1) * TOKENS * node * p,
            "fanout_rows": (nodes - 1) * TOKENS * (node - 1) * p,
            "partials_in": (world - node) * TOKENS * p, "partial_rows": (world - node) * TOKENS * p * (node - 1) / node}


def rows_per_pair_pmf(world: int, per: str = "route") -> np.ndarray:
    """Rows one rank sends to one other rank: a sum over T tokens of, per token, a hypergeometric (E
    experts, L = E/W of them on the target, K distinct draws) with ``per="route"`` (one row per route), or
    a Bernoulli(p_token_hits_rank) with ``per="rank"`` (one row per (token, rank))."""
    L = NUM_EXPERTS // world
    if per == "rank":
        p = p_token_hits_rank(world)
        per_token = np.array([1.0 - p, p])
    else:
        per_token = np.array([math.comb(L, j) * math.comb(NUM_EXPERTS - L, TOPK - j)
                              for j in range(min(L, TOPK) + 1)], float) / math.comb(NUM_EXPERTS, TOPK)
    pmf = np.array([1.0])
    for _ in range(TOKENS):
        pmf = np.convolve(pmf, per_token)
    return pmf


def private_rows(world: int) -> int:
    """Default per-sender private region (moe_a2a/config.py Layout): twice the mean rows a sender sends
    to one rank, rounded up to 8, capped at T*K."""
    routes = TOKENS * TOPK
    twice_mean = -(-2 * routes // world)          # ceil(2*T*K / W)
    return min(routes, -(-twice_mean // 8) * 8)   # round up to 8


def routing_stats(world: int, node: int = GPUS_PER_NODE, per: str = "route") -> dict:
    """``per="rank"``: dispatch rows per (token, rank); the private region keeps its size in rows
    (`private_rows`, computed from routes), so fewer rows overflow it."""
    node = min(node, world)
    pmf = rows_per_pair_pmf(world, per)
    P = private_rows(world)
    p_rem = float(pmf[P + 1:].sum())                      # one (sender, receiver) pair overflows P
    remote = world - node
    over = pmf[P + 1:]
    p_rank = 1.0 - (1.0 - p_rem) ** remote                # a given rank has a remainder to send
    return dict(
        world=world, node=node, remote_peers=remote, local_peers=node - 1,
        rows_per_peer=TOKENS * (TOPK / world if per == "route" else p_token_hits_rank(world)),
        private_rows=P, p_remainder_pair=p_rem,
        # ranks step together: the phase waits if ANY remote pair needs a remainder write
        p_any_remainder=1.0 - (1.0 - p_rem) ** (world * remote),
        p_remainder_rank=p_rank,
        # remainder writes a rank posts when it posts any, and the rows of one (past the P private ones)
        remainder_writes_given_any=max(1.0, remote * p_rem / p_rank) if p_rank > 0 else 0.0,
        remainder_rows_given_overflow=(float((np.arange(P + 1, len(pmf)) - P) @ over / over.sum())
                                       if over.sum() > 0 else 0.0))


# ---- one call, all ranks in lock-step ------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    world: int
    node: int
    fab: Fabric | None            # None: every rank on one node (no proxy, no fabric)
    speed: float                  # multiplies the proxy's micro-benchmark costs
    post_us: float | None         # Python per posted write; None: the measured one of each table
    host_staged: bool
    # Proxy processes per rank (`AllToAll(proxies=k)`): each posts, in parallel, the writes of the peers
    # p % k == j, on its own NIC when k equals the NIC count, and counts their immediates.
    proxies: int = 1
    # Only rows to and from other nodes cross PCIe (`buffers="staged"`, the GPU default on tcp/shm); else
    # (host_staged) every row does, this node's too (`buffers="host"`).
    staged_remote_only: bool = False
    # The levers of issue 32 (moe_a2a/reference.py `Wire`): "route" = one row per
    # route (today), "rank" = one dispatch row per (token, rank) / the combine reduced at the sender, one row
    # per (token, rank); combine_fp8 = combine rows in fp8 e4m3 + fp32 scales.
    dispatch_rows: str = "route"
    combine_rows: str = "route"
    combine_fp8: bool = False
    # The W ranks share ONE GPU (MPS): every GPU-side term (kernels, plan kernels, peer rows, the emulated
    # NIC's copies) is this much longer than with a GPU per rank (shared_gpu_factor).
    gpu_share: float = 1.0
    wire_share_at: float = 1.0    # the emulated NIC: gpu_share where its latency was measured (W2-N1)
    # The emulated NIC's settings (MOE_A2A_EMULATED_NIC): (latency µs, GB/s per NIC); None: full speed.
    emu_nic: tuple | None = None
    # The relay (issue 46): one write per remote node to the GPU with the sender's local index there, which
    # fans the rows out over NVLink; the combine reduced inside the experts' node (rows per (token, rank)
    # and the sender-side reduce underneath: the kernels it builds on).
    relay: bool = False
    relay_split: bool = False     # each relay write in pieces, one per proxy (the library with k > 1 proxies)


def _dispatch_row_bytes(s: Setup) -> int:
    """A dispatch row on the wire: the payload and scales; per (token, rank) also the K (expert, position) and,
    with the combine reduced at the sender, the K weights (16-byte padded)."""
    if s.dispatch_rows == "route":
        return DISPATCH_ROW_BYTES
    meta = RANK_ROW_IDS_BYTES + (RANK_ROW_WEIGHTS_BYTES if s.combine_rows == "rank" else 0)
    return DISPATCH_ROW_BYTES + -(-meta // 16) * 16


def _combine_row_bytes(s: Setup) -> int:
    return FP8_COMBINE_ROW_BYTES if s.combine_fp8 else COMBINE_ROW_BYTES


def _rows_per_rank(s: Setup, per: str) -> float:
    """Rows a rank sends in a phase, to every rank (itself included): T*K routes, or T tokens times the
    expected ranks a token hits."""
    return TOKENS * TOPK if per == "route" else TOKENS * s.world * p_token_hits_rank(s.world)


def _post_write_us(s: Setup, table: str) -> float:
    """One posted write of a table: the proxy's Python plus the provider's own cost, at the proxy's speed
    (the emulated NIC: its carrier's measured host cost per write, the engine's Python included)."""
    if s.fab.name == "emulated" and s.post_us is None:
        return s.speed * (EMU_POST_PACED_US if s.emu_nic else s.fab.post_c_us)
    py = s.post_us if s.post_us is not None else (POST_PY_COMBINE_US if table == "combine" else POST_PY_PRIVATE_US)
    return s.speed * (py + s.fab.post_c_us)


def _scatter(start: Path, sizes: list[float], s: Setup, table: str = "private") -> tuple[Path, Path]:
    """The proxy posts ``sizes`` (bytes, in peer order) one write at a time; writes go to NIC
    ``i * nics // n`` (contiguous peer shards) and are serialised there. Returns (last write posted, last
    byte landed); a receiver-copies fabric lands nothing by itself (see _dispatch). With k proxies,
    proxy j posts the writes ``i % k == j`` at the same time as the others, to NIC ``j % nics``.
    The emulated NIC: a fixed cost per table too, and its copies run on the shared GPU (``gpu_share``)."""
    if s.proxies > 1:
        return _scatter_sharded(start, sizes, s, table)
    fab, n = s.fab, len(sizes)
    fixed = fab.table_us[1 if table == "combine" else 0]
    posted = start.add("proxy_post", s.speed * fixed) if fixed and sizes else start
    per = _post_write_us(s, table)
    nic_free, landed, paced_free = [None] * fab.nics, posted, None
    for i, size in enumerate(sizes):
        posted = posted.add("proxy_post", per)
        if fab.receiver_copies:
            continue
        nic = i * fab.nics // n
        begin = posted if nic_free[nic] is None else later(posted, nic_free[nic])
        wire = s.gpu_share / s.wire_share_at if fab.name == "emulated" else 1.0
        nic_free[nic] = begin.add("wire", wire * size / (fab.gbps * 1e3))      # GB/s -> bytes per µs
        landed = later(landed, nic_free[nic].add("wire", wire * fab.latency_us))
        if s.emu_nic:
            # the settings' schedule runs on the host clock beside the copy; the later of the two counts
            lat, gbps = s.emu_nic
            paced_free = (posted if paced_free is None else later(posted, paced_free)).add("wire", size / (gbps * 1e3))
            landed = later(landed, paced_free.add("wire", lat))
    return posted, later(posted, landed)


def _scatter_sharded(start: Path, sizes: list[float], s: Setup, table: str) -> tuple[Path, Path]:
    fab, k = s.fab, s.proxies
    one = replace(s, proxies=1, fab=replace(fab, nics=1))
    posted_all, landed_all = [], []
    for j in range(k):
        mine = sizes[j::k]
        if not mine:
            continue
        # a proxy of its own and (k >= nics) a NIC of its own, or a share of one (k > nics)
        share = replace(one, fab=replace(fab, nics=1, gbps=fab.gbps * min(1.0, fab.nics / k)))
        posted, landed = _scatter(start, mine, share, table)
        posted_all.append(posted)
        landed_all.append(landed)
    return later(*posted_all), later(*landed_all)


def _gpu(start: Path, kernel_us: float, row_bytes: int, nvlink_rows: float, s: Setup,
         buffer_rows: float = TOKENS * TOPK) -> Path:
    """A row kernel: its measured GPU time, plus the rows it moves over NVLink and, host-staged, every
    row it reads or writes in the buffers (``buffer_rows`` of them) over PCIe. Added, not overlapped: at 2
    ranks the node-local trace shows unpack at 19 µs = 8.7 + 10.6 µs of NVLink (e2e_graph_x2.json).
    The kernel time is the measured one whatever the levers (ASSUMPTION: the per-(token, rank) and
    sender-reducing kernels, not written yet, cost what today's do). Ranks sharing one GPU: both times
    gpu_share (on one GPU the node peers' rows cross its HBM, not NVLink: the factor was fitted so)."""
    p = start.add("kernels", s.gpu_share * kernel_us)
    if nvlink_rows:
        p = p.add("nvlink", s.gpu_share * nvlink_rows * row_bytes / (NVLINK_GBPS * 1e3))
    if s.host_staged:
        share = (s.world - s.node) / s.world if s.staged_remote_only else 1.0
        p = p.add("pcie", share * buffer_rows * row_bytes / (HOST_STAGED_GBPS * 1e3))
    return p


def _variant_kernel_us(s: Setup, kernel: str) -> float:
    """What a wire variant's kernels add to the route rows' ``kernel`` ("send": route + pack, "recv": unpack,
    "combine_send", "combine_recv"), on the basis of a GPU per rank: the variant's measured difference from
    per_route at W=2 (wire_kernels_decode.json) over the W=2 sharing factor. 0 for per_route."""
    rank_d, rank_c, fp8 = s.dispatch_rows == "rank", s.combine_rows == "rank", s.combine_fp8
    diff = {"send": W2_SEND_RANK_US - W2_SEND_ROUTE_US if rank_d else 0.0,
            "recv": W2_EXPAND_US - W2_UNPACK_US if rank_d else 0.0,
            "combine_send": ((W2_REDUCE_BY_SOURCE_FP8_US if fp8 else W2_REDUCE_BY_SOURCE_US) if rank_c
                             else W2_FP8_COMBINE_PACK_US if fp8 else W2_COMBINE_PACK_US) - W2_COMBINE_PACK_US,
            "combine_recv": ((W2_REDUCE_RANK_FP8_US if fp8 else W2_REDUCE_RANK_US) if rank_c
                             else W2_FP8_REDUCE_US if fp8 else W2_REDUCE_US) - W2_REDUCE_US}[kernel]
    return diff / _w2_share() if diff else 0.0


@functools.lru_cache(maxsize=None)
def _w2_share() -> float:
    # the variants' kernels were timed with 2 ranks sharing the GPU (no levers inside: no recursion)
    return shared_gpu_factor(2)


def _plan_kernel_us(rows_in_host_memory: int) -> float:
    """A one-program write-plan kernel: its launch, plus the count rows (E int32 each) it reads from host
    memory at PLAN_PCIE_GBPS. The tables it writes (3 x W x 32 B) and the rows it copies into the routing
    area are stores, not charged."""
    return LAUNCH_GPU_US + rows_in_host_memory * ROUTE_ROW_BYTES / (PLAN_PCIE_GBPS * 1e3)


def _flag(s: Setup, remote: int) -> float:
    """One-way hand-off: through peer memory when all ranks share a node; with remote peers every sync
    word lives in pinned host memory (docs/protocol.md, 1), so half the GPU-proxy-GPU round trip."""
    return (FLAG_RTT_US if remote else PEER_FLAG_RTT_US) / 2


def _unpack(ready: Path, st: dict, s: Setup, waitk: float) -> Path:
    """Dispatch recv: the wait kernel sees every flag (``ready``), unpack pulls the node peers' rows."""
    done = _gpu(ready.add("kernels", waitk), K_UNPACK_TOKENS + _variant_kernel_us(s, "recv"), _dispatch_row_bytes(s),
                st["local_peers"] * st["rows_per_peer"], s, _rows_per_rank(s, s.dispatch_rows))
    return done.add("kernels", s.gpu_share * HALF_GAP_US)


def _dispatch(s: Setup, early: bool = False) -> Path:
    """``early``: the peers' count rows, tokens and ready words are already in when this rank needs
    them (in a back-to-back loop, the rank whose peer runs ahead of it: see back_to_back)."""
    if s.relay:
        return _dispatch_relay(s, early)
    st = routing_stats(s.world, s.node, s.dispatch_rows)
    remote, rows = st["remote_peers"], st["rows_per_peer"]
    row_bytes = _dispatch_row_bytes(s)
    flag = _flag(s, remote)
    waitk = s.gpu_share * LAUNCH_GPU_US if remote else 0.0     # the one-warp wait kernel before pack / unpack
    t_route = Path().add("kernels", s.gpu_share * K_ROUTE_TOKENS)
    # plan_private_writes: this rank's own count row (in the segment: host memory) -> the PRIVATE table
    t_plan = t_route.add("plan_kernels", s.gpu_share * _plan_kernel_us(1)) if remote else t_route
    t_pack = _gpu(t_plan.add("kernels", waitk), K_PACK_TOKENS + _variant_kernel_us(s, "send"), row_bytes, 0, s,
                  _rows_per_rank(s, s.dispatch_rows))
    # node peers' dispatch_ready: in lock-step they packed when we did
    node_ready = t_pack if early else t_pack.add("flags", flag)
    if not remote:
        return _unpack(later(t_pack, node_ready), st, s, waitk)
    per_proxy = math.ceil(remote / s.proxies)  # immediates each proxy counts, copies it makes (shm)
    size = min(rows, st["private_rows"]) * row_bytes + ROUTE_ROW_BYTES  # the count row at its head
    posted, landed = _scatter(t_pack.add("flags", flag), [size] * remote, s, "private")  # at SEND_READY
    if early:
        landed = Path()
    elif s.fab.receiver_copies:
        # shm: our proxy copies every peer's private write when it next polls, i.e. after its own posts
        # (the peers posted theirs at the same time); one after the other, one process
        landed = posted.add("wire", per_proxy * size / (s.fab.gbps * 1e3))
    # every private write counted and the node peers' rows in: COUNT_ROWS_READY
    crr = later(posted, landed, node_ready).add("proxy_imms", s.speed * IMM_US * per_proxy)
    drr = crr.add("proxy_steps", s.speed * DISPATCH_STEPS_US)          # DISPATCH_RECV_READY, no remainder
    # plan_remainder_and_combine_writes waits for COUNT_ROWS_READY, reads every count row (the remote ones
    # from the private slots' heads: host memory only when the buffers are; the node peers' from the sync
    # area, always host memory with remote peers), raises REMAINDER_PLANNED
    host_rows = s.world if s.host_staged else s.node
    planned = later(t_pack, crr.add("flags", flag)).add("plan_kernels", s.gpu_share * _plan_kernel_us(host_rows))
    done = _unpack(later(planned, node_ready, drr.add("flags", flag)), st, s, waitk)
    p_any = st["p_any_remainder"]
    if p_any > 0 and not early:
        # Some pair overflows P (weighted by its probability; never at 2 ranks). Its sender's proxy waits
        # for REMAINDER_PLANNED (COUNT_ROWS_READY -> plan kernel -> REMAINDER_PLANNED: a GPU -> proxy -> GPU
        # round trip and the kernel), walks its REMAINDER table, posts; the receiver counts the immediate.
        n = max(1, round(st["remainder_writes_given_any"]))
        rem_size = st["remainder_rows_given_overflow"] * row_bytes
        start = later(crr, planned.add("flags", flag)).add(
            "proxy_post", s.speed * REMAINDER_ROW_US * per_proxy)
        rem_posted, rem_landed = _scatter(start, [rem_size] * n, s, "private")
        if s.fab.receiver_copies:
            rem_landed = rem_posted.add("wire", n * rem_size / (s.fab.gbps * 1e3))
        drr_rem = later(rem_posted, rem_landed).add("proxy_imms", s.speed * IMM_US).add(
            "proxy_steps", s.speed * DISPATCH_STEPS_US)
        done = mix(done, _unpack(later(planned, node_ready, drr_rem.add("flags", flag)), st, s, waitk), p_any)
    return done


def _combine(s: Setup) -> Path:
    if s.relay:
        return _combine_relay(s)
    st = routing_stats(s.world, s.node, s.combine_rows)
    remote, rows = st["remote_peers"], st["rows_per_peer"]
    row_bytes, buffer_rows = _combine_row_bytes(s), _rows_per_rank(s, s.combine_rows)
    flag = _flag(s, remote)
    waitk = s.gpu_share * LAUNCH_GPU_US if remote else 0.0     # before combine pack / reduce
    t_pack = _gpu(Path().add("kernels", waitk), K_PACK_COMBINE + _variant_kernel_us(s, "combine_send"), row_bytes,
                  st["local_peers"] * rows, s, buffer_rows)
    ready = t_pack.add("flags", flag)                  # node peers' combine_ready
    if remote:
        per_proxy = math.ceil(remote / s.proxies)
        size = rows * row_bytes
        # COMBINE_SEND_READY seen: the COMBINE table, written by the plan kernel in the dispatch recv half
        posted, landed = _scatter(t_pack.add("flags", flag), [size] * remote, s, "combine")
        if s.fab.receiver_copies:
            landed = posted.add("wire", per_proxy * size / (s.fab.gbps * 1e3))
        crr = later(posted, landed).add("proxy_imms", s.speed * COMBINE_IMM_US * per_proxy).add(
            "proxy_steps", s.speed * COMBINE_STEPS_US)
        ready = later(ready, crr.add("flags", flag))    # COMBINE_RECV_READY
    done = _gpu(ready.add("kernels", waitk), K_REDUCE_COMBINE + _variant_kernel_us(s, "combine_recv"), row_bytes, 0, s,
                buffer_rows)
    return done.add("kernels", s.gpu_share * HALF_GAP_US)


def _dispatch_relay(s: Setup, early: bool = False) -> Path:
    """The relay's dispatch (issue 46): per remote node one write of the tokens that hit it
    (each once, with the K routes' ids, positions and weights) to the GPU with our local index there; that
    relay's proxy counts the nodes - 1 immediates, its plan kernel reads the count rows, the node's relays
    learn each other's counts (a peer hand-off), and its forward kernel writes a row per (token, rank) into
    each of the node's GPUs it hits (NVLink: ``fanout``). Each GPU then expands its node peers' rows and the
    forwarded ones. Regions sized for the worst case: no remainder write (issue 46, item 2)."""
    rs, st = relay_stats(s.world, s.node), routing_stats(s.world, s.node, "rank")
    row_bytes, flag, peer = _dispatch_row_bytes(s), _flag(s, 1), _flag(s, 0)
    waitk = s.gpu_share * LAUNCH_GPU_US
    t_plan = Path().add("kernels", s.gpu_share * K_ROUTE_TOKENS).add("plan_kernels", s.gpu_share * _plan_kernel_us(1))
    t_pack = _gpu(t_plan.add("kernels", waitk), K_PACK_TOKENS + _variant_kernel_us(s, "send"), row_bytes, 0, s,
                  _rows_per_rank(s, "rank"))
    node_ready = t_pack if early else t_pack.add("flags", peer)
    size = rs["rows_per_write"] * row_bytes + ROUTE_ROW_BYTES     # the count row at its head
    posted, landed = _scatter(t_pack.add("flags", flag), _relay_writes(s, size, rs["writes"]), s, "private")
    if early:
        landed = Path()
    crr = later(posted, landed).add("proxy_imms", s.speed * IMM_US * math.ceil(
        len(_relay_writes(s, size, rs["writes"])) / s.proxies))
    drr = crr.add("proxy_steps", s.speed * DISPATCH_STEPS_US)
    host_rows = s.world if s.host_staged else s.node
    planned = later(t_pack, crr.add("flags", flag)).add("plan_kernels", s.gpu_share * _plan_kernel_us(host_rows))
    # ASSUMPTION: the forward moves a row at the unpack's measured rate per row (kernels.json)
    fwd = later(planned, drr.add("flags", flag)).add("flags", peer).add("kernels", waitk).add(
        "fanout", s.gpu_share * (K_UNPACK_TOKENS * rs["fanout_all"] / (TOKENS * TOPK)
                                 + rs["fanout_rows"] * row_bytes / (NVLINK_GBPS * 1e3)))
    return _unpack(later(fwd.add("flags", peer), node_ready), st, s, waitk)


def _relay_writes(s: Setup, size: float, writes: int) -> list[float]:
    """The relay's writes of a phase: one per remote node; with `relay_split` (the library with k > 1 proxies:
    `Layout.wire_pieces`) each in k pieces, proxy j (NIC j on EFA) posting piece j of every write."""
    k = s.proxies if s.relay_split else 1
    return [size / k] * (writes * k)


def _combine_relay(s: Setup) -> Path:
    """The relay's combine: each expert GPU reduces by source (as the sender-side reduce), its node homes' rows
    over NVLink as before, and for tokens of other nodes an fp32 partial per (token, rank) to the relay of
    the token's home (``node_reduce``: those NVLink bytes); the relay sums them in a fixed order, one row per
    (token, node) (``node_reduce``: the kernel), and its proxy posts one write per remote node; the home
    rank's reduce sums over nodes."""
    rs, st = relay_stats(s.world, s.node), routing_stats(s.world, s.node, "rank")
    row_bytes, flag, peer = _combine_row_bytes(s), _flag(s, 1), _flag(s, 0)
    waitk, buffer_rows = s.gpu_share * LAUNCH_GPU_US, _rows_per_rank(s, "rank")
    t_pack = _gpu(Path().add("kernels", waitk), K_PACK_COMBINE + _variant_kernel_us(s, "combine_send"), row_bytes,
                  st["local_peers"] * st["rows_per_peer"], s, buffer_rows)
    t_pack = t_pack.add("node_reduce", s.gpu_share * rs["partial_rows"] * RELAY_PARTIAL_ROW_BYTES / (NVLINK_GBPS * 1e3))
    node_ready = t_pack.add("flags", peer)             # node homes' rows in; every partial in at its relay
    # ASSUMPTION: the relay's sum moves its bytes at the reduce's measured rate (kernels.json: T*K rows read,
    # T written)
    per_byte = K_REDUCE_COMBINE / ((TOKENS * TOPK + TOKENS) * COMBINE_ROW_BYTES)
    summed = node_ready.add("kernels", waitk).add("node_reduce", s.gpu_share * per_byte * (
        rs["partials_in"] * RELAY_PARTIAL_ROW_BYTES + rs["rows_in"] * row_bytes))
    sizes = _relay_writes(s, rs["rows_per_write"] * row_bytes, rs["writes"])
    posted, landed = _scatter(summed.add("flags", flag), sizes, s, "combine")
    per_proxy = math.ceil(len(sizes) / s.proxies)
    crr = later(posted, landed).add("proxy_imms", s.speed * COMBINE_IMM_US * per_proxy).add(
        "proxy_steps", s.speed * COMBINE_STEPS_US)
    ready = later(node_ready, crr.add("flags", flag))  # COMBINE_RECV_READY
    done = _gpu(ready.add("kernels", waitk), K_REDUCE_COMBINE + _variant_kernel_us(s, "combine_recv"), row_bytes, 0,
                s, buffer_rows)
    return done.add("kernels", s.gpu_share * HALF_GAP_US)


def setup(world: int, fabric_name: str | None, node: int = GPUS_PER_NODE, speed: str = "run",
          post_us: float | None = None, host_staged: bool | None = None,
          efa_efficiency: float | None = None, proxies: int | None = None,
          staged_remote_only: bool = False, rank_rows: bool = False,
          sender_reduce: bool = False, fp8_combine: bool = False, shared_gpu: bool | None = None,
          emu_gpu_factor: float | None = None, emulated_nic: tuple | None = None, relay: bool = False,
          relay_split: bool | None = None) -> Setup:
    """`proxies`: None = the library's default (one per NIC on EFA, else 1), capped by the remote peers.
    `post_us`: the proxy's Python per posted write at bench speed; None = the measured one
    (POST_PY_PRIVATE_US / POST_PY_COMBINE_US per table; the emulated NIC: its carrier's EMU_POST_US).
    The levers of issue 32: `rank_rows` = dispatch one row per (token, rank);
    `sender_reduce` = the combine reduced at the sender, one row per (token, rank) (needs `rank_rows`: the
    weights travel with the dispatch); `fp8_combine` = combine rows in fp8.
    `shared_gpu`: the W ranks share ONE H200 under MPS (the GPU side `shared_gpu_factor(W)` times longer);
    None = only over the emulated NIC, whose runs were made so. Over the emulated NIC the GPU side is
    `emu_gpu_factor` (default EMU_GPU_FACTOR) times longer again; `emulated_nic` = (latency µs, GB/s per
    NIC), its settings (MOE_A2A_EMULATED_NIC; None: full speed).
    `relay` (issue 46): one write per remote node, fanned out over NVLink by the GPU with the sender's local
    index there, the combine reduced inside the experts' node; it implies `rank_rows` and `sender_reduce`;
    `relay_split`: each of its writes in pieces, one per proxy (NIC j to NIC j: still rail-aligned); None = as the
    library (pieces whenever a rank runs several proxies, one per NIC on EFA), False = whole writes (what-if: the
    protocol before the pieces, the proxies sharing the few rail writes)."""
    node = min(node, world)
    if world < 2 or world % node or NUM_EXPERTS % world:
        raise ValueError(f"world must be a multiple of the node size ({node}) dividing {NUM_EXPERTS}, got {world}")
    if speed not in SPEEDS:
        raise ValueError(f"speed must be one of {SPEEDS}, got {speed!r}")
    if emulated_nic is not None and fabric_name != "emulated":
        raise ValueError("emulated_nic: the settings of the emulated NIC (fabric 'emulated') only")
    if relay:
        rank_rows = sender_reduce = True   # the per-rank rows and the sender-side reduce it builds on
    if sender_reduce and not rank_rows:
        raise ValueError("sender_reduce needs rank_rows (the weights travel with the per-(token, rank) rows)")
    fab = fabric(fabric_name, efa_efficiency) if node < world else None   # remote peers need one
    staged = (fab.host_staged if fab else False) if host_staged is None else host_staged
    remote = world - node
    if proxies is None:
        proxies = fab.nics if fab is not None and fab.name == "efa" else 1
    proxies = max(1, min(proxies, remote))
    factor = {"run": PROXY_IN_RUN_FACTOR, "bench": 1.0, "host-waits": PROXY_HOST_WAITS_FACTOR}[speed]
    if shared_gpu is None:
        shared_gpu = fabric_name == "emulated"
    share = shared_gpu_factor(world) if shared_gpu else 1.0
    if fab is not None and fab.name == "emulated":
        share *= EMU_GPU_FACTOR if emu_gpu_factor is None else emu_gpu_factor
    at = 1.0
    if fab is not None and fab.name == "emulated":
        at = shared_gpu_factor(2) * (EMU_GPU_FACTOR if emu_gpu_factor is None else emu_gpu_factor)
    return Setup(world, node, fab, factor, post_us, staged, proxies, staged_remote_only,
                 "rank" if rank_rows else "route", "rank" if sender_reduce else "route", bool(fp8_combine), share,
                 at, tuple(emulated_nic) if emulated_nic else None, bool(relay) and node < world,
                 (proxies > 1 if relay_split is None else bool(relay_split)) and bool(relay))


# The node-local runs on the shared GPU, by world size (the fitting data of shared_gpu_factor).
MPS_NODE_LOCAL_US = {2: "MPS_NODE_LOCAL_W2_US", 4: "MPS_NODE_LOCAL_W4_US", 8: "MPS_NODE_LOCAL_W8_US"}


def shared_gpu_factor(world: int) -> float:
    """How much longer the GPU side of a call is when ``world`` ranks share ONE H200 under MPS than with a
    GPU per rank: the node-local call measured on the shared GPU (graph replay, kernel waits, slowest
    rank's dispatch + combine) less the walk's flag hand-offs, over the walk's GPU-side terms (kernels,
    node peers' rows) for the same ranks on one node with a GPU each. Measured at W = 2, 4, 8 only."""
    if world not in MPS_NODE_LOCAL_US:
        raise ValueError(f"ranks sharing one GPU were measured at W in {sorted(MPS_NODE_LOCAL_US)}, got {world}")
    alone = predict(world, None, node=world, shared_gpu=False)
    gpu = sum(alone[f"{ph}.{t}"] for ph in ("dispatch", "combine") for t in ("kernels", "nvlink", "plan_kernels"))
    return (globals()[MPS_NODE_LOCAL_US[world]] - (alone["total"] - gpu)) / gpu


def emulated_stretch(world: int) -> float:
    """How many times longer the GPU side of a call is when ``world`` ranks share one H200 under MPS over the
    emulated NIC than with a GPU a rank (``shared_gpu_factor`` x ``EMU_GPU_FACTOR``). An emulated wire slowed
    by it (latency times, bandwidth over) takes the share of the call that the real wire takes with a GPU a
    rank: the relay_scaled runs of ``run.sh mps relay``, where fewer bytes can show as less time."""
    return shared_gpu_factor(world) * EMU_GPU_FACTOR


def predict(world: int, fabric_name: str | None, **kw) -> dict:
    """Lock-step latency in µs: ``{"dispatch", "dispatch.<term>", "combine", "combine.<term>", "total",
    "dispatch_early"}`` for every term of TERMS (zero where unused). Terms are critical-path contributions
    and sum to their phase. Keywords: see :func:`setup` (``speed="run"``: the proxy as fast as it was
    inside our graph runs with kernel waits; ``"bench"``: as fast as in its benchmark; ``"host-waits"``: as
    inside the eager run with host waits)."""
    s = setup(world, fabric_name, **kw)
    out = {}
    for phase, path in (("dispatch", _dispatch(s)), ("combine", _combine(s))):
        unknown = set(path.parts) - set(TERMS)
        assert not unknown, unknown
        out[phase] = path.t
        for term in TERMS:
            out[f"{phase}.{term}"] = path.parts.get(term, 0.0)
    out["total"] = out["dispatch"] + out["combine"]
    out["dispatch_early"] = _dispatch(s, early=True).t
    return out


def _fit_emu_gpu_factor() -> float:
    """EMU_GPU_FACTOR: the one number fitted to the W2-N1 run's total (MPS_EMULATED_W2_US): how much longer
    than on the same shared GPU node-local the GPU side of a call with remote peers is (bisection)."""
    lo, hi = 0.25, 16.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if predict(2, "emulated", node=1, emu_gpu_factor=mid)["total"] < MPS_EMULATED_W2_US:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


EMU_GPU_FACTOR = _fit_emu_gpu_factor()


def back_to_back(r: dict) -> dict:
    """Per-rank halves of 2 ranks replaying calls back to back (our benchmark), from the lock-step ones.

    Nothing makes the ranks start a call together: they drift until one of them never waits in its
    dispatch (its peer's rows are always in already): its dispatch is ``dispatch_early``. Each rank's call
    still takes the lock-step period T = dispatch + combine, so that rank's combine is T - early (the
    slower combine) and the other rank's dispatch absorbs the offset: 2 * dispatch - early (the slower
    dispatch). The two ranks' means are the lock-step values."""
    d, c, e = r["dispatch"], r["combine"], r["dispatch_early"]
    return {"dispatch_slow": 2 * d - e, "dispatch_fast": e, "combine_slow": d + c - e,
            "combine_fast": c - d + e, "total": d + c}


# ---- the proxy alone: `python -m benchmarks.proxy` ------------------------------------------------------------
BENCH_PROXY_WORLDS = (2, 8, 16, 32, 64, 128, 256)   # every world size proxy_shm.json measured


def bench_proxy(world: int) -> dict:
    """The model's proxy phases as `python -m benchmarks.proxy` times them (rank 0 of ``world`` ranks, one per
    node, shm, bench speed): ``dispatch`` = SEND_READY seen -> DISPATCH_RECV_READY, ``combine`` =
    COMBINE_SEND_READY seen -> COMBINE_RECV_READY, each a Path. The same pieces as the walk's proxy, with
    what the bench does differently: the peers' writes (H=64 rows) are in before the call (no wire, no
    copy charged: IMM_US was measured that way), and REMAINDER_PLANNED is raised with SEND_READY (no GPU:
    no flag round trip, no plan kernel)."""
    s = setup(world, "shm", node=1, speed="bench")
    st = routing_stats(world, node=1)
    remote = st["remote_peers"]
    posted, _ = _scatter(Path(), [0.0] * remote, s, "private")
    crr = posted.add("proxy_imms", IMM_US * remote)
    dispatch = crr.add("proxy_steps", DISPATCH_STEPS_US)
    p = st["p_remainder_rank"]            # this rank posts a remainder (it counts the peers' anyway)
    if p > 0:
        n = max(1, round(st["remainder_writes_given_any"]))
        start = crr.add("proxy_post", REMAINDER_ROW_US * remote)
        rem_posted, _ = _scatter(start, [0.0] * n, s, "private")
        rem = rem_posted.add("proxy_imms", IMM_US * remote * st["p_remainder_pair"]).add(
            "proxy_steps", DISPATCH_STEPS_US)
        dispatch = mix(dispatch, rem, p)
    posted, _ = _scatter(Path(), [0.0] * remote, s, "combine")
    combine = posted.add("proxy_imms", COMBINE_IMM_US * remote).add("proxy_steps", COMBINE_STEPS_US)
    return {"dispatch": dispatch, "combine": combine}


# ---- calibration: the configurations we measured --------------------------------------------------------
# (configuration, quantity, measured µs, source). (a): 2 x H200, decode, CUDA-graph replay, medians of 200
# calls per rank; (a2), (a3): (a) on two other leases of the machine. (e): the proxy alone, medians of 100
# calls (30 at W=256). (f), (g): 1 x H200 shared by W rank processes under MPS, decode, graph replay,
# kernel waits, medians of 100 calls per rank, the slowest rank's; (h): (f) again by
# benchmarks/gpu/mps_node_local.py (50 calls per rank, the slowest rank's medians).
_E2E_A = "docs/results/e2e_graph_x2.json"
_E2E_A2 = "docs/results/e2e_graph_x2_fasthost.json"
_E2E_A3 = "docs/results/e2e_graph_x2_slowhost.json"
_BP = "docs/results/emulated/proxy_shm.json"
MPS_FILES = {"f": "e2e_graph_w{w}n{w}_auto.json", "g": "e2e_graph_w{w}n{n}_emulated.json", "h": "new_w{w}.json"}
MPS_WORLDS = (2, 4, 8)


def _mps(config: str, w: int) -> str:
    return f"{_MPS}/" + MPS_FILES[config].format(w=w, n=w // 2)


MEASURED = [
    ("a", "dispatch, slower rank", 39.3, f"{_E2E_A}: rank 1 (rank 0: 38.9)"),
    ("a", "combine, slower rank", 37.0, f"{_E2E_A}: rank 0 (rank 1: 36.5)"),
    ("a", "dispatch + combine", 75.9, f"{_E2E_A}: both ranks"),
    ("a2", "dispatch, slower rank", 38.5, f"{_E2E_A2}: rank 1 (rank 0: 38.2)"),
    ("a2", "combine, slower rank", 36.7, f"{_E2E_A2}: rank 0 (rank 1: 36.5)"),
    ("a2", "dispatch + combine", 75.0, f"{_E2E_A2}: rank 1 (rank 0: 74.9)"),
    ("a3", "dispatch, slower rank", 39.4, f"{_E2E_A3}: rank 1 (rank 0: 39.1)"),
    ("a3", "combine, slower rank", 37.0, f"{_E2E_A3}: rank 1 (rank 0: 37.0)"),
    ("a3", "dispatch + combine", 76.4, f"{_E2E_A3}: rank 1 (rank 0: 76.1)"),
    ("e", "W=2: proxy dispatch", 11.5, f"{_BP}: dispatch_host_us (1 remote peer)"),
    ("e", "W=2: proxy combine", 7.1, f"{_BP}: combine_host_us"),
    ("e", "W=8: proxy dispatch", 36.2, f"{_BP}: dispatch_host_us (7 remote peers)"),
    ("e", "W=8: proxy combine", 28.7, f"{_BP}: combine_host_us"),
    ("e", "W=16: proxy dispatch", 75.9, f"{_BP}: dispatch_host_us (15 remote peers)"),
    ("e", "W=16: proxy combine", 57.4, f"{_BP}: combine_host_us"),
    ("e", "W=32: proxy dispatch", 109.3, f"{_BP}: dispatch_host_us (31 remote peers)"),
    ("e", "W=32: proxy combine", 95.7, f"{_BP}: combine_host_us"),
    ("e", "W=64: proxy dispatch", 197.6, f"{_BP}: dispatch_host_us (63 remote peers)"),
    ("e", "W=64: proxy combine", 170.7, f"{_BP}: combine_host_us"),
    ("e", "W=128: proxy dispatch", 467.9, f"{_BP}: dispatch_host_us (127 remote peers, 0.5 remainders)"),
    ("e", "W=128: proxy combine", 379.1, f"{_BP}: combine_host_us"),
    ("e", "W=256: proxy dispatch", 1109.3, f"{_BP}: dispatch_host_us (255 remote peers, 5.5 remainders)"),
    ("e", "W=256: proxy combine", 838.9, f"{_BP}: combine_host_us"),
    ("f2", "dispatch, slowest rank", 41.0, f"{_mps('f', 2)}: rank 1 of 2"),
    ("f2", "combine, slowest rank", 39.5, f"{_mps('f', 2)}: rank 0 of 2"),
    ("f2", "dispatch + combine", 78.1, f"{_mps('f', 2)}: rank 1 of 2"),
    ("f4", "dispatch, slowest rank", 92.9, f"{_mps('f', 4)}: rank 3 of 4"),
    ("f4", "combine, slowest rank", 88.8, f"{_mps('f', 4)}: rank 0 of 4"),
    ("f4", "dispatch + combine", 164.9, f"{_mps('f', 4)}: rank 1 of 4"),
    ("f8", "dispatch, slowest rank", 159.6, f"{_mps('f', 8)}: rank 7 of 8"),
    ("f8", "combine, slowest rank", 164.7, f"{_mps('f', 8)}: rank 1 of 8"),
    ("f8", "dispatch + combine", 284.6, f"{_mps('f', 8)}: rank 7 of 8"),
    ("g2", "dispatch, slowest rank", 145.4, f"{_mps('g', 2)}: rank 0 of 2"),
    ("g2", "combine, slowest rank", 115.4, f"{_mps('g', 2)}: rank 0 of 2"),
    ("g2", "dispatch + combine", 260.2, f"{_mps('g', 2)}: rank 0 of 2"),
    ("g4", "dispatch, slowest rank", 260.8, f"{_mps('g', 4)}: rank 3 of 4"),
    ("g4", "combine, slowest rank", 200.1, f"{_mps('g', 4)}: rank 0 of 4"),
    ("g4", "dispatch + combine", 437.5, f"{_mps('g', 4)}: rank 3 of 4"),
    ("g8", "dispatch, slowest rank", 496.1, f"{_mps('g', 8)}: rank 3 of 8"),
    ("g8", "combine, slowest rank", 373.6, f"{_mps('g', 8)}: rank 4 of 8"),
    ("g8", "dispatch + combine", 798.9, f"{_mps('g', 8)}: rank 4 of 8"),
    ("h2", "dispatch, slowest rank", 42.1, f"{_mps('h', 2)}: dispatch_us"),
    ("h2", "combine, slowest rank", 40.7, f"{_mps('h', 2)}: combine_us"),
    ("h4", "dispatch, slowest rank", 88.9, f"{_mps('h', 4)}: dispatch_us"),
    ("h4", "combine, slowest rank", 87.9, f"{_mps('h', 4)}: combine_us"),
    ("h8", "dispatch, slowest rank", 145.9, f"{_mps('h', 8)}: dispatch_us"),
    ("h8", "combine, slowest rank", 165.8, f"{_mps('h', 8)}: combine_us"),
]
CONFIGS = {"a": "2 x H200, one node (NVLink, kernels synchronise)",
           "a2": "as (a), another lease of the machine (08:40)",
           "a3": "as (a), another lease of the machine (09:03)",
           "e": "bench proxy: the proxy alone, synthetic peers, shm, H=64 (1 x H200 host)",
           **{f"f{w}": f"1 x H200 shared by {w} ranks (MPS), one node (W{w}-N{w})" for w in MPS_WORLDS},
           **{f"g{w}": f"1 x H200 shared by {w} ranks (MPS), {w // (w // 2)} nodes over the emulated NIC "
                       f"(W{w}-N{w // 2 if w > 2 else 1})" for w in MPS_WORLDS},
           **{f"h{w}": f"as (f{w}), benchmarks/gpu/mps_node_local.py" for w in MPS_WORLDS}}
_QUANTITY = {"dispatch, slower rank": "dispatch_slow", "dispatch, faster rank": "dispatch_fast",
             "combine, slower rank": "combine_slow", "combine, faster rank": "combine_fast",
             "dispatch + combine": "total"}
# Ranks sharing the GPU: the slowest rank's medians against the lock-step walk (which sits between the
# ranks' mean and the slowest: ranks that drift apart make one rank's half absorb the offset).
_LOCK_STEP = {"dispatch, slowest rank": "dispatch", "combine, slowest rank": "combine", "dispatch + combine": "total"}


def mps_node(config: str, w: int) -> int:
    """Ranks per simulated node in the MPS runs: (f), (h) all on one node; (g) two nodes (W=2: one rank each)."""
    return w if config in "fh" else max(1, w // 2)


# ---- fitting data and held-out data ---------------------------------------------------------------------
# A row of MEASURED is one of three kinds (its "role"), by what it can show:
# - "fitted": a constant was read from this very value or a part of it (FITTED): the row checks only that
#   the walk composes the constants back into the medians they came from;
# - "same run": the row's file is fitting data (some constant's PROVENANCE names it), this value is not;
# - "held out": no constant comes from the row's file (HELD_OUT): the model's validation.
HELD_OUT = {
    "e2e_graph_x2_fasthost.json": "(a2): configuration (a) on another lease, 2.5 h before (a)",
    "e2e_graph_x2_slowhost.json": "(a3): configuration (a) on another lease, 2 h before (a)",
    "gpu-2026-12-02-mps/e2e_graph_w4n2_emulated.json": "(g4): 4 ranks as 2 x 2 over the emulated NIC on one GPU",
    "gpu-2026-12-02-mps/e2e_graph_w8n4_emulated.json": "(g8): 8 ranks as 2 x 4 over the emulated NIC on one GPU",
    "gpu-2026-12-02-mps/new_w2.json": "(h2): 2 ranks on one node, another process layout (mps_node_local.py)",
    "gpu-2026-12-02-mps/new_w4.json": "(h4): 4 ranks on one node, mps_node_local.py",
    "gpu-2026-12-02-mps/new_w8.json": "(h8): 8 ranks on one node, mps_node_local.py",
}
FITTED = {
    "a": "HALF_GAP_US (2 of its 4 gaps: this run's trace)",
    ("e", "W=2: proxy dispatch"): "DISPATCH_STEPS_US (this value less one post and one immediate)",
    ("e", "W=2: proxy combine"): "COMBINE_STEPS_US (this value less one post and one immediate)",
    ("e", "W=64: proxy dispatch"): "BENCH_POST_PRIVATE_US, IMM_US (its parts)",
    ("e", "W=64: proxy combine"): "BENCH_POST_COMBINE_US, COMBINE_IMM_US (its parts)",
    ("e", "W=256: proxy dispatch"): "REMAINDER_ROW_US (its remainder part)",
    ("f2", "dispatch + combine"): "MPS_NODE_LOCAL_W2_US (this value: the shared-GPU factor at W=2)",
    ("f4", "dispatch + combine"): "MPS_NODE_LOCAL_W4_US (this value: the shared-GPU factor at W=4)",
    ("f8", "dispatch + combine"): "MPS_NODE_LOCAL_W8_US (this value: the shared-GPU factor at W=8)",
    ("g2", "dispatch + combine"): "MPS_EMULATED_W2_US (this value: EMU_GPU_FACTOR is solved from it)",
}
# Rows outside the band (model / measured in [0.75, 1.25]), each with the reason (docs/latency-model.md).
BAND = (0.75, 1.25)
OUTSIDE_BAND = {
    ("e", "W=16: proxy dispatch"): (
        "the proxy's cost per remote peer is not constant in W: at 15 peers a post took 3.86 µs and counting an "
        "immediate 0.89 µs, at 63 peers (where the model's constants were read) 2.81 and 0.29 µs; W=8 and W=16 "
        "come out 17-28% low. The EP16 predictions (8 remote peers) therefore likely understate the proxy's "
        "terms (32 µs of the EFA EP16 total of 457 µs) by about that share: 5-9 µs, 1-2% of the total."),
}


def _results_file(source: str) -> str | None:
    """The measured file (relative to docs/results/, a glob for runs) a MEASURED source names."""
    m = re.search(r"docs/results/([\w./*-]+\.json)", source)
    return m.group(1) if m else None


def fitting_files() -> dict[str, list[str]]:
    """Measured file (relative to docs/results/) -> the constants whose PROVENANCE names it."""
    out: dict[str, list[str]] = {}
    for name, (_, source) in PROVENANCE.items():
        for f in dict.fromkeys(re.findall(r"docs/results/([\w./-]+\.(?:json|txt))", source)):
            out.setdefault(f, []).append(name)
        for f in dict.fromkeys(re.findall(r"(?<![\w/.-])([\w-]+\.json)", source)):  # a bare name: docs/results/
            if not any(k.endswith("/" + f) or k == f for k in out):
                out.setdefault(f, []).append(name)
    return out


def row_role(config: str, quantity: str, source: str) -> str:
    f = _results_file(source)
    if f in HELD_OUT:
        return "held out"
    return "fitted" if config in FITTED or (config, quantity) in FITTED else "same run"


def calibration() -> list[dict]:
    """The model against the measured configurations: (a) 2 ranks on one node, a GPU each; (e) the proxy
    alone in `benchmarks/proxy.py`, at bench speed; (f), (h) W ranks on one node sharing one H200 under MPS; (g) the
    same W ranks as two simulated nodes over the emulated NIC, proxy at its in-run speed."""
    node_local = back_to_back(predict(2, None, node=2))
    model = {(c, q): node_local[k] for c in ("a", "a2", "a3") for q, k in _QUANTITY.items()}
    for w in BENCH_PROXY_WORLDS:
        b = bench_proxy(w)
        model["e", f"W={w}: proxy dispatch"], model["e", f"W={w}: proxy combine"] = b["dispatch"].t, b["combine"].t
    for c in "fgh":
        for w in MPS_WORLDS:
            n = mps_node(c, w)
            r = predict(w, "emulated" if n < w else None, node=n, shared_gpu=True)
            for q, k in _LOCK_STEP.items():
                model[f"{c}{w}", q] = r[k]
    return [{"config": c, "quantity": q, "predicted": model[c, q], "measured": m, "ratio": model[c, q] / m,
             "role": row_role(c, q, src), "source": src} for c, q, m, src in MEASURED]


def hbm_floor_us() -> dict:
    """Bytes the GPU kernels move / measured copy bandwidth (reference only)."""
    rows = TOKENS * TOPK
    return {"dispatch": 2 * 2 * rows * DISPATCH_ROW_BYTES / (HBM_COPY_GBPS * 1e3),
            "combine": 2 * 2 * rows * COMBINE_ROW_BYTES / (HBM_COPY_GBPS * 1e3)}


# ---- published numbers (decode: 128 tokens/rank, H=7168, top-8, fp8 dispatch / bf16 combine) ---------
# (source, configuration, fabric, EP, dispatch µs, combine µs, dispatch+combine µs). None = not given.
PUBLISHED = [
    # perplexityai/pplx-garden, its fabric-lib documentation ("All-to-All Performance Results", decode)
    ("pplx-garden", "H200 EFA p5en", "efa", 16, 214.8, 241.5, 456.3),
    ("pplx-garden", "H200 EFA p5en", "efa", 32, 229.1, 335.0, 564.1),
    ("pplx-garden", "H200 EFA p5en", "efa", 64, 266.7, 391.2, 657.9),
    ("pplx-garden", "H200 CX7", "cx7", 16, 110.2, 185.5, 295.7),
    ("pplx-garden", "H200 CX7", "cx7", 32, 153.9, 266.3, 420.2),
    ("pplx-garden", "H200 CX7", "cx7", 64, 187.5, 309.1, 496.6),
    # Perplexity's article: "459, 582, 692 µs at EP16/32/64" on EFA (its Rust proxy) vs UCCL-EP's "519,
    # 966, 1159 µs"; the latter equal UCCL-EP's README dispatch+combine sums at EP16/24/32, so both
    # triples are read as dispatch+combine totals.
    ("pplx article", "H200 EFA", "efa", 16, None, None, 459.0),
    ("pplx article", "H200 EFA", "efa", 32, None, None, 582.0),
    ("pplx article", "H200 EFA", "efa", 64, None, None, 692.0),
    ("UCCL-EP README", "p5en H200 EFA, LL", "efa", 16, 226.0, 293.0, 519.0),
    ("UCCL-EP README", "p5en H200 EFA, LL", "efa", 24, 386.0, 580.0, 966.0),
    ("UCCL-EP README", "p5en H200 EFA, LL", "efa", 32, 465.0, 694.0, 1159.0),
    ("DeepEP V1 LL", "H800 CX7 IBGDA", "cx7", 16, 118.0, 195.0, 313.0),
    ("DeepEP V1 LL", "H800 CX7 IBGDA", "cx7", 32, 155.0, 273.0, 428.0),
    ("DeepEP V1 LL", "H800 CX7 IBGDA", "cx7", 64, 173.0, 314.0, 487.0),
]


def table(worlds=WORLDS, fabrics=FABRICS, **kw) -> list[dict]:
    """Predictions at the proxy's in-run speed (``speed``, default "run"), with the bench speed as the
    optimistic edge (``*_bench``) and the C-helper what-if (``*_c_helper``)."""
    rows = []
    for fab in fabrics:
        for w in worlds:
            r = {"fabric": fab, "world": w, **predict(w, fab, **kw)}
            rest = {k: v for k, v in kw.items() if k not in ("speed", "post_us")}
            bench = predict(w, fab, speed="bench", **rest)
            helper = predict(w, fab, speed="bench", post_us=POST_US_C_HELPER, **rest)
            for ph in ("dispatch", "combine", "total"):
                r[f"{ph}_bench"], r[f"{ph}_c_helper"] = bench[ph], helper[ph]
            rows.append(r)
    return rows


def format_table(rows: list[dict]) -> str:
    # the relay's terms only where a row has them (zero in every other walk)
    terms = [t for t in TERMS
             if t not in RELAY_TERMS or any(r[f"{ph}.{t}"] for r in rows for ph in ("dispatch", "combine"))]
    head = ("| fabric | EP | dispatch | combine | dispatch + combine | at bench speed (d / c / sum) | "
            "dispatch: " + " / ".join(terms) + " | combine: " + " / ".join(terms) + " |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        d = " / ".join(f"{r['dispatch.' + t]:.0f}" for t in terms)
        c = " / ".join(f"{r['combine.' + t]:.0f}" for t in terms)
        lines.append(f"| {r['fabric'].upper()} | {r['world']} | {r['dispatch']:.0f} | {r['combine']:.0f} | "
                     f"**{r['total']:.0f}** | {r['dispatch_bench']:.0f} / {r['combine_bench']:.0f} / "
                     f"{r['total_bench']:.0f} | {d} | {c} |")
    return "\n".join(lines)


def _published(fab: str, src: str, ep: int):
    return next((p[6] for p in PUBLISHED if p[0] == src and p[2] == fab and p[3] == ep), None)


def _top_terms(r: dict, phase: str, n: int = 2) -> str:
    terms = sorted(TERMS, key=lambda t: -r[f"{phase}.{t}"])[:n]
    return ", ".join(f"{t} {r[f'{phase}.{t}']:.0f}" for t in terms)


def _verdict(total: float, target: float | None) -> str:
    """A prediction against its target: no target, meets, or the miss in µs and as a factor."""
    if target is None:
        return "no target"
    if total <= target:
        return "**meets**"
    return f"misses: +{total - target:.0f} (x{total / target:.2f})"


def format_targets(rows: list[dict]) -> str:
    """Dispatch + combine against the project's EFA targets and the published totals, with the two largest
    critical-path terms of each phase (what holds a missed target)."""
    lines = ["| fabric | EP | MODEL in-run | MODEL bench speed | target | pplx article | pplx-garden | "
             "DeepEP V1 LL | in-run vs target | largest terms, dispatch | largest terms, combine |",
             "|" + "---|" * 11]
    fmt = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
    for r in rows:
        fab, w = r["fabric"], r["world"]
        target = ISSUE_TARGETS_US.get(w) if fab == "efa" else None
        verdict = _verdict(r["total"], target)
        lines.append(f"| {fab.upper()} | {w} | **{r['total']:.0f}** | {r['total_bench']:.0f} | {fmt(target)} | "
                     f"{fmt(_published(fab, 'pplx article', w))} | {fmt(_published(fab, 'pplx-garden', w))} | "
                     f"{fmt(_published(fab, 'DeepEP V1 LL', w))} | {verdict} | {_top_terms(r, 'dispatch')} | "
                     f"{_top_terms(r, 'combine')} |")
    return "\n".join(lines)


# (label, keywords) of the sensitivity table: each row one command of the page's "Run it".
SENSITIVITY = [
    ("default: proxy at in-run speed", {}),
    ("`--proxies 1` (one proxy process per rank)", {"proxies": 1}),
    ("`--proxies 2` (two proxy processes per rank; on CX7 they share its one NIC)", {"proxies": 2}),
    ("`--speed bench` (the proxy as fast as in `benchmarks/proxy.py`)", {"speed": "bench"}),
    ("`--post-us 0.2` (what-if: C posting helper, in-run speed)", {"post_us": POST_US_C_HELPER}),
    ("`--speed bench --post-us 0.2`", {"speed": "bench", "post_us": POST_US_C_HELPER}),
    ("`--speed bench --post-us 0` (no Python per write at all)", {"speed": "bench", "post_us": 0.0}),
    ("`--efa-efficiency 0.45` (the article's \"2x slower than CX7\")", {"efa_efficiency": 0.45}),
    ("`--speed bench --efa-efficiency 0.45`", {"speed": "bench", "efa_efficiency": 0.45}),
    ("`--host-staged` (GPU buffers not registered with the NIC)", {"host_staged": True}),
    ("`--speed bench --host-staged`", {"speed": "bench", "host_staged": True}),
    ("`--speed host-waits` (the proxy as slow as in the eager run with host waits)", {"speed": "host-waits"}),
]


def _prediction_rows(rows: list[tuple[str, dict]], cols: list[tuple]) -> list[str]:
    """One table row per (label, predict keywords): dispatch / combine / **sum** at each (fabric, world) of
    `cols` ("–" where an EFA-only keyword meets another fabric)."""
    lines = []
    for label, kw in rows:
        cells = []
        for f, w in cols:
            if "efa_efficiency" in kw and f != "efa":
                cells.append("–")
                continue
            r = predict(w, f, **kw)
            cells.append(f"{r['dispatch']:.0f} / {r['combine']:.0f} / **{r['total']:.0f}**")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def format_sensitivity() -> str:
    cols = [(f, w) for f in FABRICS for w in WORLDS]
    lines = ["| variant | " + " | ".join(f"{f.upper()} EP{w}" for f, w in cols) + " |",
             "|---|" + "---|" * len(cols)]
    return "\n".join(lines + _prediction_rows(SENSITIVITY, cols))


# ---- the levers of issue 32: fewer bytes ----------------------------------------------------------------
# (label, keywords): each row one command (`python -m benchmarks.latency_model` + the flags).
LEVERS = [
    ("today: one row per route, bf16 combine", {}),
    ("`--rank-rows`: dispatch one row per (token, rank)", {"rank_rows": True}),
    ("`--rank-rows --sender-reduce`: and the combine reduced at the sender",
     {"rank_rows": True, "sender_reduce": True}),
    ("`--fp8-combine`: per-route rows, fp8 combine", {"fp8_combine": True}),
    ("`--rank-rows --sender-reduce --fp8-combine`: all three",
     {"rank_rows": True, "sender_reduce": True, "fp8_combine": True}),
    ("all three, `--speed bench`", {"rank_rows": True, "sender_reduce": True, "fp8_combine": True, "speed": "bench"}),
    ("all three, `--efa-efficiency 0.45`",
     {"rank_rows": True, "sender_reduce": True, "fp8_combine": True, "efa_efficiency": 0.45}),
    ("`--wire relay` (issue 46, timed on one shared GPU only): one write per remote node, NVLink fan-out, "
     "reduced in the node",
     {"relay": True}),
    ("`--wire relay --fp8-combine`", {"relay": True, "fp8_combine": True}),
]
LEVER_WORLDS = (2, 4, 8, 16, 32, 64)


def format_levers() -> str:
    """dispatch / combine / **sum** (µs) per lever set: 8 ranks on one node (NVLink, no proxy), then EFA and
    CX7 at EP16/32/64."""
    cols = [(None, 8)] + [(f, w) for f in FABRICS for w in WORLDS]
    lines = ["| levers | " + " | ".join("EP8, one node" if f is None else f"{f.upper()} EP{w}" for f, w in cols)
             + " |", "|---|" + "---|" * len(cols)]
    return "\n".join(lines + _prediction_rows(LEVERS, cols))


def format_variant_kernels() -> str:
    """What each variant's kernels add to the route rows' (µs measured at W=2 under MPS, and what the walk
    charges with a GPU per rank: the difference over the W=2 sharing factor)."""
    rows = [("dispatch send (route, and per rank: first route per rank, route again, stamp; pack)", "send",
             W2_SEND_ROUTE_US, [("rank rows", W2_SEND_RANK_US, {"rank_rows": True})]),
            ("dispatch receive (unpack / expand)", "recv", W2_UNPACK_US,
             [("rank rows", W2_EXPAND_US, {"rank_rows": True})]),
            ("combine send (pack / reduce by source)", "combine_send", W2_COMBINE_PACK_US,
             [("sender-reduced", W2_REDUCE_BY_SOURCE_US, {"rank_rows": True, "sender_reduce": True}),
              ("with fp8 rows", W2_REDUCE_BY_SOURCE_FP8_US, ALL_THREE),
              ("fp8 route rows", W2_FP8_COMBINE_PACK_US, {"fp8_combine": True})]),
            ("combine receive (reduce)", "combine_recv", W2_REDUCE_US,
             [("sender-reduced", W2_REDUCE_RANK_US, {"rank_rows": True, "sender_reduce": True}),
              ("with fp8 rows", W2_REDUCE_RANK_FP8_US, ALL_THREE),
              ("fp8 route rows", W2_FP8_REDUCE_US, {"fp8_combine": True})])]
    lines = ["| kernel (µs at W=2 under MPS) | per_route | the variant | charged on top, a GPU per rank |",
             "|---|---|---|---|"]
    for label, kernel, base, variants in rows:
        names = ", ".join(f"{n} {us:.2f}" for n, us, _ in variants)
        extra = " / ".join(f"{_variant_kernel_us(setup(64, 'efa', **kw), kernel):+.2f}" for *_, kw in variants)
        lines.append(f"| {label} | {base:.2f} | {names} | {extra} |")
    return "\n".join(lines)


ALL_THREE = {"rank_rows": True, "sender_reduce": True, "fp8_combine": True}


def bytes_per_rank(world: int, node: int = GPUS_PER_NODE, **levers) -> dict:
    """Expected bytes one rank sends per call (decode), all destinations (itself included) and to other
    nodes only: ``{"dispatch": (all, remote), "combine": (all, remote)}``. Rows only (no count rows)."""
    s = setup(world, "efa" if min(node, world) < world else None, node=node, **levers)
    out = {}
    for phase, per, size in (("dispatch", s.dispatch_rows, _dispatch_row_bytes(s)),
                             ("combine", s.combine_rows, _combine_row_bytes(s))):
        rows = _rows_per_rank(s, per)
        out[phase] = (rows * size, rows * size * (world - s.node) / world)
    return out


def format_distinct_ranks() -> str:
    """Where a token's K = 8 experts land (uniform routing over 256 experts, 8 GPUs a node), and what one
    row per (token, rank) saves: the bytes a rank sends per decode call (MB), today -> per (token, rank)."""
    lines = ["| EP | ranks a token hits | of them on other nodes | routes / rank rows | dispatch MB a rank "
             "sends (other nodes) | combine MB, per route bf16 (other nodes) | reduced at the sender, bf16 | "
             "reduced at the sender, fp8 |", "|---|" + "---|" * 7]
    for w in LEVER_WORLDS:
        d = expected_distinct_ranks(w)
        today = bytes_per_rank(w)
        rank = bytes_per_rank(w, rank_rows=True, sender_reduce=True)
        fp8 = bytes_per_rank(w, rank_rows=True, sender_reduce=True, fp8_combine=True)
        mb = lambda b: f"{b[0] / 1e6:.2f} ({b[1] / 1e6:.2f})"  # noqa: E731
        lines.append(f"| {w} | {d['all']:.2f} | {d['remote']:.2f} | {d['dedup']:.2f} | "
                     f"{mb(today['dispatch'])} -> {mb(rank['dispatch'])} | {mb(today['combine'])} | "
                     f"{mb(rank['combine'])} | {mb(fp8['combine'])} |")
    return "\n".join(lines)


# ---- issue 46's table: issue 32's wire variants on 1 x H200 under MPS, predicted with every row held out ---
# Measured by a session "as a new user would" (the issue's text; its raw files are not in docs/results): 8 ranks
# sharing one H200 under MPS, graph replay, kernel waits, decode, the slowest rank's median µs. No constant of
# the model is read from these numbers (checked by tests/benchmarks/test_latency_model.py): every row is held out.
ISSUE46_SOURCE = ("issue 46 (1 x H200 under MPS, 8 ranks sharing it: `moe-a2a bench e2e --graph --no-nccl --preset "
                  "decode --device cuda --wire V --iters 50`, slowest rank's median; no date or commit given, raw "
                  "files not in docs/results)")
ISSUE46_WIRES = {"per_route": {}, "per_rank_dispatch": {"rank_rows": True},
                 "sender_reduced": {"rank_rows": True, "sender_reduce": True},
                 "sender_reduced_fp8": {"rank_rows": True, "sender_reduce": True, "fp8_combine": True}}
# set-up -> (world, fabric, keywords of predict)
ISSUE46_SETUPS = {
    "8 ranks, one node": (8, None, {"node": 8, "shared_gpu": True}),
    "2 x 4, emulated NIC, full speed": (8, "emulated", {"node": 4}),
    "2 x 4, emulated NIC, 12us,25GBps": (8, "emulated", {"node": 4, "emulated_nic": (EMU_NIC_EFA_LIKE_LATENCY_US,
                                                                                      EMU_NIC_EFA_LIKE_GBPS)}),
}
_ONE, _FULL, _EFA_LIKE = ISSUE46_SETUPS
# The relay's runs add EFA at the run's stretch (not one of the issue's cells).
_EFA_SCALED = "2 x 4, emulated NIC, 87us,3.5GBps (EFA at the run's stretch)"
RELAY_SETUPS = {**ISSUE46_SETUPS, _EFA_SCALED: (8, "emulated", {
    "node": 4, "emulated_nic": (EMU_NIC_EFA_SCALED_LATENCY_US, EMU_NIC_EFA_SCALED_GBPS)})}
# (set-up, wire, quantity, measured µs): the totals of every cell, the one-node d / c where the issue gives them
ISSUE46_MEASURED = [
    (_ONE, "per_route", "dispatch + combine", 275.0), (_ONE, "per_route", "dispatch", 154.0),
    (_ONE, "per_route", "combine", 164.0),
    (_ONE, "per_rank_dispatch", "dispatch + combine", 312.0), (_ONE, "per_rank_dispatch", "dispatch", 187.0),
    (_ONE, "per_rank_dispatch", "combine", 176.0),
    (_ONE, "sender_reduced", "dispatch + combine", 551.0), (_ONE, "sender_reduced", "dispatch", 253.0),
    (_ONE, "sender_reduced", "combine", 404.0),
    (_ONE, "sender_reduced_fp8", "dispatch + combine", 577.0), (_ONE, "sender_reduced_fp8", "dispatch", 265.0),
    (_ONE, "sender_reduced_fp8", "combine", 433.0),
    (_FULL, "per_route", "dispatch + combine", 780.0), (_FULL, "per_rank_dispatch", "dispatch + combine", 766.0),
    (_FULL, "sender_reduced", "dispatch + combine", 1127.0),
    (_FULL, "sender_reduced_fp8", "dispatch + combine", 1142.0),
    (_EFA_LIKE, "per_route", "dispatch + combine", 870.0),
    (_EFA_LIKE, "per_rank_dispatch", "dispatch + combine", 857.0),
    (_EFA_LIKE, "sender_reduced", "dispatch + combine", 1082.0),
    (_EFA_LIKE, "sender_reduced_fp8", "dispatch + combine", 1095.0),
]
# The issue's bytes a rank sends (MB, dispatch / combine, the EFA-like run): to every other rank.
ISSUE46_BYTES_MB = {"per_route": (6.0, 11.6), "per_rank_dispatch": (4.1, 11.6), "sender_reduced": (4.2, 7.9),
                    "sender_reduced_fp8": (4.2, 4.1)}
# The benchmark's routing ("random", moe_a2a/bench/demo.py make_inputs): each route is -1 with this probability.
# The walk leaves it out, as for every MPS row it was fitted on; only the bytes check below takes it in.
BENCH_MASKED_ROUTES = 0.1
_Q = {"dispatch + combine": "total", "dispatch": "dispatch", "combine": "combine"}
# Rows outside the band: (the term the walk lacks, why). A held-out row is never fitted: it says what is missing.
_RBS = "the reduce by source with 8 ranks sharing one GPU"
_DRIFT = "drift between the ranks (the slowest rank's dispatch waits for its peers' slow combine)"
_RBS_WHY = (
    "the walk charges the reduce by source its measured difference from the route rows' combine pack at W=2 "
    "(34.8 against 25.6 µs, fp8 rows 33.8; its reduce 6.3 / 6.6 against 8.1: docs/results/gpu-2026-12-02-s11/"
    "lease3/wire_kernels_decode.json, docs/perf-notes.md), stretched by the 8-rank sharing factor (3.11): +20 µs "
    "(fp8 +18) on the combine, which its fewer NVLink bytes more than take back (one node: 162 -> 144 / 107 µs). "
    "The runs' one-node combine is 404 / 433 µs against the route rows' 164 (the totals +276 / +302 over "
    "per_route), and across the emulated NIC the totals are +347 / +362 over per_route (1127 / 1142 against "
    "780) where the walk gives +82 / +42. Timed with 8 ranks on one "
    "H200 (docs/results/gpu-2026-12-07d/w8_kernels/wk_w8n8.json, rank 0's kernels by position) the reduce by "
    "source takes 77.5 against the pack's 53.0 µs: +24.5, near the walk's +20; the runs' excess is in the waits "
    "between the ranks (rank 0's combine receive waits 51.8 against 8.7 µs for its peers' sends), for which the "
    "lock-step walk has no term, so the term is named, not added: "
    "item 0's first bullet (the reduce no slower than per-route) is what removes it")
_DRIFT_WHY = (
    "sender_reduced's dispatch kernels are per_rank_dispatch's (its rows carry the K weights, 32 B more), so the "
    "walk gives both the same 143 µs; the runs' slowest dispatch is 253 / 265 against 187. A rank's dispatch "
    "receive waits for its peers' pack, which in back-to-back replays follows their previous combine: a slow "
    "combine shows up in the peers' next dispatch, and the lock-step walk charges each half its own path (the "
    "calibration's (f) rows' dispatch is 0.77-0.88 for the same reason). Its size follows the reduce by source's")
ISSUE46_MISSING = {
    (_ONE, "sender_reduced", "dispatch + combine"): (_RBS, _RBS_WHY),
    (_ONE, "sender_reduced", "combine"): (_RBS, _RBS_WHY),
    (_ONE, "sender_reduced_fp8", "dispatch + combine"): (_RBS, _RBS_WHY),
    (_ONE, "sender_reduced_fp8", "combine"): (_RBS, _RBS_WHY),
    (_FULL, "sender_reduced_fp8", "dispatch + combine"): (_RBS, _RBS_WHY),
    (_ONE, "sender_reduced", "dispatch"): (_DRIFT, _DRIFT_WHY),
    (_ONE, "sender_reduced_fp8", "dispatch"): (_DRIFT, _DRIFT_WHY),
}
# Rows inside the band for which the walk is known to be right for a wrong reason (errors that cancel).
_PACED = "the EFA-like schedule charged on top of the full-speed walk"
_PACED_WHY = (
    "with MOE_A2A_EMULATED_NIC=12us,25GBps the walk adds +277 / +227 / +129 / +35 µs to the full-speed rows "
    "(per_route, per_rank_dispatch, sender_reduced, sender_reduced_fp8: each proxy's 4 remote writes serialised at "
    "25 GB/s after its posts, lock-step), where the runs moved by +90 / +91 / -45 / -47 µs: in the runs the "
    "schedule overlaps time the walk spends elsewhere (not identified: the EFA-like runs left no trace). The two "
    "sender-reduced rows are inside the band because that error and the missing reduce by source cancel")
ISSUE46_NOTES = {
    (_FULL, "sender_reduced", "dispatch + combine"): (_RBS, "inside the band by 0.3 %; the same missing term as "
                                                            "the sender_reduced_fp8 row beside it"),
    **{(_EFA_LIKE, w, "dispatch + combine"): (_PACED, _PACED_WHY) for w in ISSUE46_WIRES},
}


def bench_bytes_to_others(world: int, node: int, mask: float = BENCH_MASKED_ROUTES, **levers) -> dict:
    """Bytes one rank sends to the other ranks per call (MB, dispatch / combine) with the benchmark's routing:
    uniform top-K with each route masked (-1) with probability ``mask``. A rank row goes where a kept route
    does: P(a token hits a given rank) = 1 - sum_j hypergeometric(j) * mask^j."""
    s = setup(world, "efa" if node < world else None, node=node, **levers)
    L = NUM_EXPERTS // world
    p = 1.0 - sum(math.comb(L, j) * math.comb(NUM_EXPERTS - L, TOPK - j) * mask ** j
                  for j in range(min(L, TOPK) + 1)) / math.comb(NUM_EXPERTS, TOPK)
    rows = {"route": TOKENS * TOPK * (1 - mask) / world, "rank": TOKENS * p}   # to one other rank
    return {"dispatch": rows[s.dispatch_rows] * (world - 1) * _dispatch_row_bytes(s) / 1e6,
            "combine": rows[s.combine_rows] * (world - 1) * _combine_row_bytes(s) / 1e6}


def issue46_rows() -> list[dict]:
    """The model against issue 46's table: every run held out (no constant from it), the lock-step walk
    against the slowest rank's medians, as the MPS calibration rows."""
    out = []
    for setup_name, wire, quantity, measured in ISSUE46_MEASURED:
        world, fab, kw = ISSUE46_SETUPS[setup_name]
        r = predict(world, fab, **kw, **ISSUE46_WIRES[wire])
        key = (setup_name, wire, quantity)
        predicted = r[_Q[quantity]]
        ratio = predicted / measured
        phases = ("dispatch", "combine") if quantity == "dispatch + combine" else (quantity,)
        terms = {t: sum(r[f"{ph}.{t}"] for ph in phases) for t in TERMS}
        out.append({"setup": setup_name, "wire": wire, "quantity": quantity, "measured": measured,
                    "predicted": predicted, "ratio": ratio, "error_pct": 100 * (ratio - 1),
                    "in_band": BAND[0] <= ratio <= BAND[1], "terms": terms,
                    "missing": ISSUE46_MISSING.get(key), "note": ISSUE46_NOTES.get(key)})
    return out


def format_issue46(rows: list[dict]) -> str:
    lines = ["| set-up (1 x H200, MPS) | wire | quantity | measured µs | MODEL µs | error | within 25 % | the walk's "
             "largest terms (µs) | the term the walk lacks (outside the band) |", "|" + "---|" * 9]
    for r in rows:
        terms = r["terms"]
        top = ", ".join(f"{t} {terms[t]:.0f}" for t in sorted(TERMS, key=lambda t: -terms[t])[:3])
        missing = f"**{r['missing'][0]}**" if r["missing"] else "–"
        if r["note"]:
            missing += f" ({r['note'][0]})"
        lines.append(f"| {r['setup']} | {r['wire']} | {r['quantity']} | {r['measured']:.0f} | {r['predicted']:.0f} | "
                     f"{r['error_pct']:+.1f} % | {'yes' if r['in_band'] else '**no**'} | "
                     f"{top} | {missing} |")
    return "\n".join(lines)


def format_issue46_missing() -> str:
    why = {}
    for key, (term, text) in list(ISSUE46_MISSING.items()) + list(ISSUE46_NOTES.items()):
        why.setdefault((term, text), []).append(key)
    return "\n".join(f"- **{term}** ({'; '.join(f'{s}, {w}, {q}' for s, w, q in keys)}): {text}"
                     for (term, text), keys in why.items())


def format_issue46_bytes() -> str:
    lines = ["| wire | issue 46: MB a rank sends, d / c | MODEL, the benchmark's routing (10 % of routes -1) | "
             "MODEL, uniform top-8 |", "|---|---|---|---|"]
    for wire, (d, c) in ISSUE46_BYTES_MB.items():
        b = bench_bytes_to_others(8, 4, **ISSUE46_WIRES[wire])
        u = bench_bytes_to_others(8, 4, mask=0.0, **ISSUE46_WIRES[wire])
        lines.append(f"| {wire} | {d:.1f} / {c:.1f} | {b['dispatch']:.1f} / {b['combine']:.1f} | "
                     f"{u['dispatch']:.1f} / {u['combine']:.1f} |")
    return "\n".join(lines)


# ---- the relay, modelled (issue 46, item 4; timed on one shared GPU only: these are predictions) ----------
def relay_bytes_per_rank(world: int, node: int = GPUS_PER_NODE, fp8_combine: bool = False) -> dict:
    """MB one rank moves per decode call with the relay (uniform top-8): over the network per phase (rows
    only), with one row per (token, rank) instead (the sender-reduced variant), and over NVLink its fan-out
    and its fp32 partials to the relays."""
    s = setup(world, "efa", node=node, relay=True, fp8_combine=fp8_combine)
    rs, d = relay_stats(world, node), expected_distinct_nodes(world, node)
    per_rank = bytes_per_rank(world, node, rank_rows=True, sender_reduce=True, fp8_combine=fp8_combine)
    return {"dispatch": rs["rows_in"] * _dispatch_row_bytes(s) / 1e6,
            "combine": rs["rows_in"] * _combine_row_bytes(s) / 1e6,
            "dispatch_per_rank": per_rank["dispatch"][1] / 1e6, "combine_per_rank": per_rank["combine"][1] / 1e6,
            "fanout": rs["fanout_rows"] * _dispatch_row_bytes(s) / 1e6,
            "partials": rs["partial_rows"] * RELAY_PARTIAL_ROW_BYTES / 1e6, "writes": rs["writes"],
            "writes_per_rank": world - min(node, world), "remote_nodes": d["remote_nodes"],
            "remote_ranks": d["remote_ranks"], "fewer": d["fewer"]}


def format_relay_bytes() -> str:
    """Issue 46's bytes table from the expected distinct ranks and nodes (256 experts, top-8, 8 GPUs a node)."""
    lines = ["| EP | remote ranks a token hits | remote nodes | network rows per rank -> per node | writes per "
             "phase, per rank -> relay | network MB a rank sends, d / c: per rank -> relay (bf16; fp8 combine) | "
             "NVLink MB a rank moves for the relay: fan-out / fp32 partials |", "|---|" + "---|" * 6]
    for w in WORLDS:
        b, f = relay_bytes_per_rank(w), relay_bytes_per_rank(w, fp8_combine=True)
        lines.append(f"| {w} | {b['remote_ranks']:.2f} | {b['remote_nodes']:.2f} | {b['fewer']:.2f}x fewer | "
                     f"{b['writes_per_rank']} -> {b['writes']} | {b['dispatch_per_rank']:.2f} / "
                     f"{b['combine_per_rank']:.2f} -> {b['dispatch']:.2f} / {b['combine']:.2f} ({f['combine']:.2f}) | "
                     f"{b['fanout']:.2f} / {b['partials']:.2f} |")
    return "\n".join(lines)


def _holds(r: dict) -> str:
    """The term that holds a call (the largest over both phases), with its µs."""
    both = {t: r[f"dispatch.{t}"] + r[f"combine.{t}"] for t in TERMS}
    t = max(both, key=both.get)
    return f"{t} {both[t]:.0f} of {r['total']:.0f}"


def relay_table(**kw) -> list[dict]:
    """The relay at EP16/32/64 on EFA and CX7, bf16 and fp8 combine, beside the per-route and per-rank
    (sender-reduced) walks with the same combine rows; ``kw`` as for :func:`predict`."""
    rows = []
    for fab in FABRICS:
        for combine in ("bf16", "fp8"):
            fp8 = combine == "fp8"
            for w in WORLDS:
                r = predict(w, fab, relay=True, fp8_combine=fp8, **kw)
                rows.append({"fabric": fab, "combine_rows": combine, "world": w, **r,
                             "per_rank_total": predict(w, fab, rank_rows=True, sender_reduce=True, fp8_combine=fp8,
                                                       **kw)["total"],
                             "per_route_total": predict(w, fab, fp8_combine=fp8, **kw)["total"],
                             "target": RELAY_TARGETS_US[combine][w] if fab == "efa" else None})
    return rows


def format_relay(rows: list[dict]) -> str:
    lines = ["| fabric | combine | EP | MODEL relay: dispatch / combine / **sum** | per-rank rows, sender-reduced | "
             "per route | target (EFA) | relay vs target | held by | largest terms, dispatch | largest terms, "
             "combine |", "|" + "---|" * 11]
    for r in rows:
        t = r["target"]
        verdict = _verdict(r["total"], t)
        lines.append(f"| {r['fabric'].upper()} | {r['combine_rows']} | {r['world']} | {r['dispatch']:.0f} / "
                     f"{r['combine']:.0f} / **{r['total']:.0f}** | {r['per_rank_total']:.0f} | "
                     f"{r['per_route_total']:.0f} | {'–' if t is None else f'{t:.0f}'} | {verdict} | {_holds(r)} | "
                     f"{_top_terms(r, 'dispatch')} | {_top_terms(r, 'combine')} |")
    return "\n".join(lines)


# `--wire NAME`: moe_a2a/reference.py's WIRE_VARIANTS by name, and the relay.
WIRES = {"per_route": {}, "per_rank_dispatch": {"rank_rows": True},
         "sender_reduced": {"rank_rows": True, "sender_reduce": True}, "fp8_combine": {"fp8_combine": True},
         "sender_reduced_fp8": {"rank_rows": True, "sender_reduce": True, "fp8_combine": True},
         "relay": {"relay": True}}


# (label, keywords) of the relay's what-ifs (EFA): each row one command of the page's "Run it".
RELAY_SENSITIVITY = [
    ("`--wire relay` (as above: each write in 2 pieces, one per NIC)", {}),
    ("`--relay-whole-writes`: each write whole, on one NIC (the protocol before the pieces)", {"relay_split": False}),
    ("`--speed bench`", {"speed": "bench"}),
    ("`--efa-efficiency 1.0` (EFA at line rate)", {"efa_efficiency": 1.0}),
]


def format_relay_sensitivity() -> str:
    cols = [(c, w) for c in ("bf16", "fp8") for w in WORLDS]
    lines = ["| EFA, relay | " + " | ".join(f"EP{w} {c} (target {RELAY_TARGETS_US[c][w]:.0f})" for c, w in cols)
             + " |", "|---|" + "---|" * len(cols)]
    for label, kw in RELAY_SENSITIVITY:
        cells = [predict(w, "efa", relay=True, fp8_combine=c == "fp8", **kw)["total"] for c, w in cols]
        lines.append(f"| {label} | " + " | ".join(
            f"**{v:.0f}**" if v <= RELAY_TARGETS_US[c][w] else f"{v:.0f}" for v, (c, w) in zip(cells, cols)) + " |")
    return "\n".join(lines)


def format_relay_emulated() -> str:
    """What the walk expects of item 4's runs: 8 ranks as 2 x 4 on one H200 under MPS over the emulated NIC."""
    wires = [(w, kw) for w, kw in ISSUE46_WIRES.items()] + [
        ("relay", {"relay": True}), ("relay, fp8 combine", {"relay": True, "fp8_combine": True}),
        ("per_route, 2 proxies a rank", {"proxies": 2}),
        ("relay, 2 proxies a rank (pieces)", {"relay": True, "proxies": 2})]
    lines = ["| wire | full speed: d / c / **sum** | 12us,25GBps: d / c / **sum** | 87us,3.5GBps (EFA at the run's "
             "stretch): d / c / **sum** |", "|---|---|---|---|"]
    for name, kw in wires:
        cells = []
        for setup_name in (_FULL, _EFA_LIKE, _EFA_SCALED):
            world, fab, skw = RELAY_SETUPS[setup_name]
            r = predict(world, fab, **skw, **kw)
            cells.append(f"{r['dispatch']:.0f} / {r['combine']:.0f} / **{r['total']:.0f}**")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The relay's runs (issue 46, item 4), every one held out (no constant from them): 8 ranks as 2 x 4 sharing one
# GPU under MPS over the emulated NIC, graph replay, decode, the slowest rank's median dispatch + combine, µs;
# per_route of the same run beside it. (set-up, GPU, tree, relay, per_route, the relay row's raw file)
RELAY_RUNS = [
    (_FULL, "H100", "dbdefb8", 1681.3, 823.3, "gpu-2026-12-06c/call1_relay/relay_full/e2e_w8n4_decode_relay.json"),
    (_EFA_LIKE, "H100", "dbdefb8", 1680.0, 970.2, "gpu-2026-12-06c/call1_relay/relay_efa/e2e_w8n4_decode_relay.json"),
    (_EFA_LIKE, "H200", "cbbb503", 1616.5, 898.3, "gpu-2026-12-06d/callF_h200/e2e_relay.json"),
    # the reduces walking 4 hidden chunks a program (rank_rows.REDUCE_H_CHUNKS): the relay's work 160 + 92 -> 83 + 65 µs
    (_EFA_LIKE, "H100", "8c9906d", 1071.2, 928.8, "gpu-2026-12-07b/e2e_wires/e2e_w8x2_efa_relay_1.json"),
    # one proxy a rank, the code of 872bf7a; EFA at the run's stretch (RELAY_SETUPS), where the relay is ahead
    (_EFA_LIKE, "H100", "872bf7a", 1093.7, 939.5, "gpu-2026-12-08/relay_efa/e2e_w8n4_decode_relay.json"),
    (_EFA_SCALED, "H100", "872bf7a", 1842.6, 3393.1, "gpu-2026-12-08/relay_scaled/e2e_w8n4_decode_relay.json"),
]
RELAY_MISSING = (
    "rank skew through the relay's node barrier",
    "the walk is lock-step; on one shared GPU the ranks are not: in the traced H200 call two ranks ended their "
    "dispatch ~400 µs after the others (their expand queued behind the other ranks' kernels), and "
    "`reduce_relayed_rows` waits for every node peer's partials, so every rank's combine-send half took 980-1006 µs "
    "(the walk: about 300; per_route, which has no such barrier, 84-125). The relay's kernel work measured 351 µs "
    "a rank against per_route's 187 (docs/benchmarks.md, \"Where the relay's time goes\")")


def relay_runs() -> list[dict]:
    """The walk against the relay's runs and the per_route run beside each (same set-up, same GPU)."""
    out = []
    for setup_name, gpu, tree, relay_us, per_route_us, raw in RELAY_RUNS:
        world, fab, kw = RELAY_SETUPS[setup_name]
        for wire, measured, levers in (("relay", relay_us, {"relay": True}),
                                       ("per_route", per_route_us, {})):
            predicted = predict(world, fab, **kw, **levers)["total"]
            ratio = predicted / measured
            in_band = BAND[0] <= ratio <= BAND[1]
            out.append({"setup": setup_name, "gpu": gpu, "tree": tree, "wire": wire, "measured": measured,
                        "predicted": predicted, "ratio": ratio, "in_band": in_band, "raw": raw,
                        "missing": None if in_band else RELAY_MISSING[0]})
    return out


def format_relay_runs(rows: list[dict]) -> str:
    lines = ["| set-up (MPS, one GPU) | GPU, tree | wire | measured d + c, µs | MODEL µs | error | within 25 % | "
             "the term the walk lacks |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        band = "yes" if r["in_band"] else "**no**"
        missing = f"**{r['missing']}**" if r["missing"] else "–"
        lines.append(f"| {r['setup']} | {r['gpu']}, `{r['tree']}` | {r['wire']} | {r['measured']:.0f} | "
                     f"{r['predicted']:.0f} | {100 * (r['ratio'] - 1):+.1f} % | {band} | {missing} |")
    return "\n".join(lines)


def format_calibration(rows: list[dict]) -> str:
    lines = ["| configuration | quantity | model µs | measured µs | model / measured | role | measured in |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" + (" (outside the band)" if (r["config"], r["quantity"]) in OUTSIDE_BAND else "")
        lines.append(f"| ({r['config']}) {CONFIGS[r['config']]} | {r['quantity']} | {r['predicted']:.1f} | "
                     f"{r['measured']:.1f} | {ratio} | {r['role']} | {r['source']} |")
    return "\n".join(lines)


def format_outside_band() -> str:
    return "\n".join(f"- **({c}) {q}**: {why}" for (c, q), why in OUTSIDE_BAND.items())


def format_sources() -> str:
    """Which measured file gives which constants (fitting data), and which files no constant comes from."""
    lines = ["| file (docs/results/) | role | constants read from it | calibration rows |", "|---|---|---|---|"]
    rows_of: dict[str, list[str]] = {}
    for c, _, _, src in MEASURED:
        f = _results_file(src)
        if f and f"({c})" not in rows_of.setdefault(f, []):
            rows_of[f].append(f"({c})")
    for f, names in fitting_files().items():
        lines.append(f"| `{f}` | fitting data | {', '.join(f'`{n}`' for n in names)} | "
                     f"{', '.join(rows_of.get(f, [])) or '–'} |")
    for f in HELD_OUT:
        lines.append(f"| `{f}` | **held out** | – | {', '.join(rows_of.get(f, []))} |")
    return "\n".join(lines)


def format_provenance() -> str:
    lines = ["| constant | value | kind | source |", "|---|---|---|---|"]
    for name, value in constants().items():
        kind, src = PROVENANCE[name]
        lines.append(f"| `{name}` | {value:.6g} | {'**ASSUMPTION**' if kind == 'assumption' else kind} | {src} |")
    return "\n".join(lines)


def plot(rows: list[dict], cal: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(16, 11))
    gs = fig.add_gridspec(2, 3)
    colors = {"efa": "tab:orange", "cx7": "tab:blue"}
    markers = {"pplx-garden": "*", "pplx article": "P", "UCCL-EP README": "s", "DeepEP V1 LL": "^"}
    idx = {"dispatch": 4, "combine": 5, "total": 6}
    for col, phase in enumerate(("dispatch", "combine", "total")):
        ax = fig.add_subplot(gs[0, col])
        for fab in FABRICS:
            rs = [r for r in rows if r["fabric"] == fab]
            ws = [r["world"] for r in rs]
            # EFA solid, CX7 dashed: where the proxy bounds a phase the two lines coincide
            ax.plot(ws, [r[phase] for r in rs], "-o" if fab == "efa" else "--s", color=colors[fab], lw=2.5,
                    label=f"MODEL {fab.upper()}, proxy at in-run speed")
            ax.fill_between(ws, [r[f"{phase}_bench"] for r in rs], [r[phase] for r in rs],
                            color=colors[fab], alpha=0.15)
            ax.plot(ws, [r[f"{phase}_c_helper"] for r in rs], ":", color=colors[fab], lw=1.5,
                    label=f"MODEL what-if {fab.upper()}: C posting {POST_US_C_HELPER} µs/write, bench speed")
            if fab == "efa":
                ax.plot(ws, [predict(w, fab, rank_rows=True, sender_reduce=True, fp8_combine=True)[phase]
                             for w in ws], "-.^", color="tab:red", lw=1.5,
                        label="MODEL EFA, issue 32's three levers (rank rows, sender reduce, fp8 combine)")
        if phase == "total":
            ax.plot(list(ISSUE_TARGETS_US), list(ISSUE_TARGETS_US.values()), "k_", ms=22, mew=3,
                    label="target (EFA)")
        seen = set()
        for src, cfg, fab, ep, *vals in PUBLISHED:
            v = vals[idx[phase] - 4]
            if v is None:
                continue
            lab = f"{src} ({cfg})"
            ax.scatter([ep], [v], marker=markers[src], s=90, color=colors[fab], edgecolor="k", zorder=5,
                       label=None if lab in seen else lab)
            seen.add(lab)
        top = max([r[phase] for r in rows] + [p[idx[phase]] for p in PUBLISHED if p[idx[phase]] is not None])
        ax.set_xscale("log", base=2)
        ax.set_xticks([16, 24, 32, 64], ["16", "24", "32", "64"])
        ax.set_xlabel("EP size (8 GPUs per node)")
        ax.set_ylabel("µs")
        ax.set_ylim(0, 1.35 * top)
        ax.set_title(f"{'dispatch + combine' if phase == 'total' else phase}: MODEL vs published\n"
                     "band: proxy at bench speed .. in-run speed", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    # where the time goes at the proxy's in-run speed
    ax = fig.add_subplot(gs[1, :2])
    bars = [(r["fabric"], r["world"], ph, r) for ph in ("dispatch", "combine") for r in rows]
    bottoms = np.zeros(len(bars))
    terms = TERMS
    for term, col in zip(terms, plt.cm.tab20.colors):
        vals = np.array([r[f"{ph}.{term}"] for _, _, ph, r in bars])
        ax.bar(np.arange(len(bars)), vals, bottom=bottoms, color=col, label=term)
        bottoms += vals
    ax.set_xticks(np.arange(len(bars)), [f"{ph[0].upper()} {f.upper()}\nEP{w}" for f, w, ph, _ in bars], fontsize=7)
    ax.set_ylim(0, 1.12 * bottoms.max())
    ax.set_ylabel("µs on the critical path")
    ax.set_title("MODEL: where the time goes (D = dispatch, C = combine; "
                 "proxy at in-run speed)", fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    ax.grid(alpha=0.3, axis="y")
    # calibration: model vs measured, ratio per quantity
    ax = fig.add_subplot(gs[1, 2])
    labels = [f"({r['config']}) {r['quantity']}" + (" [held out]" if r["role"] == "held out" else "") for r in cal]
    y = np.arange(len(cal))
    ax.barh(y, [r["ratio"] for r in cal], color=["tab:green" if 0.75 <= r["ratio"] <= 1.25 else "tab:red"
                                                  for r in cal])
    for yi, r in zip(y, cal):
        ax.text(0.03, yi, f"{r['predicted']:.0f} / {r['measured']:.0f} µs", va="center", fontsize=7, color="w")
    ax.axvline(1.0, color="k", lw=1)
    ax.axvspan(0.75, 1.25, color="tab:green", alpha=0.08)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.5)
    ax.set_xlabel("model / measured (band: within 25%)")
    ax.set_title("calibration: (a) 2 x H200; (e) bench proxy; (f)-(h) 1 x H200\nshared by W ranks (MPS), "
                 "(g) emulated NIC; [held out]: no constant from its file", fontsize=9)
    fig.suptitle("moe_a2a latency MODEL (a model where it predicts): decode "
                 "T=128, H=7168 fp8 / bf16, K=8, E=256", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.latency_model",
                                 description="moe_a2a latency MODEL: calibration against our measurements, then "
                                             "EP16/32/64 predictions")
    ap.add_argument("--png", help="write the plot here")
    ap.add_argument("--json", help="write calibration, predictions, constants and published points here")
    ap.add_argument("--speed", choices=SPEEDS, default="run",
                    help="proxy cost: as inside our graph runs with kernel waits (default), as in its benchmark, "
                         "or as inside the eager run with host waits")
    ap.add_argument("--post-us", type=nonneg_float, default=None,
                    help=f"the proxy's Python per posted write at bench speed (default: measured, "
                         f"{POST_PY_PRIVATE_US:.2f} private / {POST_PY_COMBINE_US:.2f} combine)")
    ap.add_argument("--host-staged", action="store_true", help="buffers in host memory on EFA / CX7 too")
    ap.add_argument("--efa-efficiency", type=fraction, default=None,
                    help=f"EFA effective/line-rate bandwidth (default {EFA_BW_EFFICIENCY})")
    ap.add_argument("--proxies", type=int, default=None,
                    help="proxy processes per rank (default: as the library, one per NIC on EFA, else 1)")
    ap.add_argument("--rank-rows", action="store_true", help="dispatch one row per (token, rank) (issue 32)")
    ap.add_argument("--sender-reduce", action="store_true",
                    help="combine reduced at the sender, one row per (token, rank); needs --rank-rows")
    ap.add_argument("--fp8-combine", action="store_true", help="combine rows in fp8 e4m3 + fp32 scales")
    ap.add_argument("--wire", choices=tuple(WIRES), default=None,
                    help="a wire variant by name (moe_a2a/reference.py WIRE_VARIANTS), or the relay of issue 46 "
                         "(a prediction); instead of --rank-rows / --sender-reduce, with "
                         "--fp8-combine where it applies")
    ap.add_argument("--relay-whole-writes", action="store_true",
                    help="what-if with --wire relay: each relay write whole, on one NIC (the library splits each "
                         "in one piece per proxy)")
    args = ap.parse_args(argv)
    if args.proxies is not None and args.proxies < 1:
        ap.error(f"--proxies must be >= 1, got {args.proxies}")
    if args.sender_reduce and not args.rank_rows:
        ap.error("--sender-reduce needs --rank-rows (the weights travel with the per-(token, rank) rows)")
    if args.wire and (args.rank_rows or args.sender_reduce):
        ap.error("--wire names the rows itself: not with --rank-rows / --sender-reduce")
    if args.relay_whole_writes and args.wire != "relay":
        ap.error("--relay-whole-writes needs --wire relay")
    kw = dict(speed=args.speed, post_us=args.post_us, host_staged=True if args.host_staged else None,
              efa_efficiency=args.efa_efficiency, proxies=args.proxies)
    if args.rank_rows or args.fp8_combine:
        kw.update(rank_rows=args.rank_rows, sender_reduce=args.sender_reduce, fp8_combine=args.fp8_combine)
    if args.wire:
        kw.update(WIRES[args.wire])
        if args.fp8_combine:
            kw["fp8_combine"] = True
        if args.relay_whole_writes:
            kw["relay_split"] = False
    cal = calibration()
    rows = table(**kw)
    print("Calibration: the model against our measurements")
    print(format_calibration(cal))
    print("\nOutside the band, and why")
    print(format_outside_band())
    print("\nFitting data and held-out data")
    print(format_sources())
    print(f"\nProxy in-run factor, graph replay with kernel waits (the proxy's steps after COUNT_ROWS_READY in "
          f"the W2-N1 run / in the bench, W=2): {PROXY_IN_RUN_FACTOR:.2f} (used by --speed run); eager with host "
          f"waits (posts over shm): {PROXY_HOST_WAITS_FACTOR:.2f} (--speed host-waits)")
    print(f"Ranks sharing one H200 (MPS): GPU side x {', '.join(f'{shared_gpu_factor(w):.2f} at W={w}' for w in MPS_WORLDS)}"
          f" (node-local), x {EMU_GPU_FACTOR:.2f} more with remote peers over the emulated NIC")
    print(f"\nPredictions: MODEL, not measured; µs; proxy speed '{args.speed}'; terms are "
          "critical-path contributions")
    print(format_table(rows))
    print("\nAgainst the targets and published numbers")
    print(format_targets(rows))
    print("\nFewer bytes (issue 32): the three levers, dispatch / combine / sum, µs (MODEL)")
    print(format_levers())
    print("\nWhere a token's experts land, and the bytes a rank sends per call")
    print(format_distinct_ranks())
    i46 = issue46_rows()
    print("\nIssue 46's runs (1 x H200 under MPS, every row held out): measured against the MODEL")
    print(format_issue46(i46))
    print(format_issue46_missing())
    print("\nBytes a rank sends in those runs, MB (2 x 4)")
    print(format_issue46_bytes())
    relay_kw = {k: v for k, v in kw.items() if k in ("speed", "post_us", "host_staged", "efa_efficiency", "proxies",
                                                     "relay_split")}
    relay = relay_table(**relay_kw)
    print("\nThe relay, modelled (issue 46; timed on one shared GPU only: MODEL predictions, µs)")
    print(format_relay_bytes())
    print(format_relay(relay))
    print(format_relay_sensitivity())
    print("\nThe relay on 1 x H200 under MPS, 8 ranks as 2 x 4 over the emulated NIC (what item 4's runs would "
          "compare against)")
    print(format_relay_emulated())
    runs = relay_runs()
    print("\nThe relay's runs against the walk (held out)")
    print(format_relay_runs(runs))
    print(f"- **{RELAY_MISSING[0]}**: {RELAY_MISSING[1]}")
    print("\nProvenance of every constant")
    print(format_provenance())
    if args.json:
        doc = {"kind": "MODEL (calibrated against our measurements; predictions not measured)", "options": kw,
               "calibration": cal, "predictions": rows, "constants": constants(),
               "provenance": {k: list(v) for k, v in PROVENANCE.items()},
               "routing": [routing_stats(w) for w in WORLDS], "hbm_floor_us": hbm_floor_us(),
               "published": [dict(zip(("source", "config", "fabric", "ep", "dispatch_us", "combine_us",
                                       "total_us"), p)) for p in PUBLISHED],
               "issue_targets_us": ISSUE_TARGETS_US,
               "levers": [{"label": label, "options": lkw,
                           "predictions": {f"{f or 'node'}{w}": predict(w, f, **lkw)
                                           for f, w in [(None, 8)] + [(f, w) for f in FABRICS for w in WORLDS]
                                           if not ("efa_efficiency" in lkw and f != "efa")}}
                          for label, lkw in LEVERS],
               "distinct_ranks": [expected_distinct_ranks(w) for w in LEVER_WORLDS],
               "issue46": [{k: v for k, v in r.items()} for r in i46],
               "relay": relay, "relay_targets_us": RELAY_TARGETS_US, "relay_runs": runs,
               "distinct_nodes": [expected_distinct_nodes(w) for w in WORLDS]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.png:
        plot(rows, cal, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
