"""What users write keeps working (issue 16, and its outside review): the public names at the package top,
the old module paths of the first release (with a warning saying where they went), the agents' names."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ckpt_engine
from ckpt_engine._moved import MOVED


def test_the_public_names_import_from_the_package_top_and_are_listed() -> None:
    for name in ckpt_engine.__all__:
        assert getattr(ckpt_engine, name) is not None
    assert set(ckpt_engine.__all__) <= set(dir(ckpt_engine))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ckpt_engine.Nope  # noqa: B018


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_moved_module_and_says_where_it_went(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_importing_the_package_loads_no_torch_and_the_agents_keep_their_names() -> None:
    code = ("import sys, ckpt_engine; assert 'torch' not in sys.modules, 'torch loaded'; "
            "from ckpt_engine.workers import TrainerAgent, RolloutAgent, EngineDriver; "
            "from ckpt_engine.workers.adapters.vllm import CkptEngineWorkerExtension; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip() == "ok", out.stderr


# ---- what the library's one entry takes (outside review of issue 16) -----------------------------------------
def _publisher():
    from ckpt_engine.device import detect_device
    from ckpt_engine.send.publisher import Publisher

    return Publisher(device=detect_device("cpu"), bucket_size=1 << 16)


@pytest.mark.parametrize("mode", ["bypass", "BYPASS_CPU", True, None])
def test_publish_refuses_a_mode_it_does_not_know(mode: object) -> None:
    import torch

    from ckpt_engine.errors import ConfigError

    publisher = _publisher()
    with pytest.raises(ConfigError, match="mode must be one of cached, bypass_cpu"):
        publisher.publish(1, {"w": torch.zeros(4)}, mode=mode)  # type: ignore[arg-type]
    assert publisher.cache.versions() == []


@pytest.mark.parametrize("version", [None, -5, 1.0, True, 1 << 60])
def test_publish_refuses_a_version_id_that_is_not_one_before_caching_anything(version: object) -> None:
    import torch

    from ckpt_engine.errors import ConfigError

    publisher = _publisher()
    with pytest.raises(ConfigError, match="version id"):
        publisher.publish(version, {"w": torch.zeros(4)})  # type: ignore[arg-type]
    assert publisher.cache.versions() == []
    publisher.publish(2, {"w": torch.zeros(4)}).result(30)  # and the publisher still works
    assert publisher.cache.versions() == [2]


def test_publish_takes_a_state_dict_and_refuses_nothing_or_the_wrong_thing() -> None:
    import torch

    from ckpt_engine.errors import ConfigError

    publisher = _publisher()
    publisher.publish(1, torch.nn.Linear(3, 2).state_dict()).result(30)
    assert publisher.cache.versions() == [1]
    with pytest.raises(ConfigError, match="no tensors"):
        publisher.publish(2, {})
    with pytest.raises(ConfigError, match="named_tensors_of"):
        publisher.publish(3, torch.nn.Linear(3, 2))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="re-push"):
        publisher.publish(4, source_version=1, mode="bypass_cpu")
