"""transformers receiver: a version changes generation, greedy output equals a reference model with the same
state dict, generation is paused while a version is applied, and a mismatched version touches nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt_engine.errors import ApplyRefused
from ckpt_engine.plan.tensors import named_tensors_of
from ckpt_engine.receive.collective import VersionPayload
from ckpt_engine.workers.adapters.torch_module import ModuleAdapter
from tests.tiny_lm import tiny_llama

PROMPT = torch.tensor([[5, 6, 7, 8]])


def greedy(model) -> list[int]:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()


def payload_of(model, version: int) -> VersionPayload:
    named = named_tensors_of(model)
    tensors = dict(named.tensors)
    tensors.update({alias: tensors[canonical] for alias, canonical in named.aliases.items()})
    return VersionPayload(version, None, "cached", "x", tensors)


def test_a_version_changes_generation_to_that_of_the_reference() -> None:
    trainer, rollout, reference = tiny_llama(seed=1).eval(), tiny_llama(seed=2).eval(), tiny_llama(seed=9).eval()
    reference.load_state_dict(trainer.state_dict())
    adapter = ModuleAdapter(rollout)
    before = greedy(rollout)
    adapter.load(payload_of(trainer, 3))
    after = greedy(rollout)
    assert after != before
    assert after == greedy(reference)
    assert adapter.version == 3


def test_generation_is_paused_while_a_version_is_applied() -> None:
    trainer, rollout = tiny_llama(seed=1).eval(), tiny_llama(seed=2).eval()
    adapter = ModuleAdapter(rollout)
    generating, release, order = threading.Event(), threading.Event(), []

    def generate() -> None:
        with adapter.serving() as version:
            generating.set()
            release.wait(10)
            order.append(("generated with", version))

    worker = threading.Thread(target=generate)
    worker.start()
    generating.wait(10)
    loader = threading.Thread(target=lambda: (adapter.load(payload_of(trainer, 1)), order.append(("loaded", 1))))
    loader.start()
    loader.join(0.2)
    assert loader.is_alive()  # waits for the generation in progress
    release.set()
    worker.join(10)
    loader.join(10)
    assert order == [("generated with", None), ("loaded", 1)]
    with adapter.serving() as version:
        assert version == 1  # the next generation runs on the new version


def test_mismatched_version_leaves_the_model_untouched() -> None:
    rollout = tiny_llama(seed=2)
    before = {k: v.clone() for k, v in rollout.state_dict().items()}
    wrong = payload_of(tiny_llama(seed=1, hidden=32), 1)
    with pytest.raises(ApplyRefused):
        ModuleAdapter(rollout).load(wrong)
    assert all(torch.equal(before[k], v) for k, v in rollout.state_dict().items())
