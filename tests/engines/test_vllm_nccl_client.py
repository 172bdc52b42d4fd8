"""The bridge into vLLM's own nccl backend speaks exactly vLLM's schema: its init and update infos are
parsed by vLLM's own dataclasses, as ``parse_init_info`` / ``parse_update_info`` do (an extra key, such as
the ``packed`` our older client put into every update, is a ValueError there). Its data path is vLLM's
NCCL communicator: it needs CUDA, so here it must refuse clearly."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import torch

pytest.importorskip("vllm", reason="the engine tests run in scripts/test-engines.sh's environment")

from ckpt_engine.errors import ConfigError
from ckpt_engine.workers.adapters.vllm.nccl_client import VLLMWeightTransferClient, init_info, update_info


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


def test_connect_starts_the_workers_with_vllms_init_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """What connect() posts to the vLLM server (a real HTTP server here, recording it). vLLM's side of the NCCL
    rendezvous needs CUDA, which this machine lacks: only that is replaced."""
    from vllm.distributed.weight_transfer import nccl_common

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nccl_common, "trainer_init", lambda info: "communicator")
    posted: list[tuple[str, object]] = []

    class Recording(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            posted.append((self.path, json.loads(body) if body else None))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = VLLMWeightTransferClient(f"http://127.0.0.1:{server.server_address[1]}", master_address="127.0.0.1",
                                          master_port=29702, workers=2)
        client.connect()
        assert client.communicator == "communicator"
        assert posted == [("/init_weight_transfer_engine", {"init_info": init_info("127.0.0.1", 29702, 3)})]
        client.control.close()
    finally:
        server.shutdown()
