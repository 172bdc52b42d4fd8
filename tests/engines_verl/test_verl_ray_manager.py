"""verl's own CheckpointEngineManager, with Ray, on this CPU machine: the manager, verl's rollout-side
CheckpointEngineWorker (one Ray actor per rollout worker, as verl makes them), verl's worker groups and
dispatch are real. What cannot run here stands in: the actor worker (verl's ActorRolloutRefWorker needs a
model and a training engine: this one has the same checkpoint-engine surface and builds the backend the same
way), the replicas (no vLLM / SGLang server: the four control calls the manager makes) and the server adapter
(no inference engine: it reads receive_weights() through verl's ensure_async_iterator and writes what it got).

Ray needs one logical CPU per worker here (2 actor ranks + 2 rollout workers; with fewer its placement group
never fits and the manager waits forever): ray.init(num_cpus=4), also on a 2-core machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl tests run in scripts/test-verl.sh's environment")

import ray
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, RolloutConfig

from tests.engines_verl.verl_harness import fingerprint, model_weights

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).resolve().parents[2]


class ActorStandIn(Worker):
    """The checkpoint-engine surface of verl's actor worker: the backend built from the config, as verl
    builds it on an actor rank; update_weights hands it a generator of full tensors."""

    def __init__(self, config: CheckpointEngineConfig) -> None:
        super().__init__()
        import_external_libs(config.custom_backend_module or None)
        self.engine = CheckpointEngineRegistry.new(config.backend, is_master=self.rank == 0,
                                                   bucket_size=config.update_weights_bucket_megabytes << 20,
                                                   **config.engine_kwargs.get(config.backend, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        return await self.engine.send_weights(iter(model_weights(global_steps or 0)), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)


class RecordingAdapter:
    """Where verl's vLLM / SGLang server adapter would load the weights: records what it was yielded."""

    def __init__(self, out: str) -> None:
        self.out, self.replica_rank, self.is_leader_rank = out, 0, True

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        got = [(name, tensor.clone()) async for name, tensor in ensure_async_iterator(weights)]
        path = Path(self.out) / f"{os.getpid()}-{global_steps}.json"
        path.write_text(json.dumps({"wire_format": wire_format, "received": fingerprint(got)}))


class ReplicaStandIn:
    def __init__(self, workers) -> None:
        self.workers, self.calls = workers, []

    async def abort_all_requests(self, reject_request=False):
        self.calls.append("abort_all_requests")

    async def release_kv_cache(self):
        self.calls.append("release_kv_cache")

    async def resume_kv_cache(self):
        self.calls.append("resume_kv_cache")

    async def resume_generation(self):
        self.calls.append("resume_generation")


@pytest.mark.timeout(300)
def test_verls_own_manager_with_ray_delivers_every_sync_byte_exact(tmp_path: Path) -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        config = CheckpointEngineConfig(backend="ckpt_engine", update_weights_bucket_megabytes=1,
                                        engine_kwargs={"ckpt_engine": {"bypass_cpu": False, "timeout_s": 60.0}},
                                        custom_backend_module="ckpt_engine.workers.adapters.verl")
        actors = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1,
                                          name_prefix="actor"),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(ActorStandIn), config=config),
            name_prefix="actor", device_name="cpu")
        rollouts = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1,
                                          name_prefix="rollout"),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker),
                                                   rollout_config=RolloutConfig(name="vllm", checkpoint_engine=config),
                                                   model_config=None, server_adapter=RecordingAdapter(str(tmp_path))),
            name_prefix="rollout", device_name="cpu")
        replicas = [ReplicaStandIn([worker]) for worker in rollouts.workers]
        manager = CheckpointEngineManager(config=config, actor_wg=actors, replicas=replicas)
        assert manager.backend_cls.__name__ == "CkptEngineCheckpointEngine"
        for version, step in enumerate((7, 8), start=1):
            metrics = manager.update_weights(global_steps=step)
            assert metrics["ckpt_engine/version"] == version
            records = sorted(tmp_path.glob(f"*-{step}.json"))
            assert len(records) == 2  # each rollout worker's adapter got the version
            for record in records:
                got = json.loads(record.read_text())
                assert got["wire_format"] == "named_tensors"
                assert [tuple(r[:2]) + (tuple(r[2]), r[3]) for r in got["received"]] == fingerprint(model_weights(step))
        assert replicas[0].calls[:4] == ["abort_all_requests", "release_kv_cache", "resume_kv_cache",
                                         "resume_generation"]
    finally:
        ray.shutdown()
