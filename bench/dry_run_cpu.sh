#!/usr/bin/env bash
# A bench/run_gpu.sh mode run on this CPU machine before a GPU call is spent on it: the mode's own
# command lines, with the GPU things swapped for CPU stand-ins, so a misspelt flag, a refused option
# or a DP path that does not start shows here. Not a measurement.
#
#   bash bench/dry_run_cpu.sh dp2a          # logs under /tmp/dry-run-dp2a/out, the tree copy beside them
#   DP2_ONLY=dp_sync bash bench/dry_run_cpu.sh dp2b
#
# The mode runs in a copy of this working tree (no .git, no bundles) with a stand-in
# .gpubundle/setup.sh, and shims first on PATH: `nvidia-smi` names DRY_GPUS (2) GPUs; every
# `python` and `torchrun` the mode starts gets --device cuda -> cpu, the qwen3-30b-a3b and
# qwen3-235b-a22b presets -> tiny, --lengths random:IN:OUT[:R] -> random:32:8[:R] (the tiny model's
# minutes, not hours), --dispatcher flashinfer -> all_gather (FlashInfer needs CUDA), --num-requests
# N -> N / DRY_DIV (8, at least 4); serve_step.py, which takes the GPU preset by default, gets
# --model tiny --device cpu; plan_running.py (--gpu auto reads the GPU) gets --gpu h200. The processes those start (torchrun's ranks, Ray's workers, serve_http's server) run the real
# interpreter with the swapped arguments. gpu and gpu2 tests skip on CPU: their collection still runs.
set -euo pipefail
mode=${1:?usage: bash bench/dry_run_cpu.sh MODE}
src=$(cd "$(dirname "$0")/.." && pwd)
dir=${DRY_DIR:-/tmp/dry-run-$mode}
rm -rf "$dir" && mkdir -p "$dir/tree" "$dir/bin" "$dir/out"
tar -C "$src" --exclude=./.git --exclude='./.gpubundle*' --exclude=./.ficache --exclude=./.bases \
  --exclude=./gpu-logs -cf - . | tar -C "$dir/tree" -xf -
mkdir -p "$dir/tree/.gpubundle"
echo 'export PYTHONPATH=${PYTHONPATH:-} PYTHONUNBUFFERED=1  # dry run: this machine has what the bundle brings' \
  > "$dir/tree/.gpubundle/setup.sh"
real_py=$(python -c 'import sys; print(sys.executable)')
cat > "$dir/bin/swap.sh" <<EOF
# sourced by the shims: "\${args[@]}" is "\$@" with the CPU swaps (bench/dry_run_cpu.sh)
args=(); prev=""
for a in "\$@"; do
  case "\$prev:\$a" in
    --device:cuda) a=cpu;;
    --model:qwen3-30b-a3b|--model:qwen3-235b-a22b) a=tiny;;
    --lengths:random:*) IFS=: read -r _ _ _ ratio <<< "\$a"; a=random:32:8\${ratio:+:\$ratio};;
    --dispatcher:flashinfer) a=all_gather;;
    --num-requests:*) a=\$(( a / ${DRY_DIV:-8} > 4 ? a / ${DRY_DIV:-8} : 4 ));;
  esac
  args+=("\$a"); prev=\$a
  case "\$a" in */serve_step.py) args+=(--model tiny --device cpu);; */plan_running.py) args+=(--gpu h200);; esac
done
echo "dry run: \${args[*]}" >&2
EOF
cat > "$dir/bin/python" <<EOF
#!/usr/bin/env bash
source "$dir/bin/swap.sh"; exec "$real_py" "\${args[@]}"
EOF
cat > "$dir/bin/torchrun" <<EOF
#!/usr/bin/env bash
source "$dir/bin/swap.sh"; exec "$real_py" -m torch.distributed.run "\${args[@]}"
EOF
cat > "$dir/bin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
for i in $(seq 0 $(( ${DRY_GPUS:-2} - 1 ))); do
  case "$*" in *-L*) echo "GPU $i: CPU stand-in (dry run)";; *) echo "CPU stand-in (dry run)";; esac
done
EOF
chmod +x "$dir/bin/python" "$dir/bin/torchrun" "$dir/bin/nvidia-smi"
cd "$dir/tree"
PATH="$dir/bin:$PATH" OUT="$dir/out" BENCH_COMMIT=${BENCH_COMMIT:-dry-run} bash bench/run_gpu.sh "$mode"
