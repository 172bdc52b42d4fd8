"""The ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls :func:`register` in every one of its
processes. It must be cheap, must not import vLLM's engine modules, and may run several times."""

from __future__ import annotations

BACKEND = "ckpt_engine"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from ckpt_engine.workers.adapters.vllm.quiet import install

    install()  # vLLM's log lines every sync causes and that say nothing wrong (quiet.py)

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "ckpt_engine.workers.adapters.vllm.backend",
                                                    "CkptEngineWeightTransferEngine")
    except ValueError:  # registered already: plugins may load more than once in a process
        pass
