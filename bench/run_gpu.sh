#!/usr/bin/env bash
# One call on a lent GPU machine: GPU tests, then benchmarks; logs under $OUT (or ./gpu-logs).
# The reproducible suites only. The commands of every session's one-off modes (side-by-side runs
# against .bases trees, profiles, sweeps) are recorded with their results in docs/BENCHMARKS.md;
# `git show COMMIT:bench/run_gpu.sh` at a result's commit has the mode that produced it.
#   bash bench/run_gpu.sh one     # one GPU: gpu tests, registry fill, decode graph, moe layer
#   bash bench/run_gpu.sh multi   # 2-4 GPUs: gpu2 tests, dp_sync and dispatch at 2 and 4 ranks
#   bash bench/run_gpu.sh model1  # one GPU: model tests, serve_step (DP 1), plan --measure
#   bash bench/run_gpu.sh model2  # two GPUs: model gpu/gpu2 tests, Ray actors on 2 GPUs
#   bash bench/run_gpu.sh tests2  # two GPUs: every gpu and gpu2 test
#   bash bench/run_gpu.sh door2   # two GPUs: a rank killed under load on `serve --dp 2` (a Ray gang)
#   bash bench/run_gpu.sh kernels # one GPU: kernel tests, moe_layer, a kernel census of serve_step
#   bash bench/run_gpu.sh serve   # two GPUs: serve_step at DP 1 and DP 2, plan --measure
#   bash bench/run_gpu.sh load    # two GPUs: prefill and serve_load (qwen3-30b-a3b) at DP 1 and DP 2
#   bash bench/run_gpu.sh dp2b    # two GPUs: serve_load (lof, 64 running a rank, rates inf and 16) at DP 2 beside
#                                 #   DP 1, HTTP at DP 2 (a Ray gang), the 2-GPU Ray test, dp_sync and dispatch
#                                 #   at 2 ranks (every step ends by DP2_BUDGET, 555 s; see dstep)
#   bash bench/run_gpu.sh fp8     # one GPU: FP8 kernel tests; serve_step bs 1/8/64/256 in bf16 and FP8 weights
#   bash bench/run_gpu.sh dep     # 2 or 4 GPUs (all it sees, N): Qwen3-235B-A22B FP8 at DP N / EP N (issue 44): the
#                                 #   235B-shape gpuN tests, dispatch at its shapes, serving at the running counts the
#                                 #   planner accepts; qwen3-30b-a3b bf16 at DP N beside DP 1 (and 2); by DP2_BUDGET
# Needs .gpubundle (bash ../shared/tools/gpu-bundle.sh) for ray and flashinfer; a carried FlashInfer JIT cache
# (.ficache/*.tar.xz, or split parts *.tar.xz.aa, .ab, ...: `tar c -C /tmp fi`) is unpacked under /tmp once.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpubundle/setup.sh
# pip gives each file it installs the install time as its mtime, and FlashInfer's JIT modules depend on
# tvm_ffi's headers: ninja found every carried module older than its headers and rebuilt it on every fresh
# machine (norm, attention, cascade: minutes a call). The headers are the carried wheel's: date them back.
[ -d /tmp/site/tvm_ffi ] && find /tmp/site/tvm_ffi -newermt 2001-01-01 -exec touch -h -d 2000-01-01 {} +
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
ngpu=$(nvidia-smi -L | wc -l)
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
  tests2)  # every GPU test tier on a 2-GPU machine
    step gpu_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/
    step gpu2_tests torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider -q -rs tests/
    ;;
  door2)  # two GPUs (issue 45): kill a rank of `serve --dp 2` under load; 503s, named errors, same tokens after
    step door2_test python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_serve_rank_killed.py
    ;;
  kernels)  # one GPU: the decode kernels' tests, the expert path bench, a census, DP 1 vs earlier trees
    step kernel_tests python -m pytest -m gpu -p no:cacheprovider -q -rs tests/test_qk_norm_rope.py \
      tests/test_fused_moe.py tests/test_routing_triton.py
    step moe_layer python bench/moe_layer.py ${MOE_ARGS:-}
    step census python bench/serve_step.py --batch-sizes 1,64 --modes graph --profile ${SERVE_ARGS:-}
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
  fp8)  # one GPU: FP8 GPU tests (TESTS=-k... narrows them), the FP8 kernels beside bf16 (fp8_kernels.py; KERNELS=
        # empty skips it), with TUNE=1 the tile sweep (fp8_tune.py, TUNE_ARGS), then
        # decode steps of qwen3-30b-a3b for each of QUANTS (none fp8: bf16 and --quantization fp8, same tree, one call)
    step fp8_tests timeout ${TESTS_TIMEOUT:-240} python -m pytest -m gpu -p no:cacheprovider -q -rs -x \
      tests/test_fp8_gpu.py ${TESTS:-}
    [ -n "${KERNELS-1}" ] && TAIL=40 step fp8_kernels timeout ${TKERN:-150} python bench/fp8_kernels.py
    [ -n "${TUNE:-}" ] && TAIL=80 step fp8_tune timeout ${TTUNE:-240} python bench/fp8_tune.py ${TUNE_ARGS:-}
    # BASE=.bases/NAME: FP8 decode steps of that earlier tree beside this one (compare_trees.py)
    [ -n "${BASE:-}" ] && TAIL=14 step decode_fp8_vs_base timeout ${TDEC:-150} python bench/compare_trees.py \
      --base "$BASE" -- python bench/serve_step.py --batch-sizes ${BS:-1,8,64,256} --iters 20 --modes graph \
      --quantization fp8
    for q in ${QUANTS:-none fp8}; do
      TAIL=14 step decode_$q timeout ${TDEC:-150} python bench/serve_step.py --batch-sizes ${BS:-1,8,64,256} \
        --iters 20 --modes graph --quantization $q
    done
    # LOAD_QUANTS="none fp8": serve_load (lof, sharegpt, rate inf) for each weight format, LOAD_RUNNING running
    for q in ${LOAD_QUANTS:-}; do
      TAIL=8 step load_$q timeout ${TLOAD:-120} python bench/serve_load.py --model qwen3-30b-a3b --device cuda \
        --policy lof --rates inf --max-running-requests ${LOAD_RUNNING:-64} --num-requests ${LOAD_REQ:-384} \
        --quantization $q
    done
    [ -n "${SAVE_FI:-}" ] && XZ_OPT=-T8 tar cJf "$log/fic2.tar.xz" -C /tmp fi && ls -l "$log/fic2.tar.xz"
    ;;
  dep)  # issue 44 on the N = 2 or 4 GPUs it sees, every step by DP2_BUDGET (535 here: the FlashInfer cache's
        # packing follows): (a) the gpuN tier of tests/test_preset_235b_gpu.py; (b) dispatch at 128 experts, top 8,
        # hidden 4096, FlashInfer beside raw MoeAlltoAll; (c) qwen3-235b-a22b FP8 at DP N / EP N, random 1000/1000
        # (ratio 0, every output its full length: presets have no EOS), at each running count of WANT (64,128,256)
        # that the planner accepts at context 2048, else the most it accepts, one model load (--concurrency);
        # (d) qwen3-30b-a3b bf16, sharegpt, 64 running a rank, REQ (64) requests a rank, DP N, DP 2 (N = 4), DP 1.
    [ "$ngpu" -ge 2 ] || { echo "dep needs 2 or 4 GPUs; this machine has $ngpu" >&2; exit 2; }
    n=$(( ngpu >= 4 ? 4 : 2 )); export DP2_BUDGET=${DP2_BUDGET:-535}
    # FlashInfer's MoeAlltoAll is in no carried cache (2-3 minutes of nvcc): built beside the tests' other cases;
    # FlashInfer's dispatcher (and its test case) is used only if the build succeeded within FI_WAIT (240) s.
    fi_t0=$SECONDS
    $(command -v setsid > /dev/null && echo setsid -w) python -c \
      "from flashinfer.comm.trtllm_moe_alltoall import get_moe_alltoall_module as m; m()" > "$log/fi_a2a_jit.log" 2>&1 &
    fi_pid=$!  # its own process group (setsid): a build past FI_WAIT is ended with its nvcc children
    t235="torchrun --standalone --nproc-per-node $n -m pytest -m gpu$n -p no:cacheprovider -q -rs tests/test_preset_235b_gpu.py"
    TAIL=8 dstep tests_gpu$n 240 60 $t235 -k "not flashinfer"
    while kill -0 $fi_pid 2>/dev/null && (( SECONDS - fi_t0 < ${FI_WAIT:-240} )); do sleep 2; done
    if kill -0 $fi_pid 2>/dev/null; then fi_rc=timeout; kill -- -$fi_pid || kill $fi_pid; else wait $fi_pid; fi_rc=$?; fi
    echo "== FlashInfer MoeAlltoAll JIT: rc=$fi_rc after $(( SECONDS - fi_t0 )) s"; tail -n 3 "$log/fi_a2a_jit.log"
    disp=auto methods="all_gather all_to_all flashinfer raw"
    [ "$fi_rc" = 0 ] || { disp=all_gather methods="all_gather all_to_all"; }
    TAIL=16 dstep dispatch_$n 100 40 torchrun --standalone --nproc-per-node $n bench/dispatch.py \
      --tokens 1 8 128 1024 --hidden 4096 --experts 128 --top-k 8 --methods $methods
    counts=$(python bench/plan_running.py --dp $n --context-len 2048 --want ${WANT:-64,128,256} 2> "$log/plan_running.log")
    echo "== plan_running: accepted running counts a rank: ${counts:-none}"; cat "$log/plan_running.log"
    [ -n "$counts" ] && TAIL=0 dstep serve235_dep$n 330 150 torchrun --standalone --nproc-per-node $n bench/serve_load.py \
      --model qwen3-235b-a22b --quantization fp8 --device cuda --lengths random:1000:1000:0 --concurrency "$counts" \
      --max-running-requests "${counts##*,}" --warmup 1 --warmup-max-new 16 --dispatcher $disp --json
    [ "$fi_rc" = 0 ] && TAIL=8 dstep tests_gpu${n}_fi 100 50 $t235 -k flashinfer
    sl30="bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates inf --max-running-requests 64 --warmup 2 --json"
    req=${REQ:-64}  # one wave a rank: three 30B runs fit after the 235B steps
    TAIL=0 dstep serve30_dp$n 150 70 torchrun --standalone --nproc-per-node $n $sl30 --num-requests $((n * req)) \
      --dispatcher $disp
    [ $n = 4 ] && TAIL=0 dstep serve30_dp2 130 70 torchrun --standalone --nproc-per-node 2 $sl30 \
      --num-requests $((2 * req)) --dispatcher $disp
    TAIL=0 dstep serve30_dp1 120 60 python $sl30 --num-requests $req
    { echo "== summary (commit $commit, $n GPUs)"
      for t in tests_gpu$n tests_gpu${n}_fi; do
        [ -f "$log/$t.log" ] && echo "   $t: $(grep -h -E '(passed|failed|skipped|error).* in [0-9.]+s' "$log/$t.log" \
          | tail -n 1)" || echo "   $t: not run"; done
      grep -s -A8 '^| hidden' "$log/dispatch_$n.log" | sed 's/^/   /'
      python bench/side_by_side.py --tables --key concurrency \
        --metric output_tok_s/gpu,dp_balance,dp_sync_wait_s,tpot_s.p50,ttft_s.p50,efficiency \
        --title "== qwen3-235b-a22b FP8, DP $n / EP $n, random 1000/1000: out tok/s per GPU and DP balance" \
        dep$n="$log/serve235_dep$n.log"
      python bench/side_by_side.py --key rate --metric output_tok_s/gpu,dp_balance,itl_s.p50,ttft_s.p50,occupancy \
        --title "== qwen3-30b-a3b bf16, sharegpt, 64 running a rank: DP $n$([ $n = 4 ] && echo ' and 2') against DP 1" \
        dp1="$log/serve30_dp1.log" $([ $n = 4 ] && echo dp2="$log/serve30_dp2.log") dp$n="$log/serve30_dp$n.log"
    } 2>&1 | tee "$log/summary.txt"
    # FlashInfer's JIT modules of this call (MoeAlltoAll included): carry $OUT/fic2.tar.xz as .fic2/ next time
    (( SECONDS < 580 )) && XZ_OPT=-T0 timeout $(( 590 - SECONDS )) tar cJf "$log/fic2.part" -C /tmp fi \
      && mv "$log/fic2.part" "$log/fic2.tar.xz" && ls -l "$log/fic2.tar.xz"; rm -f "$log/fic2.part"
    ;;
  *)
    echo "unknown mode ${1}: one of one multi model1 model2 tests2 door2 kernels serve load dp2b fp8 dep (others: docs/BENCHMARKS.md)" >&2; exit 2
    ;;
esac
