"""The verl adapter. Importing this package imports verl and registers the ``ckpt_engine`` checkpoint-engine
backend (backend.py); sync.py and stream.py hold the logic and import no verl."""

from .backend import CkptEngineCheckpointEngine

__all__ = ["CkptEngineCheckpointEngine"]
