#!/usr/bin/env bash
# A GLM-5.2-744B-like MoE on 8 nodes of 4 GB300 GPUs (32 ranks: TP8 x PP4 x DP1, EP8): its Adam state
# (~279 GB per rank in fp32) does not fit next to the weights in 276.6 GB of HBM, so it has to stream
# through node-local disk, with the trainer's weights and grads on the same disk while the rollout runs.
#
# NOT RUNNABLE YET: the model needs tensor parallelism 8 and pipeline parallelism 4, and `miles train`'s
# megatron backend supports TP = PP = 1 only (it has --expert-model-parallel-size, no tensor or pipeline
# flags). Without them there is no layout to fall back to: even with EP32 (each rank its own experts) a
# rank holds 42B params, 254 GB of bf16 weights and fp32 grads, which with the activation reserve exceeds
# the 276.6 GB of HBM (`miles plan ... --ep 32`: does-not-fit, whatever the optimizer does). So this script
# prints the plan for the layout the model needs, then stops with a message instead of starting Ray or
# `miles train`.
#
# The plan (what fits, buckets, disk per node, step floor; add --from-bench with your disk's numbers):
#   python -m miles.sizing.cli --preset glm5-744b --nodes 8 --gpus-per-node 4 --tp 8 --pp 4 --ep 8 \
#       --hbm-gb 276.6 --host-ram-gb 960 --moment-dtype bf16
#
# Once TP and PP exist, the run is scripts/launch_qwen3_30b_a3b.sh's with NUM_NODES=8 GPUS_PER_NODE=4,
# --hf-checkpoint of this model, --rollout-batch-size 64, --rollout-max-response-len 8192 and the
# parallel flags TP8 / PP4 / EP8 (expert tensor parallel 1, expert-DP 1); node-local disk per node:
# 1.42 TB with bf16 moments (0.81 streamed state + 0.61 trainer offload; 2.23 TB with the checkpoint
# copy the plan counts, 0 when checkpoints go to shared storage).
set -euo pipefail

NUM_NODES=${NUM_NODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
TP=${TP:-8}
PP=${PP:-4}
EP=${EP:-8}
MOMENT_DTYPE=${MOMENT_DTYPE:-bf16}                         # bf16: 8 B/param streamed instead of 12

miles plan --preset glm5-744b --nodes "$NUM_NODES" --gpus-per-node "$GPUS_PER_NODE" --tp "$TP" --pp "$PP" \
  --ep "$EP" --hbm-gb 276.6 --host-ram-gb 960 --moment-dtype "$MOMENT_DTYPE"

echo "launch_glm5_744b.sh: not starting: this model needs TP$TP x PP$PP, and miles train's megatron backend" \
     "supports tensor and pipeline parallel size 1 only (see the plan above for the layout it needs)" >&2
exit 3
