#!/usr/bin/env bash
# Run a training command again after a failure (a rank killed, a node lost), at most
# MAX_RESTARTS times. Each attempt is a fresh `accelerate launch`, and the training
# script's `--resume_from_checkpoint latest` continues from the newest complete checkpoint
# (or starts from scratch on the first attempt), so one command line serves every attempt.
#
#   scripts/restart_on_failure.sh 3 accelerate launch --config_file accelerate_configs/cpu_2proc.yaml \
#       scripts/train_mnist.py --cpu --checkpointing_steps 100 --resume_from_checkpoint latest
#
# Why not `accelerate launch --max_restarts N`? torchrun restarts the workers inside the
# same launcher; after a rank was SIGKILLed during training, the restarted gloo workers
# failed to connect here in 10 of 10 tries (torch 2.15, CPU, --rdzv_backend c10d:
# "Gloo connectFullMesh failed ... Connection refused" or a hang in init_process_group).
# A fresh launcher has no such state.
set -u

if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
    echo "usage: $0 MAX_RESTARTS COMMAND [ARGS...]" >&2
    exit 2
fi
max_restarts=$1
shift

status=0
for ((attempt = 1; attempt <= max_restarts + 1; attempt++)); do
    "$@"
    status=$?
    [ "$status" -eq 0 ] && exit 0
    echo "restart_on_failure: attempt $attempt of $((max_restarts + 1)) exited with status $status" >&2
done
echo "restart_on_failure: giving up after $((max_restarts + 1)) attempts" >&2
exit "$status"
