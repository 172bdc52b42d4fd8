"""What the vLLM and SGLang adapters share: an HTTP client for the engine, a push group for the tensors,
and one rule for replies (HTTP >= 400 or ``success: false`` is a failure)."""

from __future__ import annotations

from typing import Any, Callable

import httpx
import torch

from ckpt_engine.errors import CkptEngineError
from ckpt_engine.receiver import VersionPayload
from ckpt_engine.workers.adapters.push_group import PushGroup, PushSettings, chunks, push_while, unique_tensors


class EngineUpdateError(CkptEngineError):
    """The inference engine refused or failed an update."""


Batch = list[tuple[str, torch.Tensor]]


class EngineHttpAdapter:
    def __init__(self, base_url: str, push: PushSettings, *, pause_mode: str, api_key: str | None = None,
                 group: PushGroup | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=push.timeout_s)
        self.push = push
        self.pause_mode = pause_mode
        self.group = group or PushGroup(push)
        self.version: int | None = None

    def close(self) -> None:
        self.group.close()
        self.http.close()

    def join_while(self, call: Callable[[], Any]) -> None:
        """Join the push group while the engine's init request runs (they rendezvous together)."""
        push_while(call, self.group.join, self.push.timeout_s)

    def push_batches(self, payload: VersionPayload, request: Callable[[Batch, bool], Any]) -> None:
        """For each batch: ``request(batch, is_last)`` (the engine's receiving call) while we broadcast it."""
        batches = chunks(unique_tensors(payload.tensors), self.push.chunk_bytes)
        for index, batch in enumerate(batches):
            push_while(lambda: request(batch, index == len(batches) - 1),
                       lambda: self.group.broadcast(t for _, t in batch), self.push.timeout_s)

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return checked(self.http.post(path, json=body) if body is not None else self.http.post(path), path)

    def get(self, path: str) -> dict[str, Any]:
        return checked(self.http.get(path), path)


def checked(response: httpx.Response, path: str) -> dict[str, Any]:
    if response.status_code >= 400:
        raise EngineUpdateError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
    try:
        body = response.json() if response.content else {}
    except ValueError:
        body = {}
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineUpdateError(f"{path}: engine reports failure: {body.get('message')}")
    return body if isinstance(body, dict) else {}
