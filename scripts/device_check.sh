#!/usr/bin/env bash
# The prepared device check: on one GPU, in under 8 minutes, what this project cannot measure
# on a CPU, every record and log under one folder (at most 8 files, none in subfolders: what
# the device tool brings back).
#
#   scripts/device_check.sh OUT            # on a machine with CUDA (the device tool: OUT=$OUT)
#   scripts/device_check.sh OUT --smoke    # on a CPU: tiny shapes, a few steps (a slow test
#                                          # runs it, so the script cannot rot)
#
# Steps, most important first, each under its own time limit and the whole under a deadline
# (a step that fails or runs out is logged and the next one runs): the environment; memory
# bandwidth; bench shapes for qwen3-8b and llama-3.1-8b (random weights, the synthetic oracle
# drafter; eager and compiled, i.e. CUDA graphs); the tree core on CUDA (the batched builder
# included); tree-verify attention against the dense mask; the gpu-marked tests; the bundled
# demo. Outputs: records.jsonl (every measurement record), summary.txt (each step: ok / failed
# / timed out, seconds), log.txt (every step's output), env.txt, shapes-PRESET.json (one JSON
# line each). Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail

out=${1:?usage: scripts/device_check.sh OUT [--smoke]}
mode=${2:-full}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
records="$out/records.jsonl"
: >"$out/summary.txt"
: >"$out/log.txt"
start=$(date +%s)
deadline=$((start + ${DEVICE_CHECK_SECONDS:-470}))
failed=0

step() { # step NAME SECONDS COMMAND...: run under min(SECONDS, time left), log, summarise
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - $(date +%s)))
    ((left < limit)) && limit=$left
    if ((limit <= 0)); then
        echo "$name: skipped (deadline)" >>"$out/summary.txt"
        failed=1
        return
    fi
    echo "== $name ($limit s): $*" >>"$out/log.txt"
    local t0 status
    t0=$(date +%s)
    timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$out/log.txt" 2>&1
    status=$?
    local took=$(($(date +%s) - t0))
    case $status in
    0) echo "$name: ok (${took} s)" >>"$out/summary.txt" ;;
    124 | 137) echo "$name: timed out after ${took} s" >>"$out/summary.txt" && failed=1 ;;
    *) echo "$name: failed with status $status (${took} s)" >>"$out/summary.txt" && failed=1 ;;
    esac
}

dd=("$py" -m ddtree) # `timeout` runs programs, not shell functions

if [[ $mode == --smoke ]]; then
    device=cpu
    presets=(tiny-qwen3)
    shapes_args=(--dtype float32 --budgets 8 --prompts 1 --context 16 --max-new-tokens 8)
    bandwidth_args=(--sizes-mib 16 --repeats 2 --warmup 1 --methods read)
    tree_args=(--blocks 8 --budgets 32 --batch 2 --vocab 1000 --repeats 2)
    attention_args=(--contexts 64 --budgets 8 --heads 4 --kv-heads 2 --head-dim 16 --repeats 2)
    demo_args=(--n-prompts 1 --max-new-tokens 4 --engine-modes eager)
    run_tests=no
elif [[ $mode == full ]]; then
    device=cuda
    presets=(qwen3-8b llama-3.1-8b)
    shapes_args=(--dtype bfloat16 --budgets 32 --prompts 2 --context 512 --max-new-tokens 64)
    bandwidth_args=(--sizes-mib 1024 --repeats 10)
    tree_args=(--blocks 16 --budgets 32,256,1024 --batch 1,64 --repeats 10)
    attention_args=(--contexts 512,4096 --budgets 32,256,1024)
    demo_args=(--n-prompts 4)
    run_tests=yes
else
    echo "scripts/device_check.sh: second argument: expected --smoke or nothing, got $mode" >&2
    exit 2
fi

step env 20 "$py" -c "
import platform, torch
print('python', platform.python_version(), 'torch', torch.__version__)
print('cuda', torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
"
cp "$out/log.txt" "$out/env.txt"
# the compiled tree core (optional: the Python builder is used when it does not build)
step build-tree-core 60 "$py" setup.py build_ext --inplace --quiet
step bandwidth 45 "${dd[@]}" bench bandwidth --device "$device" "${bandwidth_args[@]}" --records "$records"
for preset in "${presets[@]}"; do
    step "shapes-$preset" 150 bash -c "\"$py\" -m ddtree bench shapes --preset $preset \
        --device $device ${shapes_args[*]} --records \"$records\" --json \
        > \"$out/shapes-$preset.json\""
done
step tree 45 "${dd[@]}" bench tree --device "$device" "${tree_args[@]}" --records "$records"
step attention 45 "${dd[@]}" bench attention --device "$device" "${attention_args[@]}" --records "$records"
if [[ $run_tests == yes ]]; then
    step gpu-tests 60 "$py" -m pytest -q -m gpu -p no:cacheprovider tests
fi
step demo 120 "${dd[@]}" demo --device "$device" "${demo_args[@]}" --records "$records"

echo "total: $(($(date +%s) - start)) s" >>"$out/summary.txt"
cat "$out/summary.txt"
exit $failed
