#!/usr/bin/env bash
# A GLM-5.2-744B-like MoE on 8 nodes of 4 GB300 GPUs (32 ranks: TP8 x PP4 x DP1, EP8): its Adam state
# (~279 GB per rank in fp32) does not fit next to the weights in 276.6 GB of HBM, so it streams through
# node-local disk, and the trainer's weights and grads go to the same disk while the rollout runs.
#
# Size it first (what fits, buckets, disk per node, step floor; add --from-bench with your disk's numbers):
#   python -m miles.sizing.cli --preset glm5-744b --nodes 8 --gpus-per-node 4 --tp 8 --pp 4 --ep 8 \
#       --hbm-gb 276.6 --moment-dtype bf16
#
# Run this script on every node, the head node first:
#   NODE_RANK=0 HEAD_ADDR=10.0.0.1 bash scripts/launch_glm5_744b.sh   # head: starts Ray, trains
#   NODE_RANK=3 HEAD_ADDR=10.0.0.1 bash scripts/launch_glm5_744b.sh   # others: join Ray, wait
# `miles train` connects to the cluster through RAY_ADDRESS.
set -euo pipefail

NUM_NODES=${NUM_NODES:-8}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
HEAD_ADDR=${HEAD_ADDR:?set HEAD_ADDR to the head node address}
RAY_PORT=${RAY_PORT:-6379}
MODEL_DIR=${MODEL_DIR:-/models/GLM-5.2}                    # a Hugging Face checkpoint folder
PROMPT_DATA=${PROMPT_DATA:-/data/prompts.jsonl}
DISK_DIR=${DISK_DIR:-/local_nvme/miles}                    # node-local disk: ~1.2 TB of state per node (fp32)
SAVE_DIR=${SAVE_DIR:-/shared/checkpoints/glm5-744b}       # shared storage, seen by every node
MOMENT_DTYPE=${MOMENT_DTYPE:-bf16}                         # bf16: 8 B/param streamed instead of 12
EP=${EP:-8}
export RAY_USAGE_STATS_ENABLED=0

if [[ "$NODE_RANK" != 0 ]]; then
  ray start --address "$HEAD_ADDR:$RAY_PORT" --num-gpus "$GPUS_PER_NODE" --block
  exit 0
fi
ray start --head --node-ip-address "$HEAD_ADDR" --port "$RAY_PORT" --num-gpus "$GPUS_PER_NODE"
export RAY_ADDRESS="$HEAD_ADDR:$RAY_PORT"
until [[ $(python -c 'import ray; ray.init(); print(sum(n["Alive"] for n in ray.nodes()))' 2>/dev/null) == "$NUM_NODES" ]]; do
  echo "waiting for $NUM_NODES Ray nodes ..."; sleep 5
done

# Parallelism: TP8 x PP4 x DP1 with experts split 8 ways (expert tensor parallel 1, expert-DP 1).
# NOT YET ACCEPTED by `miles train`: --expert-model-parallel-size arrives with the megatron backend's
# parallelism flags (tensor and pipeline sizes will be added here then); until then this launcher
# documents the intended layout and `miles train` refuses the flag.
PARALLEL_ARGS=(
  --expert-model-parallel-size "$EP"
)

miles train \
  --train-backend megatron \
  --hf-checkpoint "$MODEL_DIR" \
  --model-dtype bf16 \
  --num-train-ranks $((NUM_NODES * GPUS_PER_NODE)) \
  --num-rollout-engines "$NUM_NODES" \
  --rollout-engine sglang \
  --colocate \
  --prompt-data "$PROMPT_DATA" \
  --num-rollout 100 \
  --rollout-batch-size 64 \
  --n-samples-per-prompt 8 \
  --rollout-max-response-len 8192 \
  --micro-batch-size 1 \
  --optimizer adam \
  --lr 1e-6 \
  --stream-optimizer-state-to-disk \
  --stream-optimizer-state-moment-dtype "$MOMENT_DTYPE" \
  --offload-train-target=disk \
  --offload-train-disk-dir "$DISK_DIR" \
  --save "$SAVE_DIR" \
  --save-interval 20 \
  "${PARALLEL_ARGS[@]}"
