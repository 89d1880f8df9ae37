#!/usr/bin/env bash
# The same pipeline on one node of 8 devices (4 trainer + 4 rollout) with Qwen3-VL-4B-Instruct; try it here first.
#   run_single_node.sh [--dry-run] [HYDRA_OVERRIDE...]   (environment as in run.sh; DEVICES_PER_NODE defaults to 8)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export RECIPE=${RECIPE:-geo3k_qwen3vl_4b_single_node}
export DEVICES_PER_NODE=${DEVICES_PER_NODE:-8}
export TRAIN_DEVICES=${TRAIN_DEVICES:-4}
export ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-4}
exec "$HERE/run.sh" "$@"
