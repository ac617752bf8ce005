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
#   arch    GLM-5's and Qwen3.5's architectures (glm5-2b, qwen3.5-moe-1b; or the presets given), each: 3 rollouts
#           streamed with a save, a --load resume of it to rollout 4, and 4 rollouts resident (no store; trainer
#           offload to cpu); prints
#           loss, reward and the engine-vs-trainer log-prob |diff| per rollout, and checks the streamed losses equal
#           the resident ones and the resumed rollout's loss the resident run's 4th (exit 1 on a mismatch).
#           All with --deterministic-mode (their routers pick 4 and 8 experts). HOST_CACHE_MB (e.g. auto) gives
#           the streamed runs a host tier, PLAN (auto) their trainer sleep plan. Each run's folders are removed after it,
#           the model folder after its preset; glm5-2b's peak is its 22 GB of streamed state + 4 GB trainer
#           offload + the 4 GB model folder, plus a 26 GB checkpoint under ARCH_SAVE (default:
#           /dev/shm/miles-arch when /dev/shm has 50 GB free, else $WORK)
# Usage: scripts/validate_megatron.sh train [PRESET...] | sleep | drain | resume | big | big-baselines | arch [PRESET...]
#   WORK=<dir with ~40 GB free> (default /tmp/miles-megatron); SLEEP_ROLLOUTS (default 3);
#   RESUME_TO: the rollout count the resumed run trains to (default 7: two more)
set -euo pipefail
phase=${1:?usage: $0 train [PRESET...] | sleep | drain | resume | big | big-baselines | arch [PRESET...]}
shift
WORK=${WORK:-/tmp/miles-megatron}
mkdir -p "$WORK"
common=(--train-backend megatron --colocate --rollout-batch-size 8 --n-samples-per-prompt 4
        --rollout-max-response-len 16)

model() {  # model <preset>: a random-init HF folder, written once
  [ -d "$WORK/$1" ] || python "$(dirname "$0")/make_random_model.py" "$1" "$WORK/$1"
}

summary() {  # summary <metrics.jsonl>: one line per rollout
  python - "$1" <<'PY'
import json, sys
keys = ("rollout_id", "reward_mean", "loss", "optimizer_step_seconds", "sleep_seconds", "wake_seconds",
        "offload_bytes", "device_used_gb_asleep", "stream_read_gb", "stream_written_gb", "step_seconds",
        "stream_exposed_io_seconds", "stream_sleep_wait_seconds", "stream_exposed_io_per_rollout_seconds",
        "stream_disk_read_gb", "stream_disk_written_gb", "stream_tier_fill_gb", "stream_ram_state_gb",
        "stream_disk_state_gb", "optimizer_step_device_peak_gb", "host_rss_peak_gb", "grad_norm",
        "train_rollout_logprob_abs_diff")
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
arch)
  presets=("$@")
  [ ${#presets[@]} -gt 0 ] || presets=(glm5-2b qwen3.5-moe-1b)
  shm_free_gb=$(df -P -BG /dev/shm 2>/dev/null | awk 'NR == 2 {print $4 + 0}')
  if [ -n "${ARCH_SAVE:-}" ]; then save_root=$ARCH_SAVE
  elif [ "${shm_free_gb:-0}" -ge 50 ]; then save_root=/dev/shm/miles-arch  # 26 GB, and room left for Ray
  else save_root=$WORK; fi
  mkdir -p "$save_root"; echo "arch: checkpoints under $save_root"
  failed=0
  for m in "${presets[@]}"; do
    model "$m"
    # top-4 / top-8 MoE: megatron's expert sum is bit-reproducible across runs only in deterministic mode
    base=("${common[@]}" --hf-checkpoint "$WORK/$m" --offload-train-target=disk --deterministic-mode)
    stream=("${base[@]}" --stream-optimizer-state-to-disk)
    [ -z "${HOST_CACHE_MB:-}" ] || stream+=(--stream-optimizer-state-host-cache-mb "$HOST_CACHE_MB")
    [ -z "${PLAN:-}" ] || stream+=(--offload-train-plan "$PLAN")
    run() {  # run <arm> <flags...>: one miles train into $WORK/arch-<model>-<arm>.jsonl, its folders removed after
      local arm=$1; shift
      miles train "$@" --offload-train-disk-dir "$WORK/disk-arch-$arm" --metrics-file "$WORK/arch-$m-$arm.jsonl"
      rm -rf "$WORK/disk-arch-$arm"
      echo "== $m $arm"; summary "$WORK/arch-$m-$arm.jsonl"
    }
    run streamed "${stream[@]}" --num-rollout 3 --save "$save_root/ckpt-$m"
    run resumed "${stream[@]}" --num-rollout 4 --load "$save_root/ckpt-$m"
    rm -rf "$save_root/ckpt-$m"
    # resident Adam state goes to pinned RAM at each sleep (26 GB for glm5-2b: to disk it takes ~30 s a rollout)
    run resident "${base[@]}" --offload-train-target=cpu --num-rollout 4
    [ -n "${KEEP_MODELS:-}" ] || rm -rf "${WORK:?}/$m"
    python - "$WORK/arch-$m" "$m" <<'PY' || failed=1
import json, sys
prefix, name = sys.argv[1], sys.argv[2]
loss = {arm: [json.loads(line)["loss"] for line in open(f"{prefix}-{arm}.jsonl")]
        for arm in ("streamed", "resumed", "resident")}
# streamed == resident at every rollout is the claim; the resumed rollout is checked against the resident 4th
checks = {"streamed == resident (3 losses, exact)": loss["streamed"] == loss["resident"][:3],
          "resumed rollout 4 == resident rollout 4 (exact)": loss["resumed"][-1:] == loss["resident"][3:]}
for what, ok in checks.items():
    print(f"{name}: {what}: {'OK' if ok else 'MISMATCH'}")
print(f"{name}: losses {json.dumps(loss)}")
sys.exit(0 if all(checks.values()) else 1)
PY
  done
  exit $failed
  ;;
*) echo "unknown phase $phase (train|sleep|drain|resume|big|big-baselines|arch)" >&2; exit 2 ;;
esac
