"""Agents that run the library inside other processes (installed as ``ckpt_engine.workers``):
the trainer agent in each FSDP rank and the rollout agent with its engine adapters."""
