#!/usr/bin/env bash
# Launch example: the daemon, then an FSDP trainer under torchrun whose every rank runs a TrainerAgent (each
# owns and sends a share of every version; rank 0 also talks to the daemon), then
# rollout workers with a RolloutAgent each. Replace train.py / rollout.py with your programs; the agents
# need only the ZMQ endpoint, and the trainer token (CKPT_ENGINE_TOKEN) when the credentials file the daemon
# wrote is not readable here (another host or user).
set -euo pipefail
CONFIG="${CONFIG:-deploy/engine.yaml}"
ckpt-engine serve --config "$CONFIG" &
DAEMON=$!
trap 'kill -TERM $DAEMON; wait $DAEMON' EXIT
until curl -sf http://127.0.0.1:8765/health >/dev/null; do sleep 0.2; done
export CKPT_ENGINE_AGENT_ENDPOINT=tcp://127.0.0.1:8766
for i in 0 1; do python rollout.py --agent-endpoint "$CKPT_ENGINE_AGENT_ENDPOINT" & done
torchrun --nproc-per-node=2 train.py --agent-endpoint "$CKPT_ENGINE_AGENT_ENDPOINT"
