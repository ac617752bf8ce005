#!/usr/bin/env bash
# The megatron backend through `miles train` on one GPU, with random-init models of real architectures:
#   train   a ~1.06B Llama and an 8-expert Qwen3-MoE, colocated with the rollout engine, optimizer state
#           streamed through disk, trainer offloaded to disk: 5 rollouts, a save, then a --load resume
#           (the Llama run is also the "disk + streaming" arm of the sleep/wake comparison)
#   sleep   the same Llama with trainer offload to cpu and to disk, optimizer state resident, 3 rollouts
#   drain   the 8-expert MoE, streamed with a host tier (HOST_CACHE_MB, default 600), 3 rollouts each: the
#           store's disk writes left to land during generation (default) vs waited for at every sleep
#           (--stream-optimizer-state-flush-at-sleep); prints each rollout's exposed optimizer I/O
#   resume  the same MoE with a host tier that holds its whole state: 2 rollouts, a save, then a --load
#           resume of 2 more; the load reads the tier back from disk during the first resumed rollout
#   big     the 9.2B Llama (llama-9.2b), streamed with --stream-optimizer-state-host-cache-mb auto (RAM first,
#           files for the rest): 3 rollouts with fp32 moments (110 GB of state), 3 with bf16 moments (73 GB);
#           with BIG_SAVE=<dir> (a checkpoint of the fp32 run is ~128 GB) also a save and a --load resume of one more;
#           then 2 rollouts with a host tier smaller than the state (BIG_SPLIT_MB MiB, default 92160: ~13 GB in files)
#   big-baselines  the same shape in `miles bench megatron`: resident Adam and Megatron's CPU offload, one step
# Usage: scripts/validate_megatron.sh train [PRESET...] | sleep | drain | resume | big | big-baselines
#   WORK=<dir with ~40 GB free> (default /tmp/miles-megatron); SLEEP_ROLLOUTS (default 3);
#   RESUME_TO: the rollout count the resumed run trains to (default 7: two more)
set -euo pipefail
phase=${1:?usage: $0 train [PRESET...] | sleep | drain | resume}
shift
WORK=${WORK:-/tmp/miles-megatron}
mkdir -p "$WORK"
common=(--train-backend megatron --colocate --rollout-batch-size 8 --n-samples-per-prompt 4
        --rollout-max-response-len 16)

model() {  # model <preset>: a random-init HF folder, written once
  [ -d "$WORK/$1" ] || python scripts/make_random_model.py "$1" "$WORK/$1"
}

summary() {  # summary <metrics.jsonl>: one line per rollout
  python - "$1" <<'PY'
import json, sys
keys = ("rollout_id", "reward_mean", "loss", "optimizer_step_seconds", "sleep_seconds", "wake_seconds",
        "offload_bytes", "device_used_gb_asleep", "stream_read_gb", "stream_written_gb", "step_seconds",
        "stream_exposed_io_seconds", "stream_sleep_wait_seconds", "stream_exposed_io_per_rollout_seconds",
        "stream_disk_read_gb", "stream_disk_written_gb", "stream_tier_fill_gb", "stream_ram_state_gb",
        "stream_disk_state_gb", "optimizer_step_device_peak_gb", "host_rss_peak_gb")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys if k in r})
PY
}

case "$phase" in
train)
  presets=("$@")
  [ ${#presets[@]} -gt 0 ] || presets=(llama-1b qwen3-moe-8e)
  for m in "${presets[@]}"; do
    model "$m"
    stream=("${common[@]}" --hf-checkpoint "$WORK/$m" --stream-optimizer-state-to-disk --offload-train-target=disk
            --offload-train-disk-dir "$WORK/disk-$m")
    miles train "${stream[@]}" --num-rollout 5 --save "$WORK/ckpt-$m" --metrics-file "$WORK/$m.jsonl"
    summary "$WORK/$m.jsonl"
    miles train "${stream[@]}" --num-rollout "${RESUME_TO:-7}" --load "$WORK/ckpt-$m" --metrics-file "$WORK/$m-resume.jsonl"
    summary "$WORK/$m-resume.jsonl"
    ls -A "$WORK/disk-$m" 2>/dev/null | sed 's/^/left under the disk root: /' || true
    rm -rf "$WORK/ckpt-$m"
  done
  ;;
sleep)
  model llama-1b
  for target in cpu disk; do
    miles train "${common[@]}" --hf-checkpoint "$WORK/llama-1b" --offload-train-target=$target \
      --offload-train-disk-dir "$WORK/disk-sleep-$target" --num-rollout "${SLEEP_ROLLOUTS:-3}" --metrics-file "$WORK/sleep-$target.jsonl"
    summary "$WORK/sleep-$target.jsonl"
  done
  ;;
drain)
  model qwen3-moe-8e
  for arm in drain flush; do
    extra=(); [ "$arm" = flush ] && extra=(--stream-optimizer-state-flush-at-sleep)
    miles train "${common[@]}" --hf-checkpoint "$WORK/qwen3-moe-8e" --stream-optimizer-state-to-disk \
      --offload-train-target=disk --offload-train-disk-dir "$WORK/disk-$arm" \
      --stream-optimizer-state-host-cache-mb "${HOST_CACHE_MB:-600}" --num-rollout 3 \
      --metrics-file "$WORK/$arm.jsonl" "${extra[@]}"
    summary "$WORK/$arm.jsonl"
  done
  ;;
resume)
  model qwen3-moe-8e
  tier=(--hf-checkpoint "$WORK/qwen3-moe-8e" --stream-optimizer-state-to-disk --offload-train-target=disk
        --offload-train-disk-dir "$WORK/disk-resume" --stream-optimizer-state-host-cache-mb 4096)
  miles train "${common[@]}" "${tier[@]}" --num-rollout 2 --save "$WORK/ckpt-resume" --metrics-file "$WORK/resume-a.jsonl"
  summary "$WORK/resume-a.jsonl"
  miles train "${common[@]}" "${tier[@]}" --num-rollout 4 --load "$WORK/ckpt-resume" --metrics-file "$WORK/resume-b.jsonl"
  summary "$WORK/resume-b.jsonl"
  rm -rf "$WORK/ckpt-resume"
  ;;
big)
  model llama-9.2b
  base=("${common[@]}" --hf-checkpoint "$WORK/llama-9.2b" --stream-optimizer-state-to-disk --offload-train-target=disk)
  big=("${base[@]}" --stream-optimizer-state-host-cache-mb auto --offload-train-disk-dir "$WORK/disk-big")
  if [ -n "${BIG_SAVE:-}" ]; then
    miles train "${big[@]}" --num-rollout 3 --save "$BIG_SAVE" --metrics-file "$WORK/big-fp32.jsonl"
    summary "$WORK/big-fp32.jsonl"
    miles train "${big[@]}" --num-rollout 4 --load "$BIG_SAVE" --metrics-file "$WORK/big-fp32-resume.jsonl"
    summary "$WORK/big-fp32-resume.jsonl"
  else
    miles train "${big[@]}" --num-rollout 3 --metrics-file "$WORK/big-fp32.jsonl"
    summary "$WORK/big-fp32.jsonl"
  fi
  miles train "${big[@]}" --stream-optimizer-state-moment-dtype bf16 --num-rollout 3 --metrics-file "$WORK/big-bf16.jsonl"
  summary "$WORK/big-bf16.jsonl"
  # a host tier smaller than the state (BIG_SPLIT_MB, default 90 GiB): RAM for most buckets, files for the rest
  miles train "${base[@]}" --stream-optimizer-state-host-cache-mb "${BIG_SPLIT_MB:-92160}" \
    --offload-train-disk-dir "$WORK/disk-split" --num-rollout 2 --metrics-file "$WORK/big-split.jsonl"
  summary "$WORK/big-split.jsonl"
  ;;
big-baselines)
  # llama-9.2b's shape (vocabulary: the char tokenizer's ~100 tokens, as make_random_model.py builds it)
  miles bench megatron --hidden 4096 --layers 42 --ffn 14336 --heads 32 --query-groups 8 --vocab 128 \
    --arms resident,cpu-offload --steps 1 --warmup 0 --dir "$WORK/bench-big" --arm-timeout 600 --json "$WORK/big-baselines.json"
  ;;
*) echo "unknown phase $phase (train|sleep|drain|resume|big|big-baselines)" >&2; exit 2 ;;
esac
