#!/usr/bin/env bash
# The GPU suites: the commands behind the numbers in docs/benchmarks.md, run from the repository root on a
# machine with NVIDIA GPUs.
#
#   bash benchmarks/gpu/run.sh quick               1 GPU, ~5 min: kernel tests compiled (the part of gpu-tests 1), kernel
#                                                  and flag benchmarks
#   bash benchmarks/gpu/run.sh gpu-tests [1|2|3|4|all]
#                                                  1 GPU: the whole test suite with compiled kernels, in four parts
#                                                  of under 10 minutes each (pytest-xdist where it is installed),
#                                                  each writing its results file (part<N>.txt: commit, command,
#                                                  counts, failures, skips, slowest tests):
#                                                  1: the kernels (tests/triton_kernels) and every test that starts
#                                                     no rank (tests/*.py, proxy, protocol, benchmarks);
#                                                  2: ranks as processes sharing the GPU without MPS (host waits):
#                                                     tests/e2e;
#                                                  3: the same GPU under MPS (kernel waits): CUDA graphs, the node
#                                                     waits, the facade, aborts (good -> bad -> good -> good);
#                                                  4: as 2, the rest: tests/runtime, bench, compat
#   bash benchmarks/gpu/run.sh full [tests|bench]  2 GPUs (1 works, multi-GPU cases skip): the whole test suite
#                                                  on the GPU, then the benchmarks of one node (a runner with a
#                                                  time limit per command can call the two parts apart)
#   bash benchmarks/gpu/run.sh cross-node [decode|more]
#                                                  2 GPUs as two simulated nodes (one rank each, shm between the
#                                                  proxies): host vs staged placement, proxies per rank, transport
#   bash benchmarks/gpu/run.sh emulated            1 or 2 GPUs: the write-plan kernels compiled, the emulated-NIC
#                                                  tests, decode over the emulated NIC (full speed and EFA-like),
#                                                  and the proxy's host cost (`benchmarks/proxy.py`) on this host
#   bash benchmarks/gpu/run.sh compat [tests|deepep|cost]
#                                                  the DeepEP facade on every GPU here, one rank per GPU: its
#                                                  tests compiled; DeepEP's own low-latency test, unchanged,
#                                                  from the checkout at $DEEPEP (default out/deepep; its commit
#                                                  from $DEEPEP/COMMIT or git), with --shrink-test from 6 GPUs;
#                                                  the facade's cost (graph, eager, host split) and its Python
#   bash benchmarks/gpu/run.sh mps [node-local|deepep|protocol|bytes|relay]
#                                                  several ranks on one GPU under MPS (started and stopped here):
#                                                  the CUDA-graph tests with kernel waits (shrink mode in a graph
#                                                  included) and the facade's shrink tests; DeepEP's low-latency
#                                                  test with 2 and 8 processes (--shared-gpu), --shrink-test at 8,
#                                                  and its normal-mode test (test_intranode.py) at 2 and 8;
#                                                  the protocol's cost: graphs all on one node vs over the
#                                                  emulated NIC, 2 / 4 / 8 ranks, decode and prefill; issue 32's
#                                                  wire variants (bytes and time), ~8 min; issue 46's relay
#                                                  beside per-rank and per-route rows over the emulated NIC at
#                                                  full speed, EFA-like and at EFA's share (relay_full/,
#                                                  relay_efa/, relay_scaled/), ~9 min
#
# Results (JSON, PNG, the steps' log, the machine's description) go to $OUT/<suite>/ when OUT is set (a
# runner that brings $OUT back), else to docs/results/<suite>/, where the docs quote them. Exit status: the
# number of failed steps.
set -u
cd "$(dirname "$0")/../.."

suite=${1:-}
part=${2:-all}
case "$suite:$part" in
  quick:all|full:all|full:tests|full:bench|cross-node:all|cross-node:decode|cross-node:more|emulated:all) ;;
  gpu-tests:all|gpu-tests:1|gpu-tests:2|gpu-tests:3|gpu-tests:4) ;;
  compat:all|compat:tests|compat:deepep|compat:cost|mps:all|mps:node-local|mps:deepep|mps:protocol|mps:bytes|mps:relay) ;;
  *) echo "usage: bash benchmarks/gpu/run.sh quick | gpu-tests [1|2|3|4|all] | full [tests|bench] | cross-node [decode|more] | emulated" \
          "| compat [tests|deepep|cost] | mps [node-local|deepep|protocol|bytes|relay]" >&2; exit 2 ;;
esac
RES=${OUT:+$OUT/$suite}
RES=${RES:-docs/results/$suite}
mkdir -p "$RES"

# The working tree's package first (also in the proxy processes it starts); compiled kernels, not the
# interpreter; NVLink multicast off (not lent on the shared machines).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET

# Set-up: a no-op where `moe-a2a` is installed; otherwise this checkout, editable, without downloads (the
# GPU image has torch and triton and may have no network).
command -v moe-a2a >/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . \
  || { echo "run.sh: 'pip install -e .' failed; install the package first" >&2; exit 1; }

failed=0
# step SECONDS COMMAND...: run with a time limit, log everything, show the tail, count a failure.
step() {
  local limit=$1; shift
  echo "=== $* (limit ${limit}s)" | tee -a "$RES/log.txt"
  local start=$SECONDS
  timeout "$limit" "$@" >>"$RES/log.txt" 2>&1
  local rc=$?
  tail -n 15 "$RES/log.txt"
  echo "=== rc=$rc in $((SECONDS - start)) s" | tee -a "$RES/log.txt"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
gpu_tests=(env MOE_A2A_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider)  # the tests, compiled kernels

# tests_part NAME WORKERS LIMIT_S PYTEST_ARGS...: one part of the GPU suite, its results file $RES/NAME.txt.
# Workers through pytest-xdist where installed, test by test (a file to one worker left test_dispatch.py alone on one).
tests_part() {
  local name=$1 workers=$2 limit=$3; shift 3
  local xml=/tmp/moe_a2a_$name.xml par=()
  if [ "$workers" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then par=(-n "$workers" --dist load); fi
  rm -f "$xml"
  # -vv (over -q): each test's verdict in the log as it ends, so a part killed at its limit still says how far it got
  step "$limit" "${gpu_tests[@]}" -vv "${par[@]}" --junitxml="$xml" "$@"
  if [ -s "$xml" ]; then
    python3 benchmarks/gpu/summarise_tests.py "$xml" --part "$name" \
      --command "MOE_A2A_TEST_DEVICE=cuda python3 -m pytest ${par[*]} $*" >"$RES/$name.txt"
  else
    echo "part $name: no JUnit XML (killed at its ${limit} s limit?)" >"$RES/$name.txt"
  fi
  cat "$RES/$name.txt" | tee -a "$RES/log.txt" | head -30
}

# MPS: ranks sharing a GPU then run their kernels side by side instead of time-slicing, so kernel waits and
# CUDA graphs work with several ranks per GPU. Its own pipe and log folders; the GPU's settings stay as they are.
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$RES/mps_log
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    trap mps_stop EXIT
    echo "run.sh: MPS daemon started (pipes $CUDA_MPS_PIPE_DIRECTORY, log $CUDA_MPS_LOG_DIRECTORY)" | tee -a "$RES/log.txt"
  else
    echo "run.sh: nvidia-cuda-mps-control -d failed: the steps below run without MPS" | tee -a "$RES/log.txt"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control && echo "run.sh: MPS daemon stopped" | tee -a "$RES/log.txt"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  trap - EXIT
}

# What the docs' hardware and date columns are read from.
{
  echo "suite: $suite $part"; date -u +"date: %Y-%m-%d %H:%M UTC"; echo "commit: ${MOE_A2A_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -4
  lscpu | grep -iE "^model name|^cpu\(s\)|numa node\(s\)"
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  fi_info --version 2>/dev/null | head -1
} >"$RES/env.txt" 2>&1
cat "$RES/env.txt"

case "$suite:$part" in
quick:all)
  tests_part quick-kernels 8 420 --timeout 300 tests/triton_kernels
  step 150 moe-a2a bench kernels --preset both --json "$RES/kernels.json" --png "$RES/kernels.png"
  step 60  python -m benchmarks.flags --iters 2000 --reps 10 --json "$RES/flags.json"
  ;;
gpu-tests:all|gpu-tests:1)
  tests_part part1 8 ${PART1_LIMIT_S:-540} --timeout 300 tests/triton_kernels tests/test_*.py tests/proxy tests/protocol tests/benchmarks
  ;;&
gpu-tests:all|gpu-tests:2)
  tests_part part2 4 ${PART2_LIMIT_S:-480} --timeout 300 tests/e2e
  ;;&
gpu-tests:all|gpu-tests:3)
  mps_start
  tests_part part3 2 ${PART3_LIMIT_S:-420} --timeout 240 tests/e2e/test_cuda_graph.py tests/triton_kernels/test_node_sync.py \
    tests/compat/test_shrink.py tests/compat/test_deep_ep.py tests/compat/test_deep_ep_sizes.py tests/runtime/test_killed_rank.py
  tests_part part3-aborts 2 ${PART3_ABORTS_LIMIT_S:-150} --timeout 120 tests/e2e/test_abort.py -k "node-local or never_reaches"
  mps_stop
  ;;&
gpu-tests:all|gpu-tests:4)
  tests_part part4 4 ${PART4_LIMIT_S:-480} --timeout 300 tests/runtime tests/bench tests/compat
  ;;
full:all|full:tests)
  step 900 "${gpu_tests[@]}" --timeout 300 tests
  ;;&
full:all|full:bench)
  step 150 moe-a2a bench kernels --preset both --json "$RES/kernels.json" --png "$RES/kernels.png"
  step 60  python -m benchmarks.flags --iters 2000 --reps 10 --json "$RES/flags.json"
  # one rank per GPU on one node: graph replay, eager, the NCCL baseline and the floor, decode and prefill,
  # plus one traced graph call drawn as the timeline
  step 240 moe-a2a bench e2e --graph --world 2 --node 2 --iters 200 --warmup 20 \
       --json "$RES/e2e_graph_x2.json" --png "$RES/timeline_graph_x2.png"
  # four ranks sharing one GPU (host waits), on one node and as two simulated nodes
  step 60  env CUDA_VISIBLE_DEVICES=0 moe-a2a bench e2e --world 4 --node 4 --device cuda --iters 50 --warmup 5 \
       --json "$RES/e2e_w4n4_one_gpu.json"
  step 60  env CUDA_VISIBLE_DEVICES=0 moe-a2a bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 \
       --json "$RES/e2e_w4n2_one_gpu.json"
  step 60  moe-a2a bench timeline --world 4 --node 2 --device cuda --png "$RES/timeline.png" --json "$RES/timeline.json"
  step 120 moe-a2a demo --device cuda --iters 5
  ;;
cross-node:all|cross-node:decode)
  # decode, the two placements alternating: runs of one configuration spread by ~10%, so medians of three
  for i in 1 2 3; do for b in staged host; do
    step 60 moe-a2a bench e2e --graph --no-nccl --preset decode --world 2 --node 1 --iters 200 --warmup 20 \
         --buffers "$b" --json "$RES/e2e_graph_x2_n1_decode_${b}_$i.json"
  done; done
  ;;&
cross-node:all|cross-node:more)
  # decode and prefill once per placement (the decode run carries one traced call)
  for b in staged host; do
    step 150 moe-a2a bench e2e --graph --no-nccl --world 2 --node 1 --iters 100 --warmup 10 --buffers "$b" \
         --json "$RES/e2e_graph_x2_n1_${b}.json"
  done
  # four ranks on two GPUs as two nodes of two (node peers over NVLink when staged), eager
  for b in staged host; do
    step 60 moe-a2a bench e2e --world 4 --node 2 --device cuda --iters 50 --warmup 5 --buffers "$b" \
         --json "$RES/e2e_w4n2_${b}.json"
  done
  # four ranks, each its own node: one proxy per rank against one per remote peer
  for k in 1 3; do
    step 60 moe-a2a bench e2e --world 4 --node 1 --device cuda --iters 50 --warmup 5 --proxies "$k" \
         --json "$RES/e2e_w4n1_k$k.json"
  done
  # one traced call across the two nodes: kernels and proxy steps on one time axis
  step 60 moe-a2a bench timeline --world 2 --node 1 --device cuda --png "$RES/timeline_x2_n1.png" \
       --json "$RES/timeline_x2_n1.json"
  # the proxy's own costs on this host: Python per write, scatters, round trips, the plan per world size
  step 90 python -m benchmarks.transport --provider shm --iters 2000 --peers 1,7,63 --json "$RES/transport_gpu_host.json"
  ;;
emulated:all)
  # two simulated nodes of one rank each; each remote write a CUDA copy (an instrument, not a network)
  step 240 "${gpu_tests[@]}" tests/triton_kernels/test_write_plan.py tests/e2e/test_emulated_gpu.py
  ngpu=$(nvidia-smi -L | wc -l)
  # one GPU: both ranks share it, so they wait on the host (no graph) and the proxy's spans are traced
  if [ "$ngpu" -ge 2 ]; then mode=(--graph --no-nccl --preset decode); else mode=(--device cuda --trace-proxy); fi
  step 120 moe-a2a bench e2e "${mode[@]}" --transport emulated --world 2 --node 1 --iters 100 --warmup 10 \
       --json "$RES/e2e_emulated_w2n1.json"
  step 120 env MOE_A2A_EMULATED_NIC=12us,25GBps moe-a2a bench e2e "${mode[@]}" --transport emulated --world 2 \
       --node 1 --iters 100 --warmup 10 --json "$RES/e2e_emulated_efa_w2n1.json"
  step 240 python -m benchmarks.proxy --worlds 2,8,16,32,64,128,256 --provider tcp --json "$RES/bench_proxy_tcp.json"
  step 120 python -m benchmarks.proxy --worlds 8,64 --provider shm --json "$RES/bench_proxy_shm.json"
  ;;
compat:all|compat:tests)
  step 400 "${gpu_tests[@]}" --timeout 300 tests/compat
  ;;&
compat:all|compat:deepep)
  deepep=${DEEPEP:-out/deepep}
  ngpu=$(nvidia-smi -L | wc -l)
  { cat "$deepep/COMMIT" 2>/dev/null || git -C "$deepep" rev-parse HEAD 2>/dev/null || echo unknown; } \
    >"$RES/deepep_commit.txt"
  step 400 bash benchmarks/gpu/deepep_low_latency.sh "$deepep" --num-processes "$ngpu"
  # DeepEP's shrink test stops ranks 1, 3 and 5: it needs 6 ranks or more
  if [ "$ngpu" -ge 6 ]; then
    step 400 bash benchmarks/gpu/deepep_low_latency.sh "$deepep" --num-processes "$ngpu" --shrink-test
  fi
  ;;&
compat:all|compat:cost)
  ngpu=$(nvidia-smi -L | wc -l)
  step 300 python3 benchmarks/gpu/facade_cost.py --ranks "$ngpu" --interleave --host-split --out "$RES/facade_cost.json"
  step 120 python3 benchmarks/gpu/facade_cost.py --ranks "$ngpu" --profile --out "$RES/facade_cost_profile.json"
  step 120 python3 benchmarks/facade_python.py --device cuda
  ;;
mps:all|mps:node-local)
  # Several ranks of one node on this GPU under MPS, kernel waits (gpu_wait="auto" picks them under MPS): the
  # CUDA-graph tests (2 ranks; shrink mode inside a graph, 3 ranks), the kernels' masking wait compiled, and
  # the facade's shrink tests with a GPU (the kernels' own waits mask on one node, the host's across nodes).
  mps_start
  step 300 "${gpu_tests[@]}" --timeout 240 tests/e2e/test_cuda_graph.py tests/triton_kernels/test_node_sync.py
  step 420 "${gpu_tests[@]}" --timeout 400 tests/compat/test_shrink.py
  # the facade's calls and refusals with kernel waits, and the aborts of AllToAll itself on one node
  step 420 "${gpu_tests[@]}" --timeout 120 tests/compat/test_deep_ep.py
  step 240 "${gpu_tests[@]}" --timeout 120 tests/e2e/test_abort.py -k node-local
  mps_stop
  ;;&
mps:all|mps:deepep)
  deepep=${DEEPEP:-out/deepep}
  { cat "$deepep/COMMIT" 2>/dev/null || git -C "$deepep" rev-parse HEAD 2>/dev/null || echo unknown; } \
    >"$RES/deepep_commit.txt"
  mps_start
  step 240 bash benchmarks/gpu/deepep_low_latency.sh "$deepep" --shared-gpu --num-processes 2
  step 300 bash benchmarks/gpu/deepep_low_latency.sh "$deepep" --shared-gpu --num-processes 8
  step 300 bash benchmarks/gpu/deepep_low_latency.sh "$deepep" --shared-gpu --num-processes 8 --shrink-test
  # DeepEP's normal-mode test (test_intranode.py), unchanged: 74 s at 2 processes, 132 s at 8 on one H200
  step 240 bash benchmarks/gpu/deepep_intranode.sh "$deepep" --shared-gpu --num-processes 2
  step 400 bash benchmarks/gpu/deepep_intranode.sh "$deepep" --shared-gpu --num-processes 8
  mps_stop
  ;;&
mps:all|mps:protocol)
  # The cross-node protocol's own cost on one GPU: the same ranks all on one node (mapped memory) and as
  # simulated nodes over the emulated NIC, CUDA graphs, decode and prefill, under MPS.
  mps_start
  for wn in 2:2 2:1 4:4 4:2 8:8 8:4; do
    w=${wn%:*}; n=${wn#*:}
    if [ "$n" = "$w" ]; then t=auto; else t=emulated; fi
    step 240 moe-a2a bench e2e --graph --no-nccl --world "$w" --node "$n" --transport "$t" --iters 100 --warmup 10 \
         --json "$RES/e2e_graph_w${w}n${n}_${t}.json"
  done
  mps_stop
  ;;&
mps:all|mps:bytes)
  # Issue 32's levers (reference.WIRE_VARIANTS: per-rank dispatch rows, the combine reduced at the experts'
  # rank, fp8 combine rows), CUDA graphs under MPS, one preset and one variant per run: all five variants with
  # 2 ranks on one node; per_route, per_rank_dispatch and sender_reduced_fp8 across simulated nodes over the
  # emulated NIC (2 ranks as 2 x 1, 8 as 4 x 2; where the cross-node per-rank path is refused or fails, that
  # step fails and the rest go on). Each JSON holds the bytes per rank and, at decode, the oracle's verdict on
  # one replay; `python3 benchmarks/gpu/summarise_bytes.py $RES` tabulates them. ~15 s a step (the protocol
  # part's runs: 24-33 s for both presets); a step not started BYTES_BUDGET_S (default 390) seconds after the
  # first is skipped and counted as failed, so the part ends within ~8 minutes (last start + its 90 s limit).
  plan=()
  for p in decode prefill; do
    for v in per_route per_rank_dispatch sender_reduced fp8_combine sender_reduced_fp8; do plan+=("2 2 $p $v"); done
  done
  for p in decode prefill; do for wn in "2 1" "8 4"; do
    for v in per_route per_rank_dispatch sender_reduced_fp8; do plan+=("$wn $p $v"); done
  done; done
  echo "run.sh: mps bytes: ${#plan[@]} steps planned (world, ranks per node, preset, wire), in this order:" \
    | tee -a "$RES/log.txt"
  printf '  %s\n' "${plan[@]}" | tee -a "$RES/log.txt"
  mps_start
  budget=${BYTES_BUDGET_S:-390}
  begin=$SECONDS
  for s in "${plan[@]}"; do
    read -r w n p v <<<"$s"
    if [ "$n" = "$w" ]; then t=auto; else t=emulated; fi
    if [ $((SECONDS - begin)) -ge "$budget" ]; then
      echo "=== skipped: w$w n$n $p $v (past BYTES_BUDGET_S=$budget s)" | tee -a "$RES/log.txt"
      failed=$((failed + 1))
      continue
    fi
    step 90 moe-a2a bench e2e --graph --no-nccl --world "$w" --node "$n" --transport "$t" --preset "$p" \
         --wire "$v" --iters 100 --warmup 10 --timeout 30 --json "$RES/e2e_bytes_w${w}n${n}_${p}_${v}.json"
  done
  mps_stop
  ;;&
mps:all|mps:relay)
  # Issue 46: the relay (once per (token, node) across nodes) beside the sender-reduced per-rank rows and the
  # route rows, in one run, CUDA graphs under MPS over the emulated NIC, at full speed and EFA-like
  # (MOE_A2A_EMULATED_NIC=$RELAY_NIC, default 12us,25GBps: a latency per message and a bandwidth cap per NIC),
  # and at 8 ranks EFA at the run's stretch (below):
  # 8 ranks as 2 x 4, decode and prefill, then 16 as 2 x 8 at decode (where MPS carries them). One JSON a step
  # in $RES/relay_full/, $RES/relay_efa/ and $RES/relay_scaled/ (bytes per rank, the oracle's verdict at
  # decode); summarise each folder with summarise_bytes.py. A step not started RELAY_BUDGET_S (default 420) s after the first is skipped.
  # EFA-like first, decode before prefill: what a shortened run (RELAY_BUDGET_S) reaches is what matters most.
  # WIRE:K runs K proxies a rank (an emulated NIC each, as on EFA's two NICs a GPU; the relay then sends each
  # write in K pieces): at 8 ranks, 16 proxies share the host's cores with the ranks.
  # relay_scaled/ (W8 as 2 x 4 only): EFA at the run's stretch, MOE_A2A_EMULATED_NIC=$RELAY_NIC_SCALED (default
  # 87us,3.5GBps: 12us,25GBps with the latency times and the bandwidth over the factor by which 8 ranks on one GPU
  # over the emulated NIC stretch the GPU side, `latency_model.emulated_stretch(8)` ~7.2), so that the wire's
  # share of a call is what EFA's would be with a GPU per rank (docs/benchmarks.md, the relay).
  plan=()
  for shape in "8 4 decode" "16 8 decode" "8 4 prefill"; do
    for nic in efa scaled full; do
      wires="per_route sender_reduced relay"
      [ "$nic" = scaled ] && [ "$shape" != "8 4 decode" ] && continue
      if [ "$nic" != full ] && [ "${shape% *}" = "8 4" ]; then wires="$wires per_route:2 relay:2"; fi
      for v in $wires; do plan+=("$nic ${shape% *} ${shape##* } $v"); done
    done
  done
  printf '  %s\n' "${plan[@]}" | tee -a "$RES/log.txt"
  mps_start
  budget=${RELAY_BUDGET_S:-420}
  begin=$SECONDS
  for s in "${plan[@]}"; do
    read -r nic w n p v <<<"$s"
    if [ $((SECONDS - begin)) -ge "$budget" ]; then
      echo "=== skipped: $nic w$w n$n $p $v (past RELAY_BUDGET_S=$budget s)" | tee -a "$RES/log.txt"
      failed=$((failed + 1))
      continue
    fi
    mkdir -p "$RES/relay_$nic"
    case $nic in efa) setting=${RELAY_NIC:-12us,25GBps} ;; scaled) setting=${RELAY_NIC_SCALED:-87us,3.5GBps} ;; *) setting="" ;; esac
    k=1; case $v in *:*) k=${v#*:}; v=${v%%:*} ;; esac
    step 90 env ${setting:+MOE_A2A_EMULATED_NIC=$setting} moe-a2a bench e2e --graph --no-nccl --world "$w" \
         --node "$n" --transport emulated --preset "$p" --wire "$v" --proxies "$k" --iters 50 --warmup 10 \
         --timeout 30 --json "$RES/relay_$nic/e2e_w${w}n${n}_${p}_${v}$([ "$k" = 1 ] || echo "_k$k").json"
  done
  mps_stop
  ;;
esac
echo "=== $suite $part: $failed step(s) failed; results in $RES"
exit "$failed"
