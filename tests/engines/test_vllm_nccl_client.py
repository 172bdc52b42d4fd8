"""The bridge into vLLM's own nccl backend speaks exactly vLLM's schema: its init and update infos are
parsed by vLLM's own dataclasses, as ``parse_init_info`` / ``parse_update_info`` do (an extra key, such as
the ``packed`` our older client put into every update, is a ValueError there). Its data path is vLLM's
NCCL communicator: it needs CUDA, so here it must refuse clearly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the engine tests run in scripts/test-engines.sh's environment")

from ckpt_engine.workers.adapters.vllm.nccl_client import VLLMWeightTransferClient, init_info, update_info

from ckpt_engine.errors import ConfigError


def test_init_and_update_infos_are_what_vllm_parses() -> None:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    init = NCCLWeightTransferInitInfo(**init_info("127.0.0.1", 29700, 3))
    assert (init.rank_offset, init.world_size, init.packed) == (1, 3, False)
    batch = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    update = NCCLWeightTransferUpdateInfo(**update_info(batch))
    assert update.names == ["a.weight", "b"] and update.dtype_names == ["bfloat16", "float32"]
    assert update.shapes == [[2, 3], [4]]
    with pytest.raises(TypeError):  # what parse_update_info turns into "Invalid update_info"
        NCCLWeightTransferUpdateInfo(**update_info(batch), packed=False)


def test_without_cuda_the_bridge_says_what_to_use_instead() -> None:
    client = VLLMWeightTransferClient("http://127.0.0.1:9", master_address="127.0.0.1", master_port=29701, workers=1)
    with pytest.raises(ConfigError, match="ckpt_engine backend"):
        client.connect()
    client.control.close()
