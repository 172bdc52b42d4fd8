"""One rule for inference engines' HTTP replies: HTTP >= 400, or ``success: false``, is a failure."""

from __future__ import annotations

from typing import Any

import httpx

from ckpt_engine.errors import CkptEngineError


class EngineUpdateError(CkptEngineError):
    """The inference engine refused or failed an update."""


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
