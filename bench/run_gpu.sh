#!/usr/bin/env bash
# One call on a lent GPU machine: GPU tests, then benchmarks; logs under $OUT (or ./gpu-logs).
#   bash bench/run_gpu.sh one     # one GPU: gpu tests, registry fill, decode graph, moe layer
#   bash bench/run_gpu.sh multi   # 2-4 GPUs: gpu2 tests, dp_sync and dispatch at 2 and 4 ranks
#   bash bench/run_gpu.sh model1  # one GPU: model tests, serve_step (DP 1), plan --measure
#   bash bench/run_gpu.sh model2  # two GPUs: model gpu/gpu2 tests, Ray actors on 2 GPUs
#   bash bench/run_gpu.sh serve2  # two GPUs: serve_step (DP 2, EP 2)
#   bash bench/run_gpu.sh tests2  # two GPUs: every gpu and gpu2 test
#   bash bench/run_gpu.sh serve   # two GPUs: serve_step at DP 1 and DP 2, plan --measure
#   bash bench/run_gpu.sh kernels # one GPU: kernel tests, moe_layer, a kernel census of serve_step
#   bash bench/run_gpu.sh compare1 # one GPU: serve_step DP 1 vs earlier trees
#   bash bench/run_gpu.sh compare2 # two GPUs: serve_step DP 2 (auto and all_gather) vs earlier trees
#   bash bench/run_gpu.sh final2  # two GPUs: every gpu2 test and the 2-GPU Ray test
#   bash bench/run_gpu.sh benches2 # two GPUs: DP 1 and DP 2 (auto, all_gather) vs earlier trees, census
# Earlier trees for side-by-side runs come as .bases/*.tar.xz (git archive --prefix=NAME/ COMMIT).
#   bash bench/run_gpu.sh load    # two GPUs: prefill and serve_load (qwen3-30b-a3b) at DP 1 and DP 2
#   bash bench/run_gpu.sh prefill1 # one GPU: kernel tests, moe_layer split, prefill vs trees (ATTN_BENCH=1:
#                                  #   + prefill attention FA2/FA3/SDPA)
#   bash bench/run_gpu.sh decode1  # one GPU: decode vs earlier trees, census at 64/256, tile sweep at 64/256
#   bash bench/run_gpu.sh serve2s  # two GPUs: model gpu2 tests, bs-1 host check, serve_load DP 1/2, prefill DP 2
#   bash bench/run_gpu.sh overlap1 # one GPU: overlap GPU tests, decode vs trees, census at bs 1/64/256
#   bash bench/run_gpu.sh load1    # one GPU: extend/prefill vs trees, serve_load DP 1
#   bash bench/run_gpu.sh overlap2 # two GPUs: serve_load DP 2, DP 2 decode vs trees, gpu2 model tests
#   bash bench/run_gpu.sh diag2    # two GPUs: census at bs 1/64/256, serve_load DP 2 (whole log), prefill DP 2
#   bash bench/run_gpu.sh diag1    # one GPU: census at bs 64/256, decode attention variants, a 1x128 extend profiled
#   bash bench/run_gpu.sh attn1    # one GPU: kernel/graph/model tests, decode attention variants, extend steps vs trees
#   bash bench/run_gpu.sh decode6  # one GPU: Triton-bucket tests, DP 1 decode vs trees
#   bash bench/run_gpu.sh decode62 # two GPUs: DP 2 decode vs trees (all_gather), gpu2 model tests
#   bash bench/run_gpu.sh final1   # one GPU: census at bs 64/256, serve_load DP 1, a 1x128 extend profiled
#   bash bench/run_gpu.sh sum1     # one GPU: expert kernel tests, DP 1 decode vs trees
#   bash bench/run_gpu.sh align1   # one GPU: expert kernel tests, the alignment forms side by side, DP 1 decode and
#                                  #   a 1x128 extend vs earlier trees, the extend profiled
#   bash bench/run_gpu.sh extend7  # one GPU: attention/graph/model GPU tests, extend steps vs trees, the extend
#                                  #   profiled with its host side
#   bash bench/run_gpu.sh ttft7    # one GPU: build-count GPU tests, serve_load at rates 4 and 16 (the first
#                                  #   rate's TTFT p99 shows a kernel built inside a step)
#   bash bench/run_gpu.sh kern8    # one GPU: expert kernel tests, the expert split with occupancy, the tile sweep
#   bash bench/run_gpu.sh var8     # one GPU: streamed 1x128/1x256 extends in copies of this tree with one constant
#                                  #   changed each (FA3 from 64 new tokens; q/k prologue token blocks from 64)
#   bash bench/run_gpu.sh tests8   # one GPU: every gpu test (then step8 and load8 on the warm machine)
#   bash bench/run_gpu.sh load8    # one GPU: serve_load at DP 1, four rates
#   bash bench/run_gpu.sh gaps8    # one GPU: where a 1x128 extend and a bs-1 decode step idle the GPU
#   bash bench/run_gpu.sh step8    # one GPU: extend steps (single and streamed) and decode vs earlier trees, run
#                                  #   with this tree's bench/ scripts in every tree
#   bash bench/run_gpu.sh kern9    # one GPU: kernels of a 1x128 extend and a bs-1 decode step; the extend's routing
#                                  #   replayed through the expert path and its tile sweep
#   bash bench/run_gpu.sh pers11   # one GPU: expert kernel tests, the expert GEMMs on persistent grids (a prompt's
#                                  #   routing from .scratch/r128.pt or ROUTING, uniform extends, decode sizes)
#   bash bench/run_gpu.sh mem12    # one GPU: memory-profile/model/extend-graph GPU tests, 512/1024-token extends vs trees
#   bash bench/run_gpu.sh load12    # one GPU: serve_load 64 running, rate inf, mixed steps on/off side by side
#   bash bench/run_gpu.sh base12    # one GPU: the same load in the first .bases tree, then 256 running here
#   bash bench/run_gpu.sh final12   # one GPU: GPU tests of session 12, serve_load 64 running in the base tree and here
#   bash bench/run_gpu.sh http12    # one GPU: serve_load 256 running, HTTP against in-process at 64 running
#   bash bench/run_gpu.sh load13    # one GPU: serve_load 64 running in the first .bases tree, then here fcfs and lof
#   bash bench/run_gpu.sh more13    # one GPU: serve_load here: 128 and 256 running (lof, fcfs), rate 8 at 64
#   bash bench/run_gpu.sh mixed13   # one GPU: mixed steps against decode steps (64/128 rows), one profiled; 1x1024
#   bash bench/run_gpu.sh split13   # one GPU: attention/mixed GPU tests; mixed steps and serve_load (lof) vs .bases/b1
#   bash bench/run_gpu.sh http13    # one GPU: HTTP against in-process at 64 running (rates 16 and inf)
#   bash bench/run_gpu.sh decode13  # one GPU: serve_step bs 1/64/256 here against .bases/b2 (dfb36f3)
#   bash bench/run_gpu.sh final13   # one GPU: the GPU tests of session 13's changes (memory, graphs, DP buffers, attention)
#   bash bench/run_gpu.sh mst13     # one GPU: serve_load (lof) at 64 and 128 running, mixed budget auto against 2048
#   bash bench/run_gpu.sh plan13    # one GPU: plan --measure (qwen3-30b-a3b) at 64 and 256 running, ~4 min
#   bash bench/run_gpu.sh pad14     # one GPU: routing/extend/mixed GPU tests; mixed steps at 64 and 128 rows in
#                                   #   .bases/b3 and here (here at 128 profiled)
#   bash bench/run_gpu.sh load14    # one GPU: serve_load (lof) at 64 and 128 running in .bases/b3 and here
#   bash bench/run_gpu.sh http14    # one GPU: HTTP against in-process at 64 running here; .bases/b3's HTTP at rate 16
#   bash bench/run_gpu.sh mem14     # one GPU: rank-memory GPU tests; plan --measure at 64 running in .bases/b4 and
#                                   #   here; HTTP against in-process at rate 16, 512 requests
#   bash bench/run_gpu.sh pencounts # one GPU: sampling/penalty GPU tests; serve_load 256 running penalized and not
#   bash bench/run_gpu.sh mixtile   # one GPU: a mixed step's routing (128 decode rows + 1x896), the expert kernels
#                                   #   split on it (TUNE=1: + the tile sweep; ROUTING=file: reuse a routing)
#   bash bench/run_gpu.sh ncu23     # one GPU: Nsight Compute on the expert GEMMs of that routing and of its decode
#                                   #   rows alone (throughputs, L2 hit rate, stall reasons)
#   bash bench/run_gpu.sh skew23    # one GPU: the expert path on that routing against balanced routing of 1,024 rows
#   bash bench/run_gpu.sh align23   # one GPU: the two-launch parallel alignment's GPU tests; the expert path vs .bases/*
#   bash bench/run_gpu.sh gaps15    # one GPU: span GPU test; plan --measure at 256; serve_load (lof) at 64 and 128
#                                   #   running with each step's GPU span and the GPU's idle gaps (--gpu-spans)
#   bash bench/run_gpu.sh weak15    # one GPU: graph/extend/mixed/rank-memory GPU tests; plan --measure at 64 and 256
#   bash bench/run_gpu.sh load15    # one GPU: serve_load (lof) at 64 and 128 running in .bases/b5 and here, GPU spans
#   bash bench/run_gpu.sh out15     # one GPU: plan --measure at 64 and 256; load15 at 64 running; graph/mixed/model/
#                                   #   rank-memory GPU tests
#   bash bench/run_gpu.sh fin15     # one GPU: load15 at 128; plan --measure 64/256; GPU tests; load15 at 256
#   bash bench/run_gpu.sh census16  # one GPU: rank-memory/mixed/graph GPU tests; a bs-64 decode step at CTX (600)
#                                   #   context profiled; mixed steps of 64 decode rows and 64-960 prompt tokens
#   bash bench/run_gpu.sh samp17    # one GPU: gpu16's tests; serve_load (lof) at 64 running, greedy against sampled
#   bash bench/run_gpu.sh kv16      # one GPU: FP8 KV GPU tests (SAVE_FI=1: FlashInfer's cache back in fi3.tar.xz);
#                                   #   mixed steps auto/fp8; serve_load (lof) at RUNNING in .bases/b7 (eb898bf), here
#                                   #   auto and here fp8 (KVS, NO_BASE=1 to skip b7)
#   bash bench/run_gpu.sh gpu16     # one GPU: the logprobs GPU test and the FP8 KV GPU tests
#   bash bench/run_gpu.sh draw18    # one GPU: a step's draw alone per sampling config (greedy, temperature, top-k/p, ...)
#   bash bench/run_gpu.sh bias18    # one GPU: logit_bias's GPU tests (sampling, logprobs, rank memory, overlap);
#                                   #   plan --measure at 64 and 256 running (the profile's draw now biases its rows)
#   bash bench/run_gpu.sh topp18    # one GPU: sampling GPU tests; draw_tokens and serve_load (lof, temperature 0.7,
#                                   #   top-p 0.9) at 64 and 256 running, in .bases/b9 (50d77b4) and here
#   bash bench/run_gpu.sh dp2mix18  # two GPUs: serve_load DP 2 in .bases/b10 and here (a decoding rank beside an
#                                   #   extending one replays the extend pieces); gpu2 model test; sampling GPU tests;
#                                   #   top-p serving at 64 running in .bases/b9 and here (DP2_BUDGET ends steps)
#   bash bench/run_gpu.sh pen19     # one GPU: penalty GPU tests; serve_load penalized at RUNNING (256) in .bases/b11
#                                   #   (3ce3e65) and here, then plain here
#   bash bench/run_gpu.sh probe19   # one GPU: projections under cuBLAS / cuBLASLt at M 16-256; sync_probe of a
#                                   #   penalized serving run at 256 running
#   bash bench/run_gpu.sh reppen20  # one GPU: penalty/sampling GPU tests (the repetition penalty's no-sync draw);
#                                   #   serve_load at RUNNING (256) with repetition_penalty 1.1, then plain
#   bash bench/run_gpu.sh prefix20  # one GPU: prefix-caching GPU tests (+ mixed/overlap: extends after a cached
#                                   #   prefix), then serve_load with a shared prompt prefix, without and with
#                                   #   --prefix-caching (PREFIX 1024 shared tokens, RUNNING 64, rates RATES inf,16)
#   bash bench/run_gpu.sh adj19     # one GPU: penalty GPU tests; serve_load with every penalty at RUNNING (256) in
#                                   #   .bases/b12 (torch ops) and here (one Triton pass), then plain here
#   bash bench/run_gpu.sh pdl20     # one GPU: PDL kernel tests; decode and mixed steps in .bases/* (no PDL) and here
#   bash bench/run_gpu.sh pdlload20 # one GPU: serve_load at 64 running in .bases/b13 and here (prefix caching off, on)
#   bash bench/run_gpu.sh proj21    # one GPU: stream_linear GPU tests; serve_step bs 1/64/256 vs .bases/*; the
#                                   #   projections at 3-256 rows (cuBLAS, skinny, stream) and stream's tilings
#   bash bench/run_gpu.sh proj21b   # one GPU: stream_linear at 3-16 rows of o_proj and the router: its tests and the
#                                   #   model's, decode at bs 1/4/8/16/64 vs .bases/*, the projections at 3-16 rows
#   bash bench/run_gpu.sh route22   # two GPUs: HTTP at DP 2 (Ray gang), prompts starting with one of PGROUPS shared
#                                   #   prefixes, in .bases/* and here, this tree's bench/ in all (b16: least
#                                   #   outstanding tokens; b22 = 01941a3: cache-aware routing without the DP prefill
#                                   #   bound); WARM=1 first warms the Triton caches
#   bash bench/run_gpu.sh owed21    # one GPU: min_tokens/sampling GPU tests; HBM read vs copy bandwidth
#   bash bench/run_gpu.sh mem21     # one GPU: memory_growth.py (serving beyond the profiled peak), rank-memory tests
#   bash bench/run_gpu.sh owed20    # one GPU: serving GPU tests with prefix caching on by default and PDL
#   bash bench/run_gpu.sh owed19    # one GPU: session 19's owed GPU tests (sampling, overlap, rank memory)
#   bash bench/run_gpu.sh extend1  # one GPU: GPU tests with extend graphs, extend steps graph vs eager, decode vs trees
#   bash bench/run_gpu.sh dp2a      # two GPUs: serve_step bs 1/64/256 at DP 2 (flashinfer, all_gather; all_to_all
#                                   #   eager last) beside DP 1 on GPU 0, every gpu2 test; tok/s per GPU side by side
#   bash bench/run_gpu.sh dp2b      # two GPUs: serve_load (lof, 64 running a rank, rates inf and 16) at DP 2 beside
#                                   #   DP 1, HTTP at DP 2 (a Ray gang), the 2-GPU Ray test, dp_sync and dispatch
#                                   #   at 2 ranks (both modes end by DP2_BUDGET, 555 s; see dstep)
#   bash bench/run_gpu.sh fp8       # one GPU: FP8 kernel tests; serve_step bs 1/8/64/256 in bf16 and FP8 weights
# Needs .gpubundle (bash ../shared/tools/gpu-bundle.sh) for ray and flashinfer; a carried FlashInfer JIT cache
# (.ficache/*.tar.xz, or split parts *.tar.xz.aa, .ab, ...: `tar c -C /tmp fi`) is unpacked under /tmp once.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpubundle/setup.sh
export PYTHONPATH=$PWD:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
if [ "$FLASHINFER_WORKSPACE_BASE" = /tmp/fi ]; then  # the tarballs hold fi/.cache/flashinfer/...
  for t in .ficache/*.tar.xz .ficache/*.tar.xz.aa .fic2/*.tar.xz; do  # .fic2: one archive, to carry beside Ray
    [ -f "$t" ] && [ ! -e "/tmp/fi/.unpacked-${t##*/}" ] || continue
    cat "${t%.aa}"$([ "${t%.aa}" != "$t" ] && echo ".*") | tar xJ -C /tmp && touch "/tmp/fi/.unpacked-${t##*/}" \
      && echo "FlashInfer JIT cache: $t unpacked under /tmp/fi"
  done
fi
log=${OUT:-gpu-logs}; mkdir -p "$log"
commit=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BENCH_COMMIT=$commit  # a lent machine gets the tree without .git: pass it in
echo "commit $commit, $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
step() { local name=$1; shift; echo "== $name: $*"; local t=$(date +%s); "$@" > "$log/$name.log" 2>&1; local rc=$?
         echo "   rc=$rc in $(( $(date +%s) - t )) s"; tail -n "${TAIL:-25}" "$log/$name.log"; }
# dp2a/dp2b: NAME CAP MIN CMD... runs CMD within the call's budget: every step ends by DP2_BUDGET s (555) after
# the script's start (the bundle's setup counted), its `timeout` CAP or what is left, whichever is less (SIGKILL
# 10 s later); with under MIN s left it is skipped, so a slow step costs the steps after it, never the call.
# BENCH_STACKS_AFTER_S makes serve_load print every thread's stack and exit 15 s before its timeout. The log's
# last TAIL (6) lines show, JSON lines left out; when it failed, its first error (a rank's comes before torchrun's
# summary) and its last lines. Returns CMD's status (0 when skipped).
# DP2_ONLY / DP2_SKIP: the names of the steps to run / to skip.
dstep() { local name=$1 cap=$2 min=$3; shift 3
  case " ${DP2_SKIP:-} " in *" $name "*) echo "== $name: skipped (DP2_SKIP)"; return 0;; esac
  [ -z "${DP2_ONLY:-}" ] || case " $DP2_ONLY " in *" $name "*) ;; *) return 0;; esac
  local left=$(( ${DP2_BUDGET:-555} - SECONDS )); local t=$(( cap < left ? cap : left )) t0=$SECONDS
  if [ "$t" -lt "$min" ]; then echo "== $name: skipped, $left s left of the call's ${DP2_BUDGET:-555} s"; return 0; fi
  echo "== $name (at $t0 s, timeout $t s): $*"
  BENCH_STACKS_AFTER_S=$(( t - 15 )) timeout -k 10 "$t" "$@" > "$log/$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $(( SECONDS - t0 )) s$( (( rc == 124 || rc == 137 )) && echo ' (timed out)')"
  if (( rc == 0 )); then grep -v '^{' "$log/$name.log" | tail -n "${TAIL:-6}"; return 0; fi
  grep -v '^{' "$log/$name.log" | grep -m1 -B3 -A30 -E 'Traceback|Error|error:' | head -n 34
  echo "   ... the log's last lines:"; grep -v '^{' "$log/$name.log" | tail -n 10; return $rc; }
# plan --measure of qwen3-30b-a3b at 64 and 256 running (context 4096), each step within $PLAN_TIMEOUT or $1 s
plan_measures() { for n in 64 256; do
    TAIL=16 step plan_measure_$n timeout ${PLAN_TIMEOUT:-$1} python -m launch.cli plan --model qwen3-30b-a3b \
      --dp 1 --ep 1 --max-running-requests $n --context-len 4096 --measure
  done; }
ngpu=$(nvidia-smi -L | wc -l)
# --base flags for compare_trees.py: every .bases/*.tar.xz, unpacked once under /tmp/bases
bases() { mkdir -p /tmp/bases; for t in .bases/*.tar.xz; do [ -e "$t" ] || continue
          tar xJf "$t" -C /tmp/bases; done; for d in /tmp/bases/*/; do echo -n "--base ${d%/} "; done; }
case "${1:-one}" in
  one)
    step gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/
    step registry_fill python bench/registry_fill.py
    step decode_graph python bench/decode_graph.py ${DECODE_ARGS:-}
    step moe_layer python bench/moe_layer.py
    ;;
  multi)
    step gpu2_tests torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs tests/
    for n in 2 $ngpu; do
      [ "$n" -le "$ngpu" ] || continue
      step dp_sync_$n torchrun --standalone --nproc-per-node "$n" bench/dp_sync.py --device cuda
      step dispatch_$n torchrun --standalone --nproc-per-node "$n" bench/dispatch.py ${DISPATCH_ARGS:-}
      [ "$n" = "$ngpu" ] && break
    done
    ;;
  model1)
    step model_gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_model_gpu.py
    step serve_step_1 python bench/serve_step.py ${SERVE_ARGS:-}
    step plan_measure python -m launch.cli plan --model qwen3-30b-a3b --dp 1 --ep 1 --max-running-requests 32 \
      --context-len 4096 --measure
    ;;
  model2)
    step model_gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_model_gpu.py
    step model_gpu2_tests torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs \
      tests/test_model_gpu2.py
    step ray_gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_launch_ray.py
    ;;
  serve2)
    step serve_step_2 torchrun --standalone --nproc-per-node 2 bench/serve_step.py ${SERVE_ARGS:-}
    ;;
  tests2)  # every GPU test tier on a 2-GPU machine
    step gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/
    step gpu2_tests torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs tests/
    ;;
  serve)  # the rank worker's benchmark on 1 and 2 GPUs, and the planner against a real rank
    step serve_step_1 python bench/serve_step.py ${SERVE_ARGS:-}
    step serve_step_2 torchrun --standalone --nproc-per-node 2 bench/serve_step.py ${SERVE_ARGS:-}
    step plan_measure python -m launch.cli plan --model qwen3-30b-a3b --dp 1 --ep 1 --max-running-requests 32 \
      --context-len 4096 --measure
    ;;
  load)  # prefill throughput / MFU and serving under load, DP 1 then DP 2 (torchrun)
    step prefill_1 python bench/prefill.py ${PREFILL_ARGS:-}
    step prefill_2 torchrun --standalone --nproc-per-node 2 bench/prefill.py ${PREFILL_ARGS:-}
    step serve_load_1 python bench/serve_load.py --model qwen3-30b-a3b --device cuda ${LOAD_ARGS:-}
    step serve_load_2 torchrun --standalone --nproc-per-node 2 bench/serve_load.py --model qwen3-30b-a3b \
      --device cuda ${LOAD_ARGS:-}
    ;;
  kernels)  # one GPU: the decode kernels' tests, the expert path bench, a census, DP 1 vs earlier trees
    step kernel_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_qk_norm_rope.py \
      tests/test_fused_moe.py tests/test_routing_triton.py
    step moe_layer python bench/moe_layer.py ${MOE_ARGS:-}
    step census python bench/serve_step.py --batch-sizes 1,64 --modes graph --profile ${SERVE_ARGS:-}
    ;;
  compare1)  # one GPU: DP 1 decode against earlier trees (after `kernels` on the same machine: JIT cached)
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 ${SERVE_ARGS:-}
    ;;
  prefill1)  # one GPU: the expert kernels' tests and split, prefill attention, prefill against earlier trees
    step kernel_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_qk_norm_rope.py \
      tests/test_fused_moe.py tests/test_routing_triton.py tests/test_graph_gpu.py -k "not graph_gpu or attention"
    step moe_layer python bench/moe_layer.py --split --ep 1 2 --tokens 1 8 64 256 2048 8192 ${MOE_ARGS:-}
    [ -n "${ATTN_BENCH:-}" ] && step prefill_attention python bench/prefill_attention.py
    step prefill_compare python bench/compare_trees.py --key shape $(bases) -- python bench/prefill.py --iters 3 --warmup 1
    step prefill_profile python bench/prefill.py --iters 1 --warmup 1 --shapes 1x8192 --profile
    ;;
  decode1)  # one GPU: DP 1 decode against earlier trees, a census at bs 64 and 256, the tile sweep
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 ${SERVE_ARGS:-}
    step census python bench/serve_step.py --batch-sizes 64,256 --modes graph --profile
    TAIL=8 step moe_tune timeout 240 python bench/moe_layer.py --tune --ep 1 --tokens 64 256
    ;;
  extend1)  # one GPU: model/graph GPU tests with extend graphs, extend steps graph vs eager, decode vs trees
    step gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_model_gpu.py tests/test_graph_gpu.py \
      tests/test_extend_graphs.py
    step prefill_graphs python bench/prefill.py --iters 5 --warmup 2 --shapes ${EXTEND_SHAPES:-1x16,8x16,1x128,1x256} \
      --modes graph,eager
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 ${SERVE_ARGS:-}
    ;;
  serve2s)  # two GPUs: model gpu2 tests (no FlashInfer dispatcher: its JIT takes minutes), the bs-1 host check,
            # serve_load at DP 1 and DP 2, prefill at DP 2 (all_gather)
    step gpu2_model torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs \
      tests/test_model_gpu2.py -k "not flashinfer"
    TAIL=3 step bs1_no_extend python bench/serve_step.py --batch-sizes 1,64 --modes graph --iters 40 --extend-tokens none
    TAIL=3 step bs1_extend python bench/serve_step.py --batch-sizes 1,64 --modes graph --iters 40
    TAIL=3 step bs1_gc_freeze python bench/serve_step.py --batch-sizes 1,64 --modes graph --iters 40 --gc-freeze
    step serve_load_1 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates 4,16,64,inf \
      --num-requests 64 --max-running-requests 64
    step serve_load_2 torchrun --standalone --nproc-per-node 2 bench/serve_load.py --model qwen3-30b-a3b \
      --device cuda --rates 4,16,64,inf --num-requests 64 --max-running-requests 64 --dispatcher all_gather
    step prefill_2 torchrun --standalone --nproc-per-node 2 bench/prefill.py --shapes 1x8192,1x128 \
      --modes graph,eager --iters 3 --warmup 1 --dispatcher all_gather
    ;;
  overlap1)  # one GPU: overlap/model/graph GPU tests, decode vs earlier trees, a census at bs 1/64/256
    step gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_overlap_gpu.py tests/test_model_gpu.py \
      tests/test_graph_gpu.py tests/test_extend_graphs.py
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 30 --modes graph ${SERVE_ARGS:-}
    step census python bench/serve_step.py --batch-sizes 1,64,256 --modes graph --profile --iters 5
    ;;
  load1)  # one GPU: extend steps and prefill vs earlier trees, serve_load at DP 1
    step prefill_compare python bench/compare_trees.py --key shape $(bases) -- python bench/prefill.py --iters 5 \
      --warmup 2 --shapes 1x128,8x16,1x8192 --modes graph
    step serve_load_1 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates 4,16,64,inf \
      --num-requests 64 --max-running-requests 64
    ;;
  overlap2)  # two GPUs: serve_load at DP 2 (whole log), DP 2 decode vs earlier trees (all_gather), gpu2 model tests
    BENCH_STACKS_AFTER_S=${STACKS_S:-200} step serve_load_2 timeout 260 torchrun --standalone --nproc-per-node 2 \
      bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates ${LOAD_RATES:-4,16,64,inf} --num-requests 64 \
      --max-running-requests 64 --dispatcher all_gather
    grep -n -i -A12 "error\|Traceback" "$log/serve_load_2.log" | head -60
    step compare_2 python bench/compare_trees.py --nproc 2 $(bases) -- bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 30 --modes graph --dispatcher all_gather
    step gpu2_model torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs \
      tests/test_model_gpu2.py -k "not flashinfer"
    ;;
  diag2)  # two GPUs: a census at bs 1/64/256 (DP 1), serve_load at DP 2 with its whole log, prefill at DP 2
    step census_1 python bench/serve_step.py --batch-sizes 1,64,256 --modes graph --profile --iters 20
    BENCH_STACKS_AFTER_S=${STACKS_S:-150} step serve_load_2 timeout 280 torchrun --standalone --nproc-per-node 2 \
      bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates ${LOAD_RATES:-16,inf} --num-requests 64 \
      --max-running-requests 64 --dispatcher all_gather
    grep -n -i -B2 -A12 "error\|Traceback" "$log/serve_load_2.log" | head -80
    step prefill_2 timeout 200 torchrun --standalone --nproc-per-node 2 bench/prefill.py --shapes 1x8192,1x128 \
      --modes graph,eager --iters 3 --warmup 1 --dispatcher all_gather
    ;;
  diag1)  # one GPU: where decode at bs 64/256 and a graphed 128-token extend spend their time
    step census python bench/serve_step.py --batch-sizes 64,256 --modes graph --profile --iters 5
    step decode_attention python bench/decode_attention.py
    step extend_profile python bench/prefill.py --shapes 1x128,1x16 --modes graph --profile --iters 5 --warmup 2
    ;;
  attn1)  # one GPU: the tests of the decode attention and expert kernels, the attention variants, extends vs trees
    step gpu_tests timeout 420 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_triton_decode.py \
      tests/test_fused_moe.py tests/test_graph_gpu.py tests/test_model_gpu.py
    step decode_attention python bench/decode_attention.py
    step prefill_compare python bench/compare_trees.py --key shape $(bases) -- python bench/prefill.py --iters 5 \
      --warmup 2 --shapes ${EXTEND_SHAPES:-1x128,1x16,8x16,1x256} --modes graph
    ;;
  decode6)  # one GPU: the Triton-bucket and routing tests, DP 1 decode vs earlier trees
    step gpu_tests timeout 200 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_graph_gpu.py \
      -k "triton or matches_sdpa"
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 30 --modes graph
    ;;
  decode62)  # two GPUs: DP 2 decode vs earlier trees (all_gather), gpu2 model tests
    step compare_2 python bench/compare_trees.py --nproc 2 $(bases) -- bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 30 --modes graph --dispatcher all_gather
    step gpu2_model timeout 300 torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs \
      tests/test_model_gpu2.py -k "not flashinfer"
    ;;
  final1)  # one GPU: census at bs 64/256, serve_load at DP 1, a 1x128 extend profiled
    step census python bench/serve_step.py --batch-sizes 64,256 --modes graph --profile --iters 5
    step serve_load_1 timeout 330 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates 4,16,64,inf \
      --num-requests 64 --max-running-requests 64
    step extend_profile python bench/prefill.py --shapes 1x128 --modes graph --profile --iters 5 --warmup 2
    ;;
  align1)  # one GPU: expert kernel tests, one-launch vs three-launch alignment, decode and extend vs trees
    step gpu_tests timeout 200 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_fused_moe.py
    step moe_layer python bench/moe_layer.py --tokens 8 32 64 128 256 512 --repeats 10
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,8,64,256} --iters 30 --modes graph
    step extend_compare python bench/compare_trees.py --key shape $(bases) -- python bench/prefill.py --iters 5 --warmup 2 \
      --shapes 1x128 --modes graph
    step extend_profile python bench/prefill.py --shapes 1x128 --modes graph --profile --iters 5 --warmup 2
    ;;
  kern8)  # one GPU: expert kernel tests, the expert path split (occupancy) and tile sweep for a prompt's routing
    step kernel_tests timeout 240 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_fused_moe.py
    step moe_split timeout 120 python bench/moe_layer.py --tokens 1 64 128 256 --touched 30 --extend --split --ep 1
    step moe_tune timeout 300 python bench/moe_layer.py --tokens 128 --touched 30 --extend --tune --ep 1
    ;;
  kern9)  # one GPU: the kernels of a 1x128 extend and a bs-1 decode step; the extend's routing saved, then replayed
          # (all 48 layers) through the expert path and its tile sweep
    TAIL=40 step extend_profile timeout 300 python bench/prefill.py --shapes 1x128 --modes graph --profile --iters 5 \
      --warmup 2 --save-routing /tmp/routing_1x128.pt
    TAIL=40 step decode_profile timeout 150 python bench/serve_step.py --batch-sizes 1 --iters 10 --warmup 3 --modes graph \
      --profile
    step moe_routed timeout 300 python bench/moe_layer.py --routing /tmp/routing_1x128.pt --layers 48 --extend --split \
      --tune --ep 1
    ;;
  step8)  # one GPU: extend steps, single and streamed, and DP 1 decode against earlier trees (this tree's bench/)
    bases > /tmp/base_flags
    for d in /tmp/bases/*/; do cp bench/*.py "$d/bench/"; done  # the same harness in every tree
    step extend_compare timeout ${EXTEND_TIMEOUT:-330} python bench/compare_trees.py --key shape --metric step_ms,stream_ms $(cat /tmp/base_flags) \
      -- python bench/prefill.py --iters 9 --warmup 2 --shapes ${EXTEND_SHAPES:-1x128,1x256} --modes graph --stream
    step decode_compare timeout 240 python bench/compare_trees.py $(cat /tmp/base_flags) -- python bench/serve_step.py \
      --batch-sizes ${DECODE_BS:-1,64} --iters 20 --modes graph
    ;;
  var8)  # one GPU: this tree against copies of itself with one constant changed (c0: unchanged, the noise)
    rm -rf /tmp/var; mkdir -p /tmp/var
    for v in c0 vA vB; do mkdir -p /tmp/var/$v; cp -r bench buffers dispatcher dp_runtime graph launch /tmp/var/$v/; done
    sed -i 's/^LONG_EXTEND_TOKENS = 256$/LONG_EXTEND_TOKENS = 64/' /tmp/var/vA/dp_runtime/attention/flashinfer_backend.py
    sed -i 's/^_BLOCK_T_FROM = 1024$/_BLOCK_T_FROM = 64/' /tmp/var/vB/dp_runtime/model/qk_norm_rope.py
    grep -c "LONG_EXTEND_TOKENS = 64" /tmp/var/vA/dp_runtime/attention/flashinfer_backend.py
    grep -c "_BLOCK_T_FROM = 64" /tmp/var/vB/dp_runtime/model/qk_norm_rope.py
    step variants timeout 420 python bench/compare_trees.py --key shape --metric step_ms,stream_ms --base /tmp/var/c0 \
      --base /tmp/var/vA --base /tmp/var/vB -- python bench/prefill.py --iters 9 --warmup 2 \
      --shapes ${EXTEND_SHAPES:-1x128,1x256} --modes graph --stream
    ;;
  pers11)  # one GPU: expert kernel tests, persistent expert-GEMM grids against a program per tile
    step kernel_tests timeout 200 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_fused_moe.py
    TAIL=14 step moe_routed timeout 200 python bench/moe_layer.py --routing ${ROUTING:-.scratch/r128.pt} --layers 48 \
      --extend --split --ep 1 --persistent 0,4 0,3 3,0 3,4 2,4 3,3 1,1
    TAIL=14 step moe_uniform timeout 150 python bench/moe_layer.py --tokens 128 256 1024 --touched 30 --extend --ep 1 \
      --persistent 0,4 3,4 2,3
    TAIL=14 step moe_decode timeout 120 python bench/moe_layer.py --tokens 64 256 --ep 1 --persistent 3,4 4,4 2,2
    ;;
  mem12)  # one GPU: memory-profile, model and extend-graph GPU tests; 512/1024-token extends vs earlier trees
    step gpu_tests timeout ${TESTS_TIMEOUT:-330} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_rank_memory_gpu.py tests/test_mixed_steps_gpu.py tests/test_model_gpu.py tests/test_extend_graphs.py
    bases > /tmp/base_flags
    for d in /tmp/bases/*/; do cp bench/prefill.py "$d/bench/"; done  # the same harness in every tree
    step extend_compare timeout ${EXTEND_TIMEOUT:-420} python bench/compare_trees.py --key shape --metric step_ms,stream_ms \
      $(cat /tmp/base_flags) -- python bench/prefill.py --iters 5 --warmup 2 --shapes ${EXTEND_SHAPES:-1x512,1x1024} \
      --modes graph --stream
    ;;
  load12)  # one GPU: serve_load at 64 running, rate inf, mixed steps on and off side by side (fresh ranks each)
    step serve_load_mixed timeout 560 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests ${NREQ:-384} --max-running-requests ${MRR:-64} --mixed ${MIXED:-both} \
      --chunked-prefill-size ${CHUNK:-8192} --json
    ;;
  base12)  # one GPU: the same load in the earliest .bases tree (its own serve_load), then 256 running here
    bases > /dev/null; b=$(ls -d /tmp/bases/*/ | head -1)
    step serve_load_base timeout 300 env PYTHONPATH=$b:$PYTHONPATH BENCH_COMMIT=$(basename $b) python $b/bench/serve_load.py \
      --model qwen3-30b-a3b --device cuda --rates inf --num-requests ${NREQ:-384} --max-running-requests 64 --json
    step serve_load_256 timeout 280 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests ${NREQ256:-1024} --max-running-requests 256 --json
    ;;
  final12)  # one GPU: GPU tests of the session's changes, then serve_load 64 running in the first .bases tree and here
    step gpu_tests timeout ${TESTS_TIMEOUT:-240} python -m pytest -m gpu -p no:cacheprovider -q -rs -x \
      tests/test_rank_memory_gpu.py tests/test_mixed_steps_gpu.py tests/test_graph_gpu.py tests/test_model_gpu.py \
      tests/test_extend_graphs.py tests/test_flashinfer_backend.py tests/test_fused_moe.py
    bases > /dev/null; b=$(ls -d /tmp/bases/*/ | head -1)
    step serve_load_base timeout 240 env PYTHONPATH=$b:$PYTHONPATH BENCH_COMMIT=$(basename $b) python $b/bench/serve_load.py \
      --model qwen3-30b-a3b --device cuda --rates inf --num-requests 384 --max-running-requests 64 --json
    step serve_load_tree timeout 150 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests 384 --max-running-requests 64 --json
    ;;
  http12)  # one GPU: serve_load 256 running here, then HTTP against in-process at 64 running
    step serve_load_256 timeout 150 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests 1024 --max-running-requests 256 --json
    step serve_http timeout 330 python bench/serve_http.py --model qwen3-30b-a3b --device cuda --rates 16,inf \
      --num-requests 128 --max-running-requests 64 --json
    ;;
  load13)  # one GPU: serve_load 64 running in the first .bases tree (its own script), then here fcfs and lof
    bases > /dev/null; b=$(ls -d /tmp/bases/*/ | head -1)
    step serve_load_base timeout ${BASE_TIMEOUT:-330} env PYTHONPATH=$b:$PYTHONPATH BENCH_COMMIT=$(basename $b) \
      python $b/bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --num-requests 384 \
      --max-running-requests 64 --json
    step serve_load_tree timeout ${TREE_TIMEOUT:-260} python bench/serve_load.py --model qwen3-30b-a3b --device cuda \
      --rates inf --num-requests 384 --max-running-requests 64 --policy ${POLICY:-both} --json
    ;;
  more13)  # one GPU: serve_load here at 128 and 256 running, rate inf (POLICY), and rate 8 at 64 running
    step serve_load_128 timeout ${T128:-150} python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests 512 --max-running-requests 128 --policy ${POLICY:-lof} --json
    step serve_load_256 timeout ${T256:-200} python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests 1024 --max-running-requests 256 --policy ${POLICY:-lof} --mixed-step-tokens ${MST:-auto} --json
    step serve_load_rate8 timeout ${T8:-150} python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates 8 \
      --num-requests 256 --max-running-requests 64 --json
    ;;
  mixtile)  # one GPU: the routing of a mixed step at 128 rows (a prompt beside them), the expert tiles swept on it
    r=${ROUTING:-$log/mixed_routing.pt}
    [ -e "$r" ] || step routing timeout 200 python bench/mixed_step.py --decode-rows 128 --prompts ${PROMPTS:-1x896} \
      --modes graph --iters 3 --save-routing "$r"
    step split timeout 200 python bench/moe_layer.py --routing "$r" --extend --split --persistent 0,0 0,4 4,4 --ep 1 \
      --layers 8
    [ -n "${TUNE:-}" ] && step tune timeout ${TUNE_TIMEOUT:-450} python bench/moe_layer.py --routing "$r" --extend \
      --tune --ep 1 --layers 8
    ;;
  ncu23)  # one GPU: Nsight Compute on the expert GEMMs of a mixed step's routing (128 decode rows + 1x896, extend
           # tiles) and of its 128 decode rows alone (decode tiles): DRAM, L2 and SM throughput, stall reasons
    r=${ROUTING:-$log/mixed_routing.pt}
    [ -e "$r" ] || step routing timeout 240 python bench/mixed_step.py --decode-rows 128 --prompts ${PROMPTS:-1x896} \
      --modes eager --iters 1 --warmup 0 --save-routing "$r"
    cat > /tmp/expert_ncu.py <<'PY'
import sys, torch
from dp_runtime.model.fused_moe_triton import fused_local_expert_sum
routed, rows, layer = torch.load(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ids, w = routed[layer]
ids, w = ids.cuda().to(torch.int32), w.cuda().float()
if rows == "decode":
    ids, w = ids[:128].contiguous(), w[:128].contiguous()
g = torch.Generator(device="cuda").manual_seed(layer)
w13 = (torch.randn(128, 1536, 2048, generator=g, device="cuda") / 2048**0.5).bfloat16()
w2 = (torch.randn(128, 2048, 768, generator=g, device="cuda") / 768**0.5).bfloat16()
x = torch.randn(ids.shape[0], 2048, generator=g, device="cuda").bfloat16()
for _ in range(3):  # two warm calls (builds), the third profiled: ncu --launch-skip 4 of the GEMMs
    fused_local_expert_sum(x, ids, w, w13, w2, extend=rows != "decode")
torch.cuda.synchronize()
print(rows, "rows", ids.shape[0], "experts touched", torch.unique(ids).numel())
PY
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    for rows in mixed decode; do
      TAIL=${NCU_TAIL:-400} step ncu_$rows timeout ${NCU_TIMEOUT:-150} "$ncu" --clock-control none --kernel-name regex:_expert_gemm \
        --launch-skip 4 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
        --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum,l1tex__t_bytes.sum \
        python /tmp/expert_ncu.py "$r" $rows ${LAYER:-5}
    done
    ;;
  skew23)  # one GPU: the expert path on a mixed step's routing (ROUTING, 1,024 rows) against random routing of as
            # many rows (softmax of random logits: every expert ~64 rows, as a router trained to balance load)
    r=${ROUTING:-.routing/mixed_routing.pt}
    TAIL=14 step skewed timeout 200 python bench/moe_layer.py --routing "$r" --extend --split --ep 1 --layers 8
    TAIL=14 step balanced timeout 200 python bench/moe_layer.py --tokens 1024 --extend --split --ep 1 --layers 8
    ;;
  align23)  # one GPU: the alignment's parallel form in two launches (the layout publisher folded into the scatter):
             # its GPU tests, then the expert path at 640 and 1,024 rows in .bases/* and here
    step gpu_tests timeout ${TTESTS:-150} python -m pytest -q -p no:cacheprovider tests/test_pdl_gpu.py \
      tests/test_fused_moe.py -k "align or one_build or replay or pdl or matches"
    bases > /dev/null
    for t in /tmp/bases/*/ .; do
      TAIL=4 step moe_$(basename $(realpath $t)) timeout 120 env PYTHONPATH=$(realpath $t):$PYTHONPATH python \
        $t/bench/moe_layer.py --tokens 640 1024 --extend --ep 1 --layers 8 --split
    done
    ;;
  mem14)  # one GPU: rank-memory GPU tests; plan --measure (64 running) in .bases/b4 and here; HTTP at rate 16
    step gpu_tests timeout 200 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_rank_memory_gpu.py
    bases > /dev/null; b=/tmp/bases/b4
    for t in $b .; do
      TAIL=16 step plan64_$(basename $(realpath $t)) timeout 115 env PYTHONPATH=$(realpath $t):$PYTHONPATH python -m \
        launch.cli plan --model qwen3-30b-a3b --dp 1 --ep 1 --max-running-requests 64 --context-len 4096 --measure
    done
    step serve_http timeout ${THTTP:-330} python bench/serve_http.py --model qwen3-30b-a3b --device cuda --rates 16 \
      --num-requests ${HTTP_REQUESTS:-512} --max-running-requests 64
    ;;
  pad14)  # one GPU: routing/extend/mixed GPU tests; mixed steps in .bases/b3 and here, here at 128 rows profiled
    step gpu_tests timeout ${TESTS_TIMEOUT:-240} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_routing_triton.py tests/test_extend_graphs.py tests/test_mixed_steps_gpu.py
    bases > /dev/null; b=/tmp/bases/b3; cp bench/mixed_step.py $b/bench/  # this tree's script (its budget fix)
    for t in $b .; do for d in ${ROWS:-64 128}; do
      step mixed${d}_$(basename $(realpath $t)) timeout 200 env PYTHONPATH=$(realpath $t):$PYTHONPATH python \
        $t/bench/mixed_step.py --decode-rows $d --prompts ${PROMPTS:-1x256,1x512,1x896} --modes graph \
        $([ $t = . ] && [ $d = 128 ] && echo --profile)
    done; done
    ;;
  load14)  # one GPU: serve_load (lof, rate inf) at 64 and 128 running in .bases/b3 and here
    bases > /dev/null; b=/tmp/bases/b3
    for n in ${RUNNING:-64 128}; do for t in $b .; do
      step load${n}_$(basename $(realpath $t)) timeout 200 env PYTHONPATH=$(realpath $t):$PYTHONPATH python \
        $t/bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --num-requests $([ $n = 64 ] && echo 384 || echo $((n * 4))) \
        --max-running-requests $n --policy lof --json
    done; done
    ;;
  gaps15)  # one GPU: the span GPU test; plan --measure at 256 running; serve_load (lof) at 64 and 128 with GPU spans
    step gpu_tests timeout 150 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_overlap_gpu.py
    TAIL=16 step plan_measure_256 timeout ${PLAN_TIMEOUT:-200} python -m launch.cli plan --model qwen3-30b-a3b \
      --dp 1 --ep 1 --max-running-requests 256 --context-len 4096 --measure
    for n in ${RUNNING:-64 128}; do
      TAIL=3 step load$n timeout 200 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
        --num-requests $([ $n = 64 ] && echo 384 || echo $((n * 4))) --max-running-requests $n --policy lof --json --gpu-spans
    done
    ;;
  weak15)  # one GPU: graph/extend/mixed/rank-memory GPU tests; plan --measure at 64 and 256 running
    step gpu_tests timeout ${TTESTS:-260} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_graph_gpu.py \
      tests/test_extend_graphs.py tests/test_mixed_steps_gpu.py tests/test_rank_memory_gpu.py
    plan_measures 140
    ;;
  load15)  # one GPU: serve_load (lof, rate inf) at 64 and 128 running in .bases/b5 and here, with GPU spans
    bases > /dev/null; b=/tmp/bases/b5
    for n in ${RUNNING:-64 128}; do for t in $b .; do
      TAIL=2 step load${n}_$(basename $(realpath $t)) timeout 200 env PYTHONPATH=$(realpath $t):$PYTHONPATH python \
        $t/bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --num-requests $([ $n = 64 ] && echo 384 \
        || echo $((n * 4))) --max-running-requests $n --policy lof --json --gpu-spans
    done; done
    ;;
  out15)  # one GPU: plan --measure at 64 and 256; serve_load 64 running in .bases/b5 and here; graph/mixed/model/memory GPU tests
    plan_measures 140
    RUNNING=${RUNNING:-64} bash "$0" load15
    step gpu_tests timeout ${TTESTS:-250} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_mixed_steps_gpu.py \
      tests/test_rank_memory_gpu.py tests/test_model_gpu.py tests/test_graph_gpu.py
    ;;
  fin15)  # one GPU: serve_load 128 running in .bases/b5 and here; plan --measure 64/256; GPU tests; serve_load 256
    RUNNING=128 bash "$0" load15
    plan_measures 140
    step gpu_tests timeout ${TTESTS:-200} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_rank_memory_gpu.py \
      tests/test_mixed_steps_gpu.py tests/test_model_gpu.py tests/test_graph_gpu.py tests/test_overlap_gpu.py
    RUNNING=256 bash "$0" load15
    ;;
  census16)  # one GPU: GPU tests of session 15's review mends; a bs-64 decode step at run contexts profiled; mixed-step cost curve
    step gpu_tests timeout ${TTESTS:-230} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_rank_memory_gpu.py \
      tests/test_mixed_steps_gpu.py tests/test_graph_gpu.py
    TAIL=60 step census64 timeout 150 python bench/serve_step.py --batch-sizes 64 --prompt-len ${CTX:-600} --modes graph \
      --iters 10 --profile
    TAIL=14 step mixed64 timeout 200 python bench/mixed_step.py --decode-rows 64 --decode-context ${CTX:-600} --modes graph \
      --prompts ${PROMPTS:-1x64,1x128,1x192,1x320,1x448,1x704,1x960}
    ;;
  kv16)  # one GPU: FP8 KV GPU tests; mixed steps at ROWS (64) rows, auto against fp8; serve_load (lof) in .bases/b7, here auto, here fp8
    [ -n "${SKIP_TESTS:-}" ] || step gpu_tests timeout ${TTESTS:-360} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_kv_fp8_gpu.py tests/test_triton_decode.py tests/test_qk_norm_rope.py tests/test_flashinfer_backend.py
    [ -n "${SAVE_FI:-}" ] && tar cJf "$log/fi3.tar.xz" -C /tmp fi
    [ -n "${SKIP_MIXED:-}" ] || for kv in auto fp8_e4m3; do
      TAIL=9 step mixed_$kv timeout 150 python bench/mixed_step.py --decode-rows ${ROWS:-64} --decode-context ${CTX:-600} \
        --modes graph --prompts 1x64,1x512 --kv-cache-dtype $kv
    done
    bases > /dev/null; b=/tmp/bases/b7
    for n in ${RUNNING:-64}; do
      req=$([ $n = 64 ] && echo 384 || echo $((n * 4)))
      [ -n "${NO_BASE:-}" ] || TAIL=2 step load${n}_b7 timeout 220 env PYTHONPATH=$b:$PYTHONPATH python $b/bench/serve_load.py \
        --model qwen3-30b-a3b --device cuda --rates inf --num-requests $req --max-running-requests $n --policy lof --json --gpu-spans
      for kv in ${KVS:-auto fp8_e4m3}; do
        TAIL=2 step load${n}_$kv timeout 220 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
          --num-requests $req --max-running-requests $n --policy lof --json --gpu-spans --kv-cache-dtype $kv
      done
    done
    ;;
  samp17)  # one GPU: GPU tests (TEST_FILES; TESTS=0: none); serve_load (lof) at RUNNING (64) per SAMPLINGS (temperature:top_p),
           # in .bases/$BASE first when BASE is set (BASE_SAMPLINGS, BASE_REQ), then here
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      ${TEST_FILES:-tests/test_logprobs.py tests/test_kv_fp8_gpu.py}
    n=${RUNNING:-64}
    if [ -n "${BASE:-}" ]; then
      bases > /dev/null; b=/tmp/bases/$BASE
      for s in ${BASE_SAMPLINGS:-0:1 1:1}; do
        TAIL=2 step load${n}_${BASE}_t${s%%:*}_p${s##*:} timeout ${TLOAD:-240} env PYTHONPATH=$b:$PYTHONPATH \
          python $b/bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --num-requests ${BASE_REQ:-${REQ:-128}} \
          --max-running-requests $n --policy lof --json --gpu-spans --temperature ${s%%:*} --top-p ${s##*:}
      done
    fi
    for s in ${SAMPLINGS:-0:1 1:1 0.7:0.9}; do  # temperature:top_p
      TAIL=2 step load${n}_t${s%%:*}_p${s##*:} timeout ${TLOAD:-240} python bench/serve_load.py --model qwen3-30b-a3b \
        --device cuda --rates inf --num-requests ${REQ:-128} --max-running-requests $n --policy lof --json --gpu-spans \
        --temperature ${s%%:*} --top-p ${s##*:} ${BASE_ARGS:-}
    done
    ;;
  draw18)  # one GPU: a step's draw alone per sampling config at 64 and 256 rows (bench/draw_tokens.py)
    step draw_tokens timeout 200 python bench/draw_tokens.py ${DRAW_ARGS:-}
    ;;
  dp2mix18)  # two GPUs: serve_load at DP 2 (64 running a rank, lof) in .bases/b10 (b5b7ab9) and here; the DP 2
             # model test; the sampling GPU tests; serve_load (t 0.7, top-p 0.9) at 64 running on GPU 0, b9 and here
    sl="bench/serve_load.py --model qwen3-30b-a3b --device cuda --policy lof --json --max-running-requests 64"
    bases > /dev/null
    for t in /tmp/bases/b10 .; do
      TAIL=0 dstep serve_load_dp2_$(basename $(realpath $t)) 230 60 env PYTHONPATH=$(realpath $t):$PYTHONPATH \
        torchrun --standalone --nproc-per-node 2 $t/$sl --rates ${RATES2:-inf,16} --num-requests 256
    done
    TAIL=4 dstep gpu2_model 150 60 torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q \
      -rs tests/test_model_gpu2.py
    TAIL=4 dstep sampling_gpu 60 30 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_sampling_gpu.py
    for t in /tmp/bases/b9 .; do
      TAIL=0 dstep topp64_$(basename $(realpath $t)) 90 45 env PYTHONPATH=$(realpath $t):$PYTHONPATH python $t/$sl \
        --rates inf --num-requests 128 --gpu-spans --temperature 0.7 --top-p 0.9
    done
    for f in "$log"/serve_load_*.log "$log"/topp64_*.log; do python bench/load_rows.py "$f"; done
    ;;
  topp18)  # one GPU: sampling GPU tests; draw_tokens (b9, DRAW_TREES, here); serve_load (lof, t 0.7, top-p 0.9) at 64/256
           # running, b9 then here, then greedy here (GREEDY=0: not)
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-200} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_sampling_gpu.py
    bases > /dev/null; b=/tmp/bases/${BASE:-b9}
    for t in $b ${DRAW_TREES:-} .; do
      TAIL=12 step draw_$(basename $(realpath $t)) timeout 120 env PYTHONPATH=$(realpath $t):$PYTHONPATH \
        python $t/bench/draw_tokens.py --configs ${DRAW_CONFIGS:-greedy,t1,t0.7p0.9,t1p0.95,t0.7k50p0.9}
    done
    for n in ${RUNNING:-64 256}; do
      for t in $b .; do
        TAIL=2 step load${n}_$(basename $(realpath $t)) timeout ${TLOAD:-200} env PYTHONPATH=$(realpath $t):$PYTHONPATH \
          python $t/bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --num-requests $(( n * 2 )) \
          --max-running-requests $n --policy lof --json --gpu-spans --temperature 0.7 --top-p 0.9
      done
      [ "${GREEDY:-1}" = 0 ] || TAIL=2 step load${n}_greedy timeout ${TLOAD:-200} python bench/serve_load.py \
        --model qwen3-30b-a3b --device cuda --rates inf --num-requests $(( n * 2 )) --max-running-requests $n \
        --policy lof --json --gpu-spans
    done
    ;;
  bias18)  # one GPU: logit_bias's GPU tests; plan --measure at 64 and 256 running (worst_case_draw with a bias)
    step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_sampling_gpu.py \
      tests/test_logprobs.py tests/test_rank_memory_gpu.py tests/test_overlap_gpu.py
    plan_measures 140
    ;;
  gpu16)  # one GPU: session 16's GPU tests not yet run on a GPU (logprobs on the device, the FP8 prologue's q/k checks)
    step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_logprobs.py \
      tests/test_kv_fp8_gpu.py
    ;;
  http14)  # one GPU: HTTP against in-process at 64 running here (rates 16, inf); .bases/b3's HTTP path at rate 16
    step serve_http timeout ${THTTP:-330} python bench/serve_http.py --model qwen3-30b-a3b --device cuda --rates 16,inf \
      --num-requests 128 --max-running-requests 64
    bases > /dev/null; b=/tmp/bases/b3
    step serve_http_b3 timeout 200 env PYTHONPATH=$b:$PYTHONPATH python $b/bench/serve_http.py --model qwen3-30b-a3b \
      --device cuda --rates 16 --num-requests 128 --max-running-requests 64 --paths http
    ;;
  mixed13)  # one GPU: mixed steps against decode steps at 64 and 128 rows (one profiled), extends' host time
    step mixed_64 timeout ${TM:-300} python bench/mixed_step.py --decode-rows 64 --prompts ${PROMPTS:-1x256,1x512,1x960,4x240} \
      --modes graph,eager --profile
    step mixed_128 timeout ${TM:-200} python bench/mixed_step.py --decode-rows 128 --prompts 1x512,1x896 --modes graph
    step extend_host timeout 150 python bench/prefill.py --shapes 1x1024 --modes graph,eager --iters 5
    ;;
  split13)  # one GPU: attention/mixed GPU tests; mixed steps and serve_load 64 running (lof) in b1 and here
    step gpu_tests timeout ${TESTS_TIMEOUT:-240} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_mixed_steps_gpu.py tests/test_flashinfer_backend.py tests/test_model_gpu.py tests/test_extend_graphs.py
    bases > /dev/null; b=/tmp/bases/b1
    for t in $b .; do
      step mixed_$(basename $(realpath $t)) timeout 150 env PYTHONPATH=$(realpath $t):$PYTHONPATH python $t/bench/mixed_step.py \
        --decode-rows 64 --prompts 1x256,1x512,1x960 --modes graph $([ $t = . ] && echo --profile)
    done
    for t in $b .; do
      step load_$(basename $(realpath $t)) timeout 150 env PYTHONPATH=$(realpath $t):$PYTHONPATH python $t/bench/serve_load.py \
        --model qwen3-30b-a3b --device cuda --rates inf --num-requests 384 --max-running-requests 64 --policy lof --json
    done
    ;;
  http13)  # one GPU: HTTP against in-process at 64 running, rates 16 and inf
    step serve_http timeout ${THTTP:-400} python bench/serve_http.py --model qwen3-30b-a3b --device cuda --rates 16,inf \
      --num-requests 128 --max-running-requests 64
    ;;
  decode13)  # one GPU: decode steps here against dfb36f3 (.bases/b2), each tree with its own serve_step
    bases > /dev/null
    step decode_compare timeout ${TDEC:-400} python bench/compare_trees.py --base /tmp/bases/b2 -- python bench/serve_step.py \
      --batch-sizes 1,64,256 --iters 20
    ;;
  final13)  # one GPU: the GPU tests of session 13's changes
    step gpu_tests timeout ${TESTS_TIMEOUT:-540} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_rank_memory_gpu.py tests/test_mixed_steps_gpu.py tests/test_graph_gpu.py tests/test_model_gpu.py \
      tests/test_extend_graphs.py tests/test_flashinfer_backend.py tests/test_overlap_gpu.py tests/test_dp_gather_gpu.py \
      tests/test_dispatch_gpu.py tests/test_buffers_gpu.py
    ;;
  mst13)  # one GPU: serve_load (lof) at 64 and 128 running, the mixed budget auto (1024) against 2048
    for n in 64 128; do for m in auto 2048; do
      TAIL=1 step load_${n}_$m timeout 100 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
        --num-requests $((n == 64 ? 384 : 512)) --max-running-requests $n --policy lof --mixed-step-tokens $m --json
    done; done
    ;;
  pencounts)  # one GPU: penalty counts on the device: the sampling/penalty/overlap/memory GPU tests, then
    # serve_load at 256 running, rate inf, penalized (frequency 0.5, presence 0.5) and not, each a fresh rank
    step gpu_tests timeout ${TESTS_TIMEOUT:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_sampling_gpu.py tests/test_overlap_gpu.py tests/test_rank_memory_gpu.py tests/test_logprobs.py
    step serve_load_plain timeout 280 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests ${NREQ:-1024} --max-running-requests ${MRR:-256} --json
    step serve_load_penalized timeout 280 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf \
      --num-requests ${NREQ:-1024} --max-running-requests ${MRR:-256} --frequency-penalty 0.5 \
      --presence-penalty 0.5 --json
    ;;
  pen19)  # one GPU: penalty counts on the device: the GPU tests, then serve_load (lof, rate inf, 2 x RUNNING
           # requests) penalized (frequency and presence 0.5) in .bases/b11 (3ce3e65, host recount) and here, then
           # plain here (PLAIN=0: not); the tree's serve_load goes into b11 (its own has no penalty flags)
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-240} python -m pytest -m gpu -p no:cacheprovider -q \
      -rs tests/test_sampling_gpu.py tests/test_overlap_gpu.py tests/test_rank_memory_gpu.py tests/test_logprobs.py
    bases > /dev/null; b=/tmp/bases/${BASE:-b11}; cp bench/serve_load.py $b/bench/serve_load.py
    n=${RUNNING:-256}
    for t in $b .; do
      TAIL=2 step pen${n}_$(basename $(realpath $t)) timeout ${TLOAD:-200} env PYTHONPATH=$(realpath $t):$PYTHONPATH \
        python $t/bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --num-requests $(( n * 2 )) \
        --max-running-requests $n --policy lof --json --gpu-spans --frequency-penalty 0.5 --presence-penalty 0.5
    done
    [ "${PLAIN:-1}" = 0 ] || TAIL=2 step plain${n} timeout ${TLOAD:-200} python bench/serve_load.py --model \
      qwen3-30b-a3b --device cuda --rates inf --num-requests $(( n * 2 )) --max-running-requests $n --policy lof \
      --json --gpu-spans
    ;;
  probe19)  # one GPU: the attention block's projections at serving batch sizes under cuBLAS and cuBLASLt;
             # where a penalized serving run (RUNNING 256, lof, rate inf) makes the host wait (bench/sync_probe.py)
    step proj_blas timeout 150 python bench/skinny_linear.py --rows ${ROWS:-16 64 128 256} --blas cublas cublaslt
    TAIL=40 step sync_probe timeout ${TLOAD:-240} python bench/sync_probe.py -- --model qwen3-30b-a3b --device cuda \
      --rates inf --num-requests ${NREQ:-256} --max-running-requests ${RUNNING:-256} --policy lof --json --gpu-spans \
      --frequency-penalty 0.5 --presence-penalty 0.5
    ;;
  reppen20)  # one GPU: the repetition penalty on the device: the GPU tests (its no-sync draw and prompt marks; the
              # profile's draw, which now marks too, in the rank-memory test), then serve_load (lof, rate inf,
              # 2 x RUNNING requests) with --repetition-penalty 1.1, then plain (PLAIN=0: not)
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-240} python -m pytest -m gpu -p no:cacheprovider -q \
      -rs tests/test_sampling_gpu.py tests/test_overlap_gpu.py tests/test_rank_memory_gpu.py tests/test_logprobs.py
    n=${RUNNING:-256}
    for rep in 1.1 $([ "${PLAIN:-1}" = 0 ] || echo 1.0); do
      TAIL=2 step rep${n}_${rep} timeout ${TLOAD:-200} python bench/serve_load.py --model qwen3-30b-a3b --device cuda \
        --rates inf --num-requests $(( n * 2 )) --max-running-requests $n --policy lof --json --gpu-spans \
        --repetition-penalty $rep
    done
    ;;
  adj19)  # one GPU: a chunk's penalties in one Triton pass: the sampling/penalty GPU tests, then serve_load (lof,
           # rate inf, 2 x RUNNING requests) with every penalty (frequency 0.5, presence 0.5, repetition 1.1) in
           # .bases/b12 (the merge of reppen, torch ops) and here, then plain here (PLAIN=0: not)
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-240} python -m pytest -m gpu -p no:cacheprovider -q \
      -rs tests/test_sampling_gpu.py tests/test_overlap_gpu.py tests/test_rank_memory_gpu.py tests/test_logprobs.py
    bases > /dev/null; b=/tmp/bases/${BASE:-b12}
    n=${RUNNING:-256}
    for t in $b .; do
      TAIL=2 step pen${n}_$(basename $(realpath $t)) timeout ${TLOAD:-200} env PYTHONPATH=$(realpath $t):$PYTHONPATH \
        python $t/bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --num-requests $(( n * 2 )) \
        --max-running-requests $n --policy lof --json --gpu-spans --frequency-penalty 0.5 --presence-penalty 0.5 \
        --repetition-penalty 1.1
    done
    [ "${PLAIN:-1}" = 0 ] || TAIL=2 step plain${n} timeout ${TLOAD:-200} python bench/serve_load.py --model \
      qwen3-30b-a3b --device cuda --rates inf --num-requests $(( n * 2 )) --max-running-requests $n --policy lof \
      --json --gpu-spans
    ;;
  prefix20)  # one GPU: prefix caching (opt-in until this run, 2026-11-27): its GPU tests (bf16, SDPA/FlashInfer, eager/graphs,
              # one by one/together, eviction) with the mixed/overlap ones (extends after a cached prefix), then
              # serve_load where every prompt starts with the same PREFIX (1024) tokens, off then on, side by side
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q \
      -rs tests/test_prefix_caching_gpu.py tests/test_mixed_steps_gpu.py tests/test_overlap_gpu.py
    n=${RUNNING:-64}
    TAIL=12 step prefix${n} timeout ${TLOAD:-420} python bench/serve_load.py --model qwen3-30b-a3b --device cuda \
      --rates ${RATES:-inf,16} --num-requests $(( n * 4 )) --max-running-requests $n --lengths random:256:128:0.5 \
      --shared-prefix-len ${PREFIX:-1024} --prefix-caching both
    ;;
  pdl20)  # one GPU: the runtime's Triton kernels with programmatic dependent launch: the PDL and kernel GPU tests,
           # then decode steps (bs 1/64/256, contexts of CTX 600) and mixed steps (64 rows + a prompt) in .bases/*
           # (no PDL) and here, side by side
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_pdl_gpu.py tests/test_fused_moe.py tests/test_triton_decode.py tests/test_qk_norm_rope.py \
      tests/test_skinny_linear.py tests/test_routing_triton.py tests/test_graph_gpu.py
    [ "${DECODE:-1}" = 0 ] || step decode_compare timeout ${TDEC:-300} python bench/compare_trees.py $(bases) -- \
      python bench/serve_step.py --batch-sizes ${COMPARE_BS:-1,64,256} --prompt-len ${CTX:-600} --iters 30 --modes graph
    [ "${MIXED:-1}" = 0 ] || step mixed_compare timeout ${TMIX:-240} python bench/compare_trees.py --key shape \
      --metric decode_ms,mixed_ms $(bases) -- python bench/mixed_step.py --decode-rows 64 --decode-context ${CTX:-600} \
      --modes graph --prompts ${PROMPTS:-1x256,1x704}
    ;;
  pdlload20)  # one GPU: issue 27's 64-running row (sharegpt, lof, rate inf, 6 x RUNNING requests) in .bases/b13 (no
               # PDL) and here, here without and with prefix caching (the workload shares no prefix: its cost alone)
    bases > /dev/null; b=/tmp/bases/${BASE:-b13}
    n=${RUNNING:-64}
    TAIL=3 step load${n}_base timeout ${TLOAD:-240} env PYTHONPATH=$b:$PYTHONPATH python $b/bench/serve_load.py \
      --model qwen3-30b-a3b --device cuda --rates inf --num-requests $(( n * 6 )) --max-running-requests $n \
      --policy lof --json --gpu-spans
    TAIL=4 step load${n}_here timeout ${TLOAD2:-300} python bench/serve_load.py --model qwen3-30b-a3b --device cuda \
      --rates inf --num-requests $(( n * 6 )) --max-running-requests $n --policy lof --json --gpu-spans \
      --prefix-caching both
    ;;
  proj21)  # one GPU: the split-K projection kernel (stream_linear): its GPU tests with the skinny and model ones,
            # decode steps beside .bases/* (cuBLAS projections), the kernel against cuBLAS, then its tilings swept
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-200} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_stream_linear.py tests/test_skinny_linear.py tests/test_model_gpu.py
    step decode_compare timeout ${TDEC:-150} python bench/compare_trees.py $(bases) -- \
      python bench/serve_step.py --batch-sizes ${COMPARE_BS:-1,64,256} --prompt-len ${CTX:-64} --iters 30 --modes graph
    TAIL=40 step projections timeout ${TPROJ:-90} python bench/skinny_linear.py --rows 3 4 16 64 128 256
    [ "${TUNE:-1}" = 0 ] || TAIL=60 step stream_tune timeout ${TTUNE:-240} python bench/skinny_linear.py --rows 64 \
      --tune-stream ${TUNE_ROWS:-64 256}
    [ "${MIXED:-0}" = 0 ] || step mixed_compare timeout ${TMIX:-200} python bench/compare_trees.py --key shape \
      --metric decode_ms,mixed_ms $(bases) -- python bench/mixed_step.py --decode-rows 64 --decode-context ${CTX:-64} \
      --modes graph --prompts ${PROMPTS:-1x256,1x704}
    ;;
  proj21b)  # one GPU: stream_linear in its narrowed domain (3-16 rows, weights up to 4096 rows: o_proj, router)
    [ "${TESTS:-1}" = 0 ] || step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_stream_linear.py tests/test_model_gpu.py
    step decode_compare timeout ${TDEC:-150} python bench/compare_trees.py $(bases) -- \
      python bench/serve_step.py --batch-sizes ${COMPARE_BS:-1,4,8,16,64} --prompt-len ${CTX:-64} --iters 30 --modes graph
    TAIL=16 step projections timeout ${TPROJ:-60} python bench/skinny_linear.py --rows 3 4 8 16
    ;;
  route22)  # two GPUs: cache-aware DP routing (launch/prefix_routing.py) beside the least-outstanding rule of
             # .bases/*: serve_http at DP 2 over a Ray gang, each prompt starting with one of PGROUPS PREFIX-token
             # prefixes (many system prompts or conversations; one shared prefix is soon cached on every rank)
             # (needs .gpubundle-ray: carry .fic2, a one-archive FlashInfer cache, instead of .ficache)
    bases > /tmp/base_flags
    for d in /tmp/bases/*/; do cp bench/*.py "$d/bench/"; done  # the same harness in every tree
    sh="bench/serve_http.py --model qwen3-30b-a3b --device cuda --launcher ray --dp 2 --policy lof --paths http
      --rates ${RATES:-inf,16} --num-requests ${REQ:-384} --max-running-requests ${RUNNING:-64} --json
      --lengths ${LENGTHS:-random:256:128:0.5} --shared-prefix-len ${PREFIX:-1024} --prefix-groups ${PGROUPS:-128}"
    # A fresh machine compiles every Triton kernel in the first run (minutes): this tree once,
    # short and unreported, so that the timed runs find the caches warm alike.
    [ -n "${WARM:-}" ] && TAIL=0 dstep http_warm ${WARM_CAP:-200} 60 python ${sh/--rates * --num-requests * --max/--rates inf --num-requests 64 --max}
    # SAVE_FI=1: the FlashInfer modules the warm run built come back as fic2.tar.xz (carry it as .fic2/ next time)
    [ -n "${SAVE_FI:-}" ] && XZ_OPT=-T8 tar cJf "$log/fic2.tar.xz" -C /tmp fi && ls -l "$log/fic2.tar.xz"
    for d in /tmp/bases/*/; do n=$(basename "$d")
      TAIL=0 dstep "http_$n" ${CAP:-260} 90 env -C "$d" python $sh; done  # the base tree's code, from its root
    TAIL=0 dstep http_here ${CAP:-260} 90 python $sh
    python bench/side_by_side.py --key rate --where path=http \
      --metric output_tok_s,ttft_s.p50,ttft_s.p99,itl_s.p50,itl_s.p99,e2e_s.p50,server_cached_tokens \
      --title "== HTTP at DP 2, shared prefix: least outstanding tokens (bases) against cache-aware routing" \
      $(for d in /tmp/bases/*/; do n=$(basename "$d"); echo "$n=$log/http_$n.log"; done) here="$log/http_here.log" \
      2>&1 | tee "$log/summary.txt"
    ;;
  owed21)  # one GPU: session 20's GPU tests not yet run (min_tokens' Triton draws, the sampling ones beside it); the
            # HBM read bandwidth (a bf16 sum over 8 GiB) beside the copy bandwidth, the expert stream's ceiling
    step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_min_tokens.py \
      tests/test_sampling_gpu.py
    TAIL=4 step hbm_read timeout 120 python -c "import torch, time
from launch.gpu_specs import measure_copy_bandwidth
x = torch.ones(4 * 2**30, dtype=torch.bfloat16, device='cuda')
for _ in range(3): x.sum()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): x.sum()
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
print(f'read {x.numel() * 2 / dt / 1e12:.3f} TB/s (torch sum over 8 GiB bf16); copy {measure_copy_bandwidth(0) / 1e12:.3f} TB/s')"
    ;;
  mem21)  # one GPU: where serving with prefix caching outgrows the profiled peak (bench/memory_growth.py, off and
           # on), then the rank-memory tests (the third profiled shape, the prefix-caching variant)
    TAIL=30 step memory_growth timeout 240 python bench/memory_growth.py --top 15
    step gpu_tests timeout ${TTESTS:-300} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_rank_memory_gpu.py
    ;;
  owed20)  # one GPU: the serving GPU tests with prefix caching on by default and PDL in the decode graphs (model,
            # mixed steps, rank memory, overlap, FP8 KV, sampling)
    step gpu_tests timeout ${TTESTS:-560} python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_model_gpu.py \
      tests/test_mixed_steps_gpu.py tests/test_rank_memory_gpu.py tests/test_overlap_gpu.py tests/test_kv_fp8_gpu.py \
      tests/test_sampling_gpu.py
    ;;
  owed19)  # one GPU: session 19's GPU tests not yet run to the end: the repetition penalty's no-sync draw (its fix),
            # the one-launch penalties, every overlap test, the rank-memory tests (the profile's draw with the marks)
    step gpu_tests timeout ${TTESTS:-420} python -m pytest -m gpu -p no:cacheprovider -q -rs \
      tests/test_sampling_gpu.py tests/test_overlap_gpu.py tests/test_rank_memory_gpu.py
    ;;
  plan13)  # one GPU: the planner's estimates against the rank's own accounting, 64 and 256 running (a rank each)
    plan_measures 115
    ;;
  tests8)  # one GPU: every gpu test of the tree
    step gpu_tests timeout 560 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/
    ;;
  load8)  # one GPU: serving under load at DP 1, light to saturated
    step serve_load_1 timeout 400 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates 4,16,64,inf \
      --num-requests 64 --max-running-requests 64
    ;;
  gaps8)  # one GPU: where a graphed 1x128 extend and a bs-1 decode step leave the GPU idle
    step extend_profile timeout 420 python bench/prefill.py --shapes 1x128 --modes graph --profile --iters 5 --warmup 2
    step decode_profile timeout 150 python bench/serve_step.py --batch-sizes 1 --iters 10 --warmup 3 --modes graph \
      --profile
    ;;
  extend7)  # one GPU: attention/graph/model GPU tests, extend steps vs earlier trees, a 1x128 extend profiled
    step gpu_tests timeout 300 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_model_gpu.py \
      tests/test_graph_gpu.py tests/test_extend_graphs.py tests/test_flashinfer_backend.py
    step extend_compare python bench/compare_trees.py --key shape $(bases) -- python bench/prefill.py --iters 7 \
      --warmup 2 --shapes ${EXTEND_SHAPES:-1x128,8x16,1x256} --modes graph
    step extend_profile python bench/prefill.py --shapes 1x128 --modes graph --profile --iters 5 --warmup 2
    ;;
  ttft7)  # one GPU: the build-count tests, serve_load at DP 1 at two rates
    step gpu_tests timeout 200 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_qk_norm_rope.py \
      tests/test_fused_moe.py
    step serve_load_1 timeout 330 python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates 4,16 \
      --num-requests 64 --max-running-requests 64
    ;;
  sum1)  # one GPU: the expert kernels' tests, DP 1 decode vs earlier trees
    step gpu_tests timeout 200 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_fused_moe.py
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 30 --modes graph
    ;;
  final2)  # two GPUs, after the code is done: every gpu2 test and the 2-GPU Ray test
    step gpu2_tests torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs tests/
    step ray_gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_launch_ray.py
    ;;
  benches2)  # two GPUs: DP 1 and DP 2 decode against earlier trees, and a census at DP 2
    step compare_1 python bench/compare_trees.py $(bases) -- python bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 ${SERVE_ARGS:-}
    step compare_2_auto python bench/compare_trees.py --nproc 2 $(bases) -- bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 ${SERVE_ARGS:-}
    step compare_2_all_gather python bench/compare_trees.py --nproc 2 $(bases) -- bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 --dispatcher all_gather ${SERVE_ARGS:-}
    step census_1 python bench/serve_step.py --batch-sizes 1,256 --modes graph --profile ${SERVE_ARGS:-}
    ;;
  dp2a)  # two GPUs (issue 29): decode steps at DP 2 / EP 2 per dispatcher beside DP 1 on GPU 0; every gpu2 test
    # bs per rank (DECODE_BS); tok/s per GPU is bs / step on each rank. The JIT of a fresh machine lands in the first.
    ss="bench/serve_step.py --batch-sizes ${DECODE_BS:-1,64,256} --iters ${ITERS:-20} --json"
    TAIL=0 dstep serve_step_dp2_fi 200 60 torchrun --standalone --nproc-per-node 2 $ss --dispatcher flashinfer
    TAIL=0 dstep serve_step_dp1 90 40 python $ss
    TAIL=0 dstep serve_step_dp2_ag 80 40 torchrun --standalone --nproc-per-node 2 $ss --dispatcher all_gather
    TAIL=12 dstep gpu2_tests 270 120 torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider \
      -q -rs --durations=8 tests/
    # all_to_all reads its counts on the host: no graphs, eager rows only
    TAIL=0 dstep serve_step_dp2_a2a 80 40 torchrun --standalone --nproc-per-node 2 $ss --dispatcher all_to_all \
      --modes eager
    { python bench/side_by_side.py --key bs,mode --metric tok_s_per_gpu,step_ms,floor_pct \
        --title "== decode steps (serve_step), DP 2 against DP 1 on one of the same GPUs; tok/s per GPU = bs / step" \
        dp1="$log/serve_step_dp1.log" dp2_fi="$log/serve_step_dp2_fi.log" dp2_ag="$log/serve_step_dp2_ag.log" \
        dp2_a2a="$log/serve_step_dp2_a2a.log"
      echo "== gpu2 tests: $(grep -s -h -E '(passed|failed|skipped|error).* in [0-9.]+s' "$log/gpu2_tests.log" | tail -n 1)"
    } 2>&1 | tee "$log/summary.txt"
    ;;
  dp2b)  # two GPUs (issue 29): serving at DP 2 beside DP 1, the same running per rank; HTTP at DP 2; Ray; dp_sync, dispatch
    # REQ (128) requests a rank, RUNNING (64) running a rank, sharegpt lengths, lof, mixed steps, dispatcher auto;
    # serve_http sends serve_load's requests (same seed, rates in the same order), so its rows match serve_load's.
    req=${REQ:-128}; sl="bench/serve_load.py --model qwen3-30b-a3b --device cuda --policy lof --json
      --max-running-requests ${RUNNING:-64} $([ -n "${SPANS:-}" ] && echo --gpu-spans)"
    # auto picks FlashInfer's all-to-all on one NVLink host; a quick failure (a DP 2 path of that dispatcher,
    # not a hang) gets one run with all_gather, and the HTTP run takes the same dispatcher
    t0=$SECONDS; disp=auto
    TAIL=0 dstep serve_load_dp2 230 100 torchrun --standalone --nproc-per-node 2 $sl --rates ${RATES2:-inf,16} \
      --num-requests $((2 * req)) || { (( SECONDS - t0 < 120 )) && disp=all_gather && TAIL=0 dstep serve_load_dp2_ag 200 90 \
      torchrun --standalone --nproc-per-node 2 $sl --rates ${RATES2:-inf,16} --num-requests $((2 * req)) \
      --dispatcher all_gather; }
    TAIL=0 dstep serve_load_dp1 130 60 python $sl --rates ${RATES1:-inf,16} --num-requests $req
    TAIL=0 dstep serve_http_dp2 170 90 python bench/serve_http.py --model qwen3-30b-a3b --device cuda --launcher ray --dp 2 \
      --policy lof --rates ${HTTP_RATES:-inf,16} --num-requests $((2 * req)) --max-running-requests ${RUNNING:-64} \
      --paths ${HTTP_PATHS:-http} --dispatcher $disp --json
    TAIL=8 dstep ray_gpu_test 120 60 python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_launch_ray.py
    TAIL=20 dstep dp_sync 60 25 torchrun --standalone --nproc-per-node 2 bench/dp_sync.py --device cuda
    TAIL=16 dstep dispatch 100 40 torchrun --standalone --nproc-per-node 2 bench/dispatch.py \
      ${DISPATCH_ARGS:---tokens 1 8 128 1024 8192}
    { python bench/side_by_side.py --tables --key rate \
        --metric output_tok_s/gpu,efficiency,decode_bound_tok_s/gpu,occupancy,itl_s.p50,itl_s.p99,ttft_s.p50,ttft_s.p99 \
        --title "== serve_load, DP 2 against DP 1 (per GPU; eff: out tok/s over the decode-only bound at max run)" \
        dp1="$log/serve_load_dp1.log" dp2="$log/serve_load_dp2.log" $([ $disp = auto ] || echo dp2_ag="$log/serve_load_dp2_ag.log")
      python bench/side_by_side.py --key rate --where path=http \
        --metric output_tok_s/gpu,ttft_s.p50,ttft_s.p99,itl_s.p50,itl_s.p99,e2e_s.p50 \
        --title "== HTTP at DP 2 (Ray gang, client-side times) against serve_load at DP 2 (in-process, the same requests)" \
        dp2_load="$log/serve_load_dp2$([ $disp = auto ] || echo _ag).log" dp2_http="$log/serve_http_dp2.log"
      echo "== 2-GPU Ray test: $(grep -s -h -E '(passed|failed|skipped|error).* in [0-9.]+s' "$log/ray_gpu_test.log" | tail -n 1)"
    } 2>&1 | tee "$log/summary.txt"
    ;;
  compare2)  # two GPUs: DP 2 / EP 2 decode, the auto dispatcher and all_gather, against earlier trees
    step compare_2_auto python bench/compare_trees.py --nproc 2 $(bases) -- bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 ${SERVE_ARGS:-}
    step compare_2_all_gather python bench/compare_trees.py --nproc 2 $(bases) -- bench/serve_step.py \
      --batch-sizes ${COMPARE_BS:-1,64,256} --iters 20 --dispatcher all_gather ${SERVE_ARGS:-}
    ;;
  fp8)  # one GPU: FP8 GPU tests (TESTS=-k... narrows them), the FP8 kernels beside bf16 (fp8_kernels.py), then
        # decode steps of qwen3-30b-a3b for each of QUANTS (none fp8: bf16 and --quantization fp8, same tree, one call)
    step fp8_tests timeout ${TESTS_TIMEOUT:-240} python -m pytest -m gpu -p no:cacheprovider -q -rs -x \
      tests/test_fp8_gpu.py ${TESTS:-}
    [ -n "${KERNELS:-1}" ] && TAIL=40 step fp8_kernels timeout ${TKERN:-150} python bench/fp8_kernels.py
    for q in ${QUANTS:-none fp8}; do
      TAIL=14 step decode_$q timeout ${TDEC:-150} python bench/serve_step.py --batch-sizes ${BS:-1,8,64,256} \
        --iters 20 --modes graph --quantization $q
    done
    [ -n "${SAVE_FI:-}" ] && XZ_OPT=-T8 tar cJf "$log/fic2.tar.xz" -C /tmp fi && ls -l "$log/fic2.tar.xz"
    ;;
esac
