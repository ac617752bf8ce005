#!/usr/bin/env bash
# A GLM-5.2-744B-like MoE on 8 nodes of 4 GB300 GPUs (32 ranks: TP8 x PP4 x DP1, EP8 x ETP1): its Adam state
# (~279 GB per rank in fp32) does not fit next to the weights in 276.6 GB of HBM, so it streams through
# node-local disk, with the trainer's weights and grads on the same disk while the rollout runs.
# 78 decoder layers over 4 stages: Megatron's uneven stages, 22 on the first (its 3 dense layers are light),
# 18 on the last (it carries the MTP layer and the output layer), 19 on each of the others.
#
# Size it first (what fits, buckets, disk per node, step floor; add --from-bench with your disk's numbers):
#   python -m miles.sizing.cli --preset glm5-744b --nodes 8 --gpus-per-node 4 --tp 8 --pp 4 --ep 8 \
#       --decoder-first-pipeline-num-layers 22 --decoder-last-pipeline-num-layers 18 \
#       --hbm-gb 276.6 --host-ram-gb 960 --moment-dtype bf16
#
# Check a node before the run (every node: the flags, the layout against the model, this node's disk and
# memory; nothing starts):   NODE_RANK=3 HEAD_ADDR=10.0.0.1 bash scripts/launch_glm5_744b.sh --dry-run
# Run it on every node, the head node first:
#   NODE_RANK=0 HEAD_ADDR=10.0.0.1 bash scripts/launch_glm5_744b.sh   # head: starts Ray, trains
#   NODE_RANK=1 HEAD_ADDR=10.0.0.1 bash scripts/launch_glm5_744b.sh   # others: join Ray, wait
# Rollouts: the embedded engine (the default) holds the whole model on one GPU, which 744B does not fit. Start one
# sglang server per node, `--tp-size $GPUS_PER_NODE` on that node's GPUs in order (its rank i on GPU i), and name
# them in node order: SGLANG_URLS="http://node0:30000 http://node1:30000 ..." (docs/advanced/sglang.md): each
# server's rank i then takes the weights from the train rank on its GPU.
# EXPERIMENTAL: `miles train` refuses this layout (exit 2, naming the flags) unless
# EXTRA_ARGS=--experimental-model-parallel, and so does this script's check on every node, before Ray starts: its
# TP/PP > 1 training is checked with its ranks sharing one GPU (docs/dev/validation/parallel.md), not yet across GPUs.
# The megatron backend builds GLM-5's layers (MLA, the sparse attention's indexer, MoE).
# Node-local disk per node with bf16 moments (the plan above): 0.78 TB streamed state + 0.19 TB trainer
# offload, + 0.78 TB when checkpoints go to the same disk.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; fi
NUM_NODES=${NUM_NODES:-8}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
HEAD_ADDR=${HEAD_ADDR:-127.0.0.1}
RAY_PORT=${RAY_PORT:-6379}
MODEL_DIR=${MODEL_DIR:-/models/GLM-5.2}                   # a Hugging Face checkpoint folder
PROMPT_DATA=${PROMPT_DATA:-/data/prompts.jsonl}
DISK_DIR=${DISK_DIR:-/local_nvme/miles}                    # node-local disk: streamed state + trainer offload
SAVE_DIR=${SAVE_DIR:-/shared/checkpoints/glm5-744b}      # shared storage, seen by every node
TP=${TP:-8}
PP=${PP:-4}
EP=${EP:-8}
ETP=${ETP:-1}
FIRST_STAGE_LAYERS=${FIRST_STAGE_LAYERS:-22}
LAST_STAGE_LAYERS=${LAST_STAGE_LAYERS:-18}
MOMENT_DTYPE=${MOMENT_DTYPE:-bf16}                         # bf16: 8 B/param streamed instead of 12
SGLANG_URLS=${SGLANG_URLS:-}                               # one sglang server per node (above); empty: embedded
EXTRA_ARGS=${EXTRA_ARGS:-}                                 # more `miles train` flags
export RAY_USAGE_STATS_ENABLED=0

TRAIN_ARGS=(
  --train-backend megatron
  --hf-checkpoint "$MODEL_DIR"
  --model-dtype bf16
  --num-train-ranks $((NUM_NODES * GPUS_PER_NODE))
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --decoder-first-pipeline-num-layers "$FIRST_STAGE_LAYERS"
  --decoder-last-pipeline-num-layers "$LAST_STAGE_LAYERS"
  --expert-model-parallel-size "$EP"
  --expert-tensor-parallel-size "$ETP"
  --sequence-parallel
  --num-rollout-engines "$NUM_NODES"
  --colocate
  --prompt-data "$PROMPT_DATA"
  --num-rollout 100
  --rollout-batch-size 64
  --n-samples-per-prompt 8
  --rollout-max-response-len 8192
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
if [[ -n "$SGLANG_URLS" ]]; then
  TRAIN_ARGS+=(--rollout-engine sglang --sglang-tp-size "$GPUS_PER_NODE")
  for url in $SGLANG_URLS; do TRAIN_ARGS+=(--sglang-url "$url"); done
fi
if [[ -n "$EXTRA_ARGS" ]]; then read -r -a extra <<< "$EXTRA_ARGS"; TRAIN_ARGS+=("${extra[@]}"); fi

miles plan --preset glm5-744b --nodes "$NUM_NODES" --gpus-per-node "$GPUS_PER_NODE" --tp "$TP" --pp "$PP" \
  --ep "$EP" --decoder-first-pipeline-num-layers "$FIRST_STAGE_LAYERS" \
  --decoder-last-pipeline-num-layers "$LAST_STAGE_LAYERS" --hbm-gb 276.6 --host-ram-gb 960 \
  --moment-dtype "$MOMENT_DTYPE"

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
