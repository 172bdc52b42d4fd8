"""Apply versions to a plain torch / transformers model in place, pausing generation while doing so.

    adapter = ModuleAdapter(model)
    RolloutAgent(adapter.load, endpoint).start()
    with adapter.serving():              # generation holds this; a version waits for it, then blocks new ones
        out = model.generate(...)

A version is checked against the model (names, dtypes, shapes) before anything is copied, so a mismatch
leaves the model untouched; the copy itself runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

from ckpt_engine.errors import LayoutMismatchError
from ckpt_engine.receiver import VersionPayload
from ckpt_engine.tensors import NameMap, persistent_buffers, strip_wrapper_prefixes


class ModuleAdapter:
    def __init__(self, module: nn.Module, *, name_map: NameMap | None = None, strict: bool = True) -> None:
        rename = name_map or strip_wrapper_prefixes
        self.module = module
        self.strict = strict
        self.targets: dict[str, torch.Tensor] = {
            rename(name): tensor for name, tensor in
            list(module.named_parameters(remove_duplicate=False)) + persistent_buffers(module)
        }
        self.version: int | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def serving(self) -> Iterator[int | None]:
        """Hold while generating; yields the version the model holds during the block."""
        with self._lock:
            yield self.version

    def load(self, payload: VersionPayload) -> None:
        """LoadFn for the receiver: check everything, then copy in place with generation paused."""
        self._check(payload.tensors, payload.sparse)
        with self._lock, torch.no_grad():
            for name, target in self.targets.items():
                source = payload.tensors.get(name)
                if source is not None:
                    target.copy_(source)
            self.version = payload.version

    def _check(self, tensors: dict[str, torch.Tensor], sparse: bool = False) -> None:
        missing = [name for name in self.targets if name not in tensors]
        if missing and self.strict and not sparse:  # a sparse version carries only what changed
            raise LayoutMismatchError(f"version lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}")
        for name, target in self.targets.items():
            source = tensors.get(name)
            if source is not None and (source.shape != target.shape or source.dtype != target.dtype):
                raise LayoutMismatchError(f"{name}: version has {source.dtype}{tuple(source.shape)}, model has "
                                          f"{target.dtype}{tuple(target.shape)}")
