"""Apply versions to a plain torch / transformers model in place, pausing generation while doing so.

    adapter = ModuleAdapter(model)
    RolloutAgent(adapter.load, endpoint, streams=True).start()
    with adapter.serving():              # generation holds this; a version waits for it, then blocks new ones
        out = model.generate(...)

A version is checked against the model (names, dtypes, shapes, and no tensor the model does not have) before
anything is copied, so a mismatch refuses it and leaves the model untouched (ApplyRefused). If a copy fails
part way, the model holds no whole version: the adapter is torn, ``serving()`` waits for the repair the
daemon sends (and raises TornModelError if none comes in time), so generation never runs on a mix.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from ckpt_engine.errors import ApplyRefused, TornModelError
from ckpt_engine.plan.dtypes import dtype_name
from ckpt_engine.plan.tensors import NameMap, persistent_buffers, strip_wrapper_prefixes
from ckpt_engine.receive.collective import VersionPayload


class ModuleAdapter:
    def __init__(self, module: nn.Module, *, name_map: NameMap | None = None, strict: bool = True) -> None:
        """``strict``: a version must carry every tensor of the model (sparse versions excepted) and nothing
        else; with ``strict=False`` missing and extra tensors are allowed (extra ones are not applied)."""
        rename = name_map or strip_wrapper_prefixes
        self.module = module
        self.strict = strict
        self.targets: dict[str, torch.Tensor] = {
            rename(name): tensor for name, tensor in
            list(module.named_parameters(remove_duplicate=False)) + persistent_buffers(module)
        }
        self.version: int | None = None
        self.torn: str | None = None  # why the model holds no whole version, until a version applies whole
        self._lock = threading.Lock()
        self._whole = threading.Condition(self._lock)

    @contextlib.contextmanager
    def serving(self, timeout_s: float | None = 600.0) -> Iterator[int | None]:
        """Hold while generating; yields the version the model holds during the block. While the model is
        torn it waits for a repaired one (TornModelError after ``timeout_s``)."""
        with self._whole:
            if not self._whole.wait_for(lambda: self.torn is None, timeout_s):
                raise TornModelError(f"the model is torn ({self.torn}) and was not repaired within {timeout_s}s")
            yield self.version

    def load(self, payload: VersionPayload) -> None:
        """LoadFn for the receiver: check everything the version carries (known before any byte: a streamed
        version's too), then copy in place with generation paused; a streamed version is copied as each of
        its buckets verifies, and generation resumes only after its end verified."""
        self._check(payload)
        if payload.sparse and self.torn is not None:
            raise ApplyRefused("the model is torn: only a whole version can repair it")
        with self._whole, torch.no_grad():
            touched = False
            try:
                for name, source in payload.items():
                    target = self.targets.get(name)
                    if target is not None:
                        touched = True
                        self._copy(name, target, source)
            except BaseException as exc:
                if not touched and isinstance(exc, Exception):  # (a stream failed before its first tensor)
                    raise ApplyRefused(f"version {payload.version} failed before anything was applied: "
                                       f"{type(exc).__name__}: {exc}") from exc
                self.torn = f"version {payload.version} failed part way: {type(exc).__name__}: {exc}"
                self.version = None
                raise
            self.torn = None
            self.version = payload.version
            self._whole.notify_all()

    def _copy(self, name: str, target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source)

    def _check(self, payload: VersionPayload) -> None:
        carried = _carried(payload)
        missing = [name for name in self.targets if name not in carried]
        if missing and self.strict and not payload.sparse:  # a sparse version carries only what changed
            raise ApplyRefused(f"version lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}")
        extra = [name for name in carried if name not in self.targets]
        if extra and self.strict:  # applying the rest would serve a model that is not the version it claims
            raise ApplyRefused(f"version has {len(extra)} tensor(s) the model does not, e.g. {extra[:3]}")
        for name, target in self.targets.items():
            found = carried.get(name)
            if found is not None and found != (dtype_name(target.dtype), tuple(target.shape)):
                raise ApplyRefused(f"{name}: version has {found[0]}{found[1]}, model has "
                                   f"{dtype_name(target.dtype)}{tuple(target.shape)}")


def _carried(payload: VersionPayload) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every tensor the version carries, from its header (or its tensors, when given alone)."""
    if payload.specs:
        return {name: (spec.dtype, tuple(spec.shape)) for name, spec in payload.specs.items()}
    return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in payload.tensors.items()}
