#!/usr/bin/env bash
# Qwen3-30B-A3B RL on one or more nodes of 8 GPUs: Megatron backend, colocated rollout, Adam state streamed
# through node-local disk, and the trainer's weights and grads offloaded to the same disk during rollouts.
#
# Size it first (what fits, buckets, disk per node, step floor):
#   python -m miles.sizing.cli --preset qwen3-30b-a3b --nodes 1 --gpus-per-node 8 --ep 8 --moment-dtype bf16
#
# Check a node before the run (every node: the flags, the layout against the model, this node's disk and
# memory; nothing starts):   NODE_RANK=1 HEAD_ADDR=10.0.0.1 NUM_NODES=2 bash scripts/launch_qwen3_30b_a3b.sh --dry-run
# Run this script on every node, the head node first:
#   NODE_RANK=0 HEAD_ADDR=10.0.0.1 NUM_NODES=2 bash scripts/launch_qwen3_30b_a3b.sh   # head: starts Ray, trains
#   NODE_RANK=1 HEAD_ADDR=10.0.0.1 NUM_NODES=2 bash scripts/launch_qwen3_30b_a3b.sh   # others: join Ray, wait
# A single node needs no variables beyond the paths. `miles train` connects to the cluster through RAY_ADDRESS,
# places the ranks of each node together (one rollout engine per node) and, before starting them, checks
# every node's free space under DISK_DIR against the plan.
# Rollout: the embedded engine (one engine per node, the whole model on one GPU: 30B in bf16 fits an H200);
# sglang servers are the other choice (--rollout-engine sglang --sglang-url, docs/advanced/sglang.md).
set -euo pipefail

NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
HEAD_ADDR=${HEAD_ADDR:-127.0.0.1}
RAY_PORT=${RAY_PORT:-6379}
MODEL_DIR=${MODEL_DIR:-/models/Qwen3-30B-A3B}            # a Hugging Face checkpoint folder
PROMPT_DATA=${PROMPT_DATA:-/data/prompts.jsonl}
DISK_DIR=${DISK_DIR:-/local_nvme/miles}                    # node-local disk: streamed state + trainer offload
SAVE_DIR=${SAVE_DIR:-/shared/checkpoints/qwen3-30b-a3b}   # shared storage, seen by every node
MOMENT_DTYPE=${MOMENT_DTYPE:-bf16}                         # fp32 is bit-exact; bf16 streams 8 B/param, not 12
EP=${EP:-8}                                                # data parallel over all GPUs, experts split EP ways
TP=${TP:-1}                                                # TP x PP > 1: EXTRA_ARGS=--experimental-model-parallel
PP=${PP:-1}
EXTRA_ARGS=${EXTRA_ARGS:-}                                 # more `miles train` flags
export RAY_USAGE_STATS_ENABLED=0

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; fi
TRAIN_ARGS=(
  --train-backend megatron
  --hf-checkpoint "$MODEL_DIR"
  --model-dtype bf16
  --num-train-ranks $((NUM_NODES * GPUS_PER_NODE))
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --expert-model-parallel-size "$EP"
  --num-rollout-engines "$NUM_NODES"
  --rollout-engine embedded
  --colocate
  --prompt-data "$PROMPT_DATA"
  --num-rollout 100
  --rollout-batch-size 32
  --n-samples-per-prompt 8
  --rollout-max-response-len 4096
  --micro-batch-size 1
  --optimizer adam
  --lr 1e-6
  --stream-optimizer-state-to-disk
  --stream-optimizer-state-moment-dtype "$MOMENT_DTYPE"
  --offload-train-target=disk
  --offload-train-disk-dir "$DISK_DIR"
  --save "$SAVE_DIR"
  --save-interval 20
)
if (( TP > 1 )); then TRAIN_ARGS+=(--sequence-parallel); fi  # Megatron trains MoE layers under TP only with it
if [[ -n "$EXTRA_ARGS" ]]; then read -r -a extra <<< "$EXTRA_ARGS"; TRAIN_ARGS+=("${extra[@]}"); fi

# Before Ray starts, on this node: the flags, the layout against the model, this node's disk and memory. Several
# nodes: RAY_ADDRESS (not yet reachable) makes validation judge this node's share of the ranks.
if [[ "$NUM_NODES" -gt 1 ]]; then export RAY_ADDRESS="$HEAD_ADDR:$RAY_PORT"; fi
miles train "${TRAIN_ARGS[@]}" --dry-run
unset RAY_ADDRESS
# Then what the run itself checks before it starts (a dry run leaves out what only a real start refuses), with
# its flags and its RAY_ADDRESS, so no node starts Ray for a run the head would refuse.
RAY_ADDRESS="$HEAD_ADDR:$RAY_PORT" python "$(dirname "${BASH_SOURCE[0]}")/check_start.py" "${TRAIN_ARGS[@]}"
if [[ "$DRY_RUN" == 1 ]]; then exit 0; fi

if [[ "$NODE_RANK" != 0 ]]; then
  ray start --address "$HEAD_ADDR:$RAY_PORT" --num-gpus "$GPUS_PER_NODE" --block
  exit 0
fi
ray start --head --node-ip-address "$HEAD_ADDR" --port "$RAY_PORT" --num-gpus "$GPUS_PER_NODE"
export RAY_ADDRESS="$HEAD_ADDR:$RAY_PORT"
until [[ $(python -c 'import ray; ray.init(); print(sum(n["Alive"] for n in ray.nodes()))' 2>/dev/null) == "$NUM_NODES" ]]; do
  echo "waiting for $NUM_NODES Ray nodes ..."; sleep 5
done

miles train "${TRAIN_ARGS[@]}"
