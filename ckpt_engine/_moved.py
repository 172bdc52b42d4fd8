"""Module paths of the first release, before the library's folders became the pipeline (plan/, send/,
transport/, receive/, control/): importing one still works and warns where it moved."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "ckpt_engine.layout": "ckpt_engine.plan.layout",
    "ckpt_engine.tensors": "ckpt_engine.plan.tensors",
    "ckpt_engine.dtypes": "ckpt_engine.plan.dtypes",
    "ckpt_engine.hashing": "ckpt_engine.plan.hashing",
    "ckpt_engine.sparse": "ckpt_engine.plan.sparse",
    "ckpt_engine.changes": "ckpt_engine.plan.changes",
    "ckpt_engine.publisher": "ckpt_engine.send.publisher",
    "ckpt_engine.sender": "ckpt_engine.send.sender",
    "ckpt_engine.outlets": "ckpt_engine.send.outlets",
    "ckpt_engine.cache": "ckpt_engine.send.cache",
    "ckpt_engine.group": "ckpt_engine.transport.group",
    "ckpt_engine.wire": "ckpt_engine.transport.framing",
    "ckpt_engine.protocol": "ckpt_engine.transport.messages",
    "ckpt_engine.ipc": "ckpt_engine.transport.same_host",
    "ckpt_engine.assembly": "ckpt_engine.receive.assembly",
    "ckpt_engine.receiver": "ckpt_engine.receive.collective",
    "ckpt_engine.ipc_receiver": "ckpt_engine.receive.colocated",
    "ckpt_engine.auth": "ckpt_engine.control.auth",
    "ckpt_engine.workers.client": "ckpt_engine.control.client",
    # the house, round 2: the knobs beside the deployment; the command line out of the daemon
    "ckpt_engine.knobs": "ckpt_engine.config.knobs",
    "ckpt_engine.server.cli": "ckpt_engine.cli.main",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}: import it from there (the names most users need are also "
                      "importable from ckpt_engine)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)  # the module itself, under its old name too

    def exec_module(self, module: ModuleType) -> None:
        pass


def install() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
