#!/usr/bin/env bash
# Tensor, pipeline and expert parallelism of the megatron backend through `miles train`, on one host with
# >= 2 GPUs (>= 4 for TP2 x PP2 and EP2 x TP2), with random-init models (scripts/make_random_model.py):
#
#   layout      GPUs  presets
#   tp2          2    llama-1b, qwen3-moe-8e      --tensor-model-parallel-size 2
#   pp2          2    llama-1b, qwen3-moe-8e      --pipeline-model-parallel-size 2
#   tp2pp2       4    llama-1b, qwen3-moe-8e      TP2 x PP2
#   ep2tp2       4    qwen3-moe-8e                --expert-model-parallel-size 2 x TP2 (DP2)
#
# For each layout and preset it runs, and says before each run what it runs:
#   1. `miles train --dry-run` of the layout (flags, layout against the model, disk, memory): must pass;
#   2. the TP1 baseline (same data-parallel size, same seed) for ROLLOUTS rollouts, optimizer state resident;
#   3. the layout, optimizer state resident, ROLLOUTS rollouts: losses within bf16 tolerance of the baseline
#      (the max |diff| is printed);
#   4. the layout, optimizer state streamed (fp32 moments): losses bit-identical to 3;
#   5. the layout streamed, saving after rollout 2, then a --load resume to ROLLOUTS: the resumed rollouts'
#      losses bit-identical to 4's.
# TP/PP > 1 trains only with --experimental-model-parallel until these checks have passed on GPUs; this script
# passes it. A run that fails is reported ("FAILED" with the first error line) and the script goes on; its exit
# code is the number of checks that failed. The engine's weights after each handoff against the TP1 export are
# checked by tests/gpu/test_parallel_megatron_gpu.py, not here.
# Usage: scripts/validate_parallel.sh [LAYOUT...]    (default: every layout the host has GPUs for)
#   WORK=<dir with ~60 GB free> (default /tmp/miles-parallel); ROLLOUTS (default 3); TOLERANCE (default 0.05)
set -uo pipefail
WORK=${WORK:-/tmp/miles-parallel}
ROLLOUTS=${ROLLOUTS:-3}
TOLERANCE=${TOLERANCE:-0.05}
mkdir -p "$WORK"
GPUS=$(python -c 'import torch; print(torch.cuda.device_count())')
common=(--train-backend megatron --colocate --rollout-batch-size 8 --n-samples-per-prompt 4
        --rollout-max-response-len 16 --seed 1234 --rollout-seed 42)
failed=0

declare -A FLAGS=(
  [tp2]="--tensor-model-parallel-size 2"
  [pp2]="--pipeline-model-parallel-size 2"
  [tp2pp2]="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
  [ep2tp2]="--tensor-model-parallel-size 2 --expert-model-parallel-size 2"
)
declare -A WORLD=([tp2]=2 [pp2]=2 [tp2pp2]=4 [ep2tp2]=4)
declare -A DP=([tp2]=1 [pp2]=1 [tp2pp2]=1 [ep2tp2]=2)
declare -A PRESETS=([tp2]="llama-1b qwen3-moe-8e" [pp2]="llama-1b qwen3-moe-8e" [tp2pp2]="llama-1b qwen3-moe-8e"
                    [ep2tp2]="qwen3-moe-8e")

model() {  # model <preset>: a random-init HF folder, written once
  [ -d "$WORK/$1" ] || python scripts/make_random_model.py "$1" "$WORK/$1"
}

compare() {  # compare <what> <a.jsonl> <b.jsonl> <tolerance; 0: bit-identical> [first rollout]
  python - "$@" <<'PY'
import json, sys
what, a, b, tol = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
first = int(sys.argv[5]) if len(sys.argv) > 5 else 0
def losses(path):
    return {r["rollout_id"]: r["loss"] for r in map(json.loads, open(path)) if r["rollout_id"] >= first}
la, lb = losses(a), losses(b)
common = sorted(set(la) & set(lb))
diff = max((abs(la[i] - lb[i]) for i in common), default=float("nan"))
ok = bool(common) and (diff <= tol if tol else all(la[i] == lb[i] for i in common))
print(f"{'PASS' if ok else 'FAIL'} {what}: rollouts {common}, max |loss diff| {diff:.3g}"
      f" ({'bit-identical required' if not tol else f'tolerance {tol}'})")
sys.exit(0 if ok else 1)
PY
}

run() {  # run <label> <args...>: says what it runs; a failure is reported, not fatal
  local label=$1; shift
  echo "== $label: miles train $*"
  if miles train "$@" > "$WORK/$label.log" 2>&1; then echo "   ran ($WORK/$label.log)"; return 0; fi
  local rc=$?
  echo "   FAILED (exit $rc): $(grep -m1 -E 'error|Error' "$WORK/$label.log" || tail -1 "$WORK/$label.log")"
  failed=$((failed + 1))
  return 1
}

layouts=("$@")
if [ ${#layouts[@]} -eq 0 ]; then
  for l in tp2 pp2 tp2pp2 ep2tp2; do
    if [ "${WORLD[$l]}" -le "$GPUS" ]; then layouts+=("$l"); else echo "skip $l: needs ${WORLD[$l]} GPUs, this host has $GPUS"; fi
  done
fi
for l in "${layouts[@]}"; do
  for m in ${PRESETS[$l]}; do
    model "$m"
    tag="$l-$m"
    read -r -a par <<< "${FLAGS[$l]}"
    # Megatron trains MoE layers under TP only with sequence parallelism
    [ "$m" = qwen3-moe-8e ] && [ "$l" != pp2 ] && par+=(--sequence-parallel)
    base=("${common[@]}" --hf-checkpoint "$WORK/$m" --num-rollout-engines 1)
    layout=("${base[@]}" --num-train-ranks "${WORLD[$l]}" "${par[@]}" --experimental-model-parallel)  # every layout has TP or PP > 1
    stream=(--stream-optimizer-state-to-disk --offload-train-target=disk --offload-train-disk-dir "$WORK/disk-$tag")
    run "$tag-dry-run" "${layout[@]}" "${stream[@]}" --dry-run || continue
    baseline_ep=(); [ "$l" = ep2tp2 ] && baseline_ep=(--expert-model-parallel-size 2)
    run "$tag-tp1" "${base[@]}" --num-train-ranks "${DP[$l]}" "${baseline_ep[@]}" --num-rollout "$ROLLOUTS" \
      --metrics-file "$WORK/$tag-tp1.jsonl" || continue
    if run "$tag-resident" "${layout[@]}" --num-rollout "$ROLLOUTS" --metrics-file "$WORK/$tag-resident.jsonl"; then
      compare "$tag vs TP1 (bf16)" "$WORK/$tag-tp1.jsonl" "$WORK/$tag-resident.jsonl" "$TOLERANCE" || failed=$((failed + 1))
    fi
    if run "$tag-streamed" "${layout[@]}" "${stream[@]}" --num-rollout "$ROLLOUTS" --metrics-file "$WORK/$tag-streamed.jsonl"; then
      compare "$tag streamed vs resident" "$WORK/$tag-resident.jsonl" "$WORK/$tag-streamed.jsonl" 0 || failed=$((failed + 1))
    fi
    rm -rf "$WORK/ckpt-$tag"
    if run "$tag-save" "${layout[@]}" "${stream[@]}" --num-rollout 2 --save "$WORK/ckpt-$tag" \
         --metrics-file "$WORK/$tag-save.jsonl" &&
       run "$tag-resume" "${layout[@]}" "${stream[@]}" --num-rollout "$ROLLOUTS" --load "$WORK/ckpt-$tag" \
         --metrics-file "$WORK/$tag-resume.jsonl"; then
      compare "$tag resume vs uninterrupted" "$WORK/$tag-streamed.jsonl" "$WORK/$tag-resume.jsonl" 0 2 || failed=$((failed + 1))
    fi
    rm -rf "$WORK/ckpt-$tag"
  done
done
echo "validate_parallel.sh: $failed check(s) failed"
exit "$failed"
