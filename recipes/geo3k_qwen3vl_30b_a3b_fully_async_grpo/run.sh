#!/usr/bin/env bash
# Fully asynchronous GRPO of Qwen3-VL-30B-A3B-Instruct on geo3k: 32 trainer + 32 rollout devices (FSDP2, Ulysses SP 8,
# vLLM async rollout TP 2 / EP 2). Run on the Ray head node of a started cluster (README.md).
#
#   run.sh [--dry-run] [HYDRA_OVERRIDE...]
#     --dry-run  print the fully composed config (installed verl + this recipe + overrides) as YAML and exit;
#                starts nothing.
#
# Environment (defaults in brackets):
#   DEVICE             npu (Ascend 910B/A3, 16 per node) or gpu (NVIDIA, 8 per node)        [npu]
#   DEVICES_PER_NODE   devices on each node                                                  [16 npu, 8 gpu]
#   TRAIN_DEVICES      trainer devices; ROLLOUT_DEVICES: rollout devices                     [32, 32]
#   MODEL_PATH         model (a hub name or a local path)                                    [recipe's]
#   DATA_DIR           folder with train.parquet and test.parquet (prepare_geo3k.py)         [~/data/geo3k]
#   CKPTS_DIR          checkpoints                                                           [~/ckpts/RECIPE]
#   RECIPE             config in recipe/                                                     [geo3k_qwen3vl_30b_a3b]
#   PYTHON             interpreter with verl and verl-qwen3vl-plugin                         [python3]
#   ROUTING_REPLAY     off, R3 (replay the rollout's routes) or R2 (the old-log-prob pass's)  [off]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
RECIPE=${RECIPE:-geo3k_qwen3vl_30b_a3b}
DEVICE=${DEVICE:-npu}
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi

die() { echo "run.sh: $*" >&2; exit 2; }

case "$DEVICE" in
    npu) DEVICES_PER_NODE=${DEVICES_PER_NODE:-16}; TRAINER_DEVICE=npu ;;
    gpu) DEVICES_PER_NODE=${DEVICES_PER_NODE:-8}; TRAINER_DEVICE=cuda ;;
    *) die "DEVICE must be npu or gpu, got '$DEVICE'" ;;
esac
TRAIN_DEVICES=${TRAIN_DEVICES:-32}
ROLLOUT_DEVICES=${ROLLOUT_DEVICES:-32}
DATA_DIR=${DATA_DIR:-$HOME/data/geo3k}
CKPTS_DIR=${CKPTS_DIR:-$HOME/ckpts/$RECIPE}

# Sets ${ROLE}_NODES and ${ROLE}_PER_NODE for a role using $2 devices: whole nodes, or part of one node.
layout() {
    local role=$1 devices=$2
    [[ "$devices" =~ ^[1-9][0-9]*$ ]] || die "device counts must be positive integers, got '$devices'"
    [[ "$DEVICES_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "DEVICES_PER_NODE must be a positive integer"
    if (( devices <= DEVICES_PER_NODE )); then
        printf -v "${role}_NODES" 1; printf -v "${role}_PER_NODE" %s "$devices"
    elif (( devices % DEVICES_PER_NODE == 0 )); then
        printf -v "${role}_NODES" %s "$(( devices / DEVICES_PER_NODE ))"; printf -v "${role}_PER_NODE" %s "$DEVICES_PER_NODE"
    else
        die "$devices devices is not a whole number of $DEVICES_PER_NODE-device nodes"
    fi
}
layout TRAIN "$TRAIN_DEVICES"
layout ROLLOUT "$ROLLOUT_DEVICES"

# The plugin activates itself in every process that imports verl (its start-up hook on verl < 0.9, verl's entry
# points on >= 0.9), Ray workers on every node included: nothing to export here.
"$PYTHON" -c "import verl_qwen3vl_plugin" 2>/dev/null || die "verl-qwen3vl-plugin is not installed for $PYTHON"

ARGS=(
    "+recipe=$RECIPE"
    "data.train_files=$DATA_DIR/train.parquet"
    "data.val_files=$DATA_DIR/test.parquet"
    "trainer.default_local_dir=$CKPTS_DIR"
    "trainer.device=$TRAINER_DEVICE"  # verl 0.7.1's fully async main does not pick the device itself
    "trainer.nnodes=$TRAIN_NODES"
    "trainer.n_gpus_per_node=$TRAIN_PER_NODE"
    "rollout.nnodes=$ROLLOUT_NODES"
    "rollout.n_gpus_per_node=$ROLLOUT_PER_NODE"
)
[[ -n "${MODEL_PATH:-}" ]] && ARGS+=("actor_rollout_ref.model.path=$MODEL_PATH")
if [[ "${ROUTING_REPLAY:-off}" != off ]]; then  # verl's own switch, on the path this verl trains FSDP through
    mapfile -t REPLAY < <("$PYTHON" "$HERE/compose.py" --routing-replay "$ROUTING_REPLAY")
    (( ${#REPLAY[@]} )) || die "ROUTING_REPLAY must be off, R2 or R3, got '$ROUTING_REPLAY'"
    ARGS+=("${REPLAY[@]}")
fi

if (( DRY_RUN )); then
    exec "$PYTHON" "$HERE/compose.py" "${ARGS[@]}" "$@"
fi

"$PYTHON" -c "import verl.experimental.fully_async_policy.fully_async_main" 2>/dev/null || die \
    "this verl has no verl.experimental.fully_async_policy.fully_async_main (the PyPI wheel of verl 0.7.1 ships only" \
    "its config): install verl from a source checkout of the same tag (pip install -e .)"
mapfile -t PRIMARY < <("$PYTHON" "$HERE/compose.py" --hydra-args)
exec "$PYTHON" -m verl.experimental.fully_async_policy.fully_async_main "${PRIMARY[@]}" "${ARGS[@]}" "$@"
