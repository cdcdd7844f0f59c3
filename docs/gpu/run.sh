#!/usr/bin/env bash
# What was run by hand on the GPU machine (device tool, nvidia-h200), from the repository root:
#   bash docs/gpu/run.sh all|final|last   # benchmarks and tests with compiled kernels (2026-11-29 runs)
#   bash docs/gpu/run.sh x2               # two GPUs (nvidia-h200-x2)
#   bash docs/gpu/run.sh latency          # two GPUs: node-local protocol tests + e2e --graph (2026-11-30)
#   bash docs/gpu/run.sh demo             # the README's main job at DeepSeek sizes
#   bash docs/gpu/run.sh next             # not run yet: what the next GPU session checks first
#   bash docs/gpu/run.sh staged|staged2|staged3|remote_first|staged4|post_jitter   # 2026-11-30, third
#                                          session, nvidia-h200-x2: only remote rows staged (docs/benchmarks.md)
# Results land in $OUT (JSON, PNG, logs); docs/benchmarks.md quotes them.
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" | tee -a "$OUT/log.txt"; local s=$SECONDS
         timeout "$t" "$@" >>"$OUT/log.txt" 2>&1; local rc=$?
         tail -n 25 "$OUT/log.txt"; echo "=== rc=$rc in $((SECONDS - s)) s" | tee -a "$OUT/log.txt"; }
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "${1:-all}" in
all)
  step 120 python3 -m moe_a2a.bench kernels --preset both --json "$OUT/kernels.json" --png "$OUT/kernels.png"
  step 45  python3 -m moe_a2a.bench flags --iters 2000 --reps 10 --json "$OUT/flags.json"
  step 50  python3 -m moe_a2a.bench e2e --world 4 --node 4 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n4.json"
  step 50  python3 -m moe_a2a.bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n2.json"
  step 150 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/test_all_to_all.py
  step 120 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels
  step 45  python3 -m moe_a2a.bench.transport --iters 200 --peers 1,7,63 --json "$OUT/transport.json"
  # kernel-side trace stamps (%globaltimer) and their clock calibration
  step 60  env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels/test_sync.py \
       tests/test_all_to_all.py -k "stamps or tracing"
  step 70  python3 -m moe_a2a.bench timeline --world 4 --node 2 --device cuda --png "$OUT/timeline.png" --json "$OUT/timeline.json"
  ;;
final)
  step 120 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graph.py
  step 100 python3 -m moe_a2a.bench kernels --preset both --json "$OUT/kernels.json" --png "$OUT/kernels.png"
  step 130 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/test_all_to_all.py
  step 200 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels/test_dispatch.py \
       tests/triton_kernels/test_combine.py tests/triton_kernels/test_routing.py
  step 30  env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels/test_quant.py \
       tests/triton_kernels/test_sync.py -k "gpu or cuda"
  ;;
last)
  step 70  python3 -m moe_a2a.bench timeline --world 4 --node 2 --device cuda --png "$OUT/timeline.png" --json "$OUT/timeline.json"
  step 60  env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels/test_routing.py
  # The quickstart notebook's code cells as one script (the image has no Jupyter kernel).
  step 110 env MPLBACKEND=Agg python3 -c "import json; nb = json.load(open('notebooks/quickstart.ipynb')); \
      exec(compile('\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code'), 'quickstart', 'exec'))"
  ;;
x2)  # kind nvidia-h200-x2: one rank per GPU, same-node peers through CUDA IPC over NVLink
  nvidia-smi topo -m | head -4
  step 45 python3 -m moe_a2a.bench e2e --world 2 --node 2 --device cuda --iters 100 --warmup 10 --json "$OUT/e2e_x2.json"
  step 45 python3 -m moe_a2a.bench.nccl --world 2 --iters 200 --json "$OUT/nccl_x2.json"
  step 60 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graph.py
  ;;
latency)  # 2026-11-30, kind nvidia-h200-x2: the node-local protocol (kernels synchronise through peer memory)
  nvidia-smi topo -m | head -4
  step 240 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/triton_kernels/test_node_sync.py \
       tests/test_cuda_graph.py tests/test_all_to_all.py -k "node_sync or node_local or graph or bad_index or W4-N4"
  step 300 python3 -m moe_a2a.bench e2e --graph --world 2 --node 2 --iters 200 --warmup 20 \
       --json "$OUT/e2e_graph_x2.json" --png "$OUT/timeline_graph_x2.png"
  ;;
eager)  # 2026-11-30, nvidia-h200-x2: where eager calls spend host time
  step 120 python3 docs/gpu/profile_eager.py 200
  step 120 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/test_all_to_all.py -k bad_index
  ;;
eager2)  # 2026-11-30, nvidia-h200-x2: after remembered launches (LaunchCache) and the cheap per-call checks
  step 120 python3 docs/gpu/profile_eager.py 200
  step 300 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels \
       tests/test_cuda_graph.py
  step 150 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_all_to_all.py \
       -k "node_local or W4-N4 or bad_index or three_calls"
  step 200 python3 -m moe_a2a.bench e2e --graph --world 2 --node 2 --iters 200 --warmup 20 \
       --json "$OUT/e2e_graph_x2.json" --png "$OUT/timeline_graph_x2.png"
  ;;
protocol)  # 2026-11-30, nvidia-h200-x2: one protocol (kernels sync same-node peers, proxy only for remote, no barriers)
  step 200 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_all_to_all.py \
       tests/test_cuda_graph.py
  step 150 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels/test_node_sync.py \
       tests/triton_kernels/test_routing.py tests/triton_kernels/test_combine.py tests/triton_kernels/test_rows.py
  step 100 python3 docs/gpu/profile_eager.py 200
  step 100 python3 -m moe_a2a.bench e2e --graph --world 2 --node 2 --iters 200 --warmup 20 \
       --json "$OUT/e2e_graph_x2.json" --png "$OUT/timeline_graph_x2.png"
  ;;
before)  # 2026-11-30, nvidia-h200-x2: the protocol before that day (commit 4a5e29b) in graph mode, traced
  # (old_pkg/ is `git archive 4a5e29b moe_a2a | tar -x -C old_pkg`, carried to the machine)
  # run from inside old_pkg/: the proxy is started with `python -m moe_a2a.proxy.worker`, which takes the
  # package of the working directory first
  (cd old_pkg && PYTHONPATH=$PWD step 150 python3 ../docs/gpu/before_graph.py "$OUT/before_graph_x2.json")
  ;;
shared)  # 2026-11-30, nvidia-h200 (one GPU): 4 ranks sharing it wait on the host; after the protocol change
  step 60 python3 -m moe_a2a.bench e2e --world 4 --node 4 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n4.json"
  step 60 python3 -m moe_a2a.bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n2.json"
  step 60 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/proxy tests/test_local.py
  ;;
shared1)  # 2026-11-30 (second session), nvidia-h200-x2 with CUDA_VISIBLE_DEVICES=0: 4 ranks on one GPU, host waits
  # (NodeSync.kernel_waits=False), then the compat facades and the fixed-capacity layout on 2 GPUs
  step 60 env CUDA_VISIBLE_DEVICES=0 python3 -m moe_a2a.bench e2e --world 4 --node 4 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n4.json"
  step 60 env CUDA_VISIBLE_DEVICES=0 python3 -m moe_a2a.bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n2.json"
  step 200 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/compat tests/test_all_to_all.py -k "capacity or compat or deep_ep or vllm"
  # across two simulated nodes (one rank per node, host-staged over shm): the "before" of the cross-node work
  step 120 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 1 --iters 100 --warmup 10 --json "$OUT/e2e_graph_x2_n1.json"
  step 60 python3 -m moe_a2a.bench.transport --iters 200 --peers 1,7,63 --json "$OUT/transport.json"
  ;;
cross)  # 2026-11-30 (second session), nvidia-h200-x2: host-memory waits in a one-warp kernel (NodeSync.wait_apart)
  step 150 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 1 --iters 100 --warmup 10 --json "$OUT/e2e_graph_x2_n1.json"
  step 330 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/compat tests/test_cuda_graph.py \
       tests/triton_kernels/test_node_sync.py tests/test_all_to_all.py
  step 60 env CUDA_VISIBLE_DEVICES=0 python3 -m moe_a2a.bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n2.json"
  ;;
cross2)  # 2026-11-30 (second session), nvidia-h200-x2: + the proxy busy-polls between calls; capacity fail-stop
  step 150 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 1 --iters 100 --warmup 10 --json "$OUT/e2e_graph_x2_n1.json"
  step 120 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 2 --iters 200 --warmup 20 --json "$OUT/e2e_graph_x2.json"
  step 240 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_all_to_all.py \
       tests/triton_kernels/test_node_sync.py -k "capacity or dead_proxy or bad_index or W2-N1 or node_sync"
  ;;
one)  # 2026-11-30 (second session), nvidia-h200 (one GPU): every rank shares it and waits on the host
  step 470 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/compat \
       tests/test_all_to_all.py
  ;;
abort)  # 2026-11-30 (second session), nvidia-h200-x2: collective abort, non-fatal bad index, kernels after the -1 rows
  step 150 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_abort.py \
       tests/test_all_to_all.py -k "abort or bad_index or bad_input or capacity or W2-N1"
  step 100 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/triton_kernels/test_dispatch.py \
       tests/triton_kernels/test_combine.py tests/triton_kernels/test_routing.py
  step 60 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 2 --iters 100 --warmup 10 --json "$OUT/e2e_graph_x2.json"
  ;;
next2)  # written 2026-11-30 after the device time was spent: what the next GPU session runs first (nvidia-h200-x2)
  # the collective abort with a rank that waits in kernels (failed once, cut off before pytest said why)
  step 200 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -x -p no:cacheprovider tests/test_abort.py tests/test_writes.py \
       tests/test_all_to_all.py -k "abort or bad_index or capacity or writes or W2-N1 or W3-N1"
  # one write per remote peer and several proxies per rank, across two simulated nodes (before: 2.35 ms)
  step 120 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 1 --iters 100 --warmup 10 --json "$OUT/e2e_graph_x2_n1.json"
  step 60 python3 -m moe_a2a.bench e2e --world 4 --node 1 --device cuda --iters 50 --warmup 5 --proxies 1 --json "$OUT/e2e_w4n1_k1.json"
  step 60 python3 -m moe_a2a.bench e2e --world 4 --node 1 --device cuda --iters 50 --warmup 5 --proxies 3 --json "$OUT/e2e_w4n1_k3.json"
  step 45 python3 -m moe_a2a.bench.transport --iters 200 --peers 1,7,63 --json "$OUT/transport.json"
  ;;
staged)  # 2026-11-30 (third session), nvidia-h200-x2: only remote rows staged (buffers="staged") vs all ("host")
  step 200 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_staging.py \
       tests/triton_kernels/test_routing.py tests/test_all_to_all.py -k "staging or staged or STAGED or node_slots or W2-N1 or gpu_buffers or host_placement"
  step 60 python3 docs/gpu/staging_copy.py "$OUT/staging_copy.json"
  step 120 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 1 --iters 100 --warmup 10 --buffers staged --json "$OUT/e2e_graph_x2_n1_staged.json"
  step 120 python3 -m moe_a2a.bench e2e --graph --no-nccl --world 2 --node 1 --iters 100 --warmup 10 --buffers host --json "$OUT/e2e_graph_x2_n1_host.json"
  step 45 python3 -m moe_a2a.bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --buffers staged --json "$OUT/e2e_w4n2_staged.json"
  step 45 python3 -m moe_a2a.bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --buffers host --json "$OUT/e2e_w4n2_host.json"
  step 60 python3 -m moe_a2a.bench timeline --world 2 --node 1 --device cuda --png "$OUT/timeline_x2_n1.png" --json "$OUT/timeline_x2_n1.json"
  ;;
staged2)  # 2026-11-30 (third session), nvidia-h200-x2: staged vs host alternating (run-to-run spread), decode only
  lscpu | grep -i "numa\|model name\|^cpu(s)"; nvidia-smi topo -m | head -4
  for i in 1 2 3; do for b in staged host; do
    step 60 python3 -m moe_a2a.bench e2e --graph --no-nccl --preset decode --world 2 --node 1 --iters 200 --warmup 20 \
         --buffers $b --json "$OUT/e2e_graph_x2_n1_${b}_$i.json"
  done; done
  ;;
staged3)  # 2026-11-30 (third session), nvidia-h200-x2: remote rows packed first; the GPU suite with "staged" the default
  step 420 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/test_staging.py \
       tests/test_abort.py tests/test_writes.py tests/compat tests/test_cuda_graph.py tests/test_all_to_all.py \
       -k "not W4-N4 and not W3-N1"
  for i in 1 2; do
    step 40 python3 -m moe_a2a.bench e2e --graph --no-nccl --preset decode --world 2 --node 1 --iters 200 --warmup 20 \
         --json "$OUT/e2e_graph_x2_n1_remote_first_$i.json"
  done
  step 40 python3 -m moe_a2a.bench.transport --provider shm --iters 2000 --peers 63 --plan-worlds "" --json "$OUT/transport_shm63.json"
  ;;
remote_first)  # 2026-11-30 (third session), nvidia-h200-x2: remote-first pack on/off, alternating, decode
  for i in 1 2 3; do for rf in 1 0; do
    step 30 env MOE_A2A_PACK_REMOTE_FIRST=$rf python3 -m moe_a2a.bench e2e --graph --no-nccl --preset decode --world 2 \
         --node 1 --iters 200 --warmup 20 --json "$OUT/e2e_graph_x2_n1_rf${rf}_$i.json"
  done; done
  ;;
staged4)  # 2026-11-30 (third session), nvidia-h200-x2: the staged paths once more after the last refactor
  step 280 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_staging.py \
       tests/test_all_to_all.py -k "staging or staged or STAGED or W4-N2 or W2-N1 or gpu_buffers"
  ;;
post_jitter)  # 2026-11-30 (third session), nvidia-h200-x2: the post cost's median vs minimum
  step 60 python3 docs/gpu/post_jitter.py "$OUT/post_jitter.json"
  ;;
demo)
  step 120 python3 -m moe_a2a.cli demo --device cuda --iters 5
  ;;
next)  # written after the device time of 2026-11-29 was spent; ~16 min of limits: split over two or three calls
  # cuMem send/recv buffers exported as POSIX FDs, imported by the proxy, registered or fallen back
  # and the whole end-to-end file again: the proxy and plan changes of that day ran on CPU only
  step 240 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/proxy/test_memory.py \
       tests/test_all_to_all.py tests/test_cuda_graph.py
  # the kernels after their shared helpers were factored out (same code inlined: timings should not move)
  step 200 env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels
  step 100 python3 -m moe_a2a.bench kernels --preset both --json "$OUT/kernels.json" --png "$OUT/kernels.png"
  step 45  python3 -m moe_a2a.bench flags --iters 2000 --reps 10 --json "$OUT/flags.json"
  # eager latency after the launcher work (384 -> 134 µs of launcher Python on the CPU machine)
  step 60  python3 -m moe_a2a.bench kernels --launchers --json "$OUT/launchers.json"
  step 50  python3 -m moe_a2a.bench e2e --world 4 --node 4 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n4.json"
  step 50  python3 -m moe_a2a.bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --json "$OUT/e2e_w4n2.json"
  step 45  python3 -m moe_a2a.bench.transport --iters 200 --peers 1,7,63 --json "$OUT/transport.json"
  # kernel-side trace stamps (%globaltimer) and their clock calibration
  step 60  env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/triton_kernels/test_sync.py \
       tests/test_all_to_all.py -k "stamps or tracing"
  step 70  python3 -m moe_a2a.bench timeline --world 4 --node 2 --device cuda --png "$OUT/timeline.png" --json "$OUT/timeline.json"
  ;;
esac
