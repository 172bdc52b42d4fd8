"""How ckpt-engine's driver (workers/driver.py) controls a vLLM engine, three ways:

- ``HttpControl``: a ``vllm serve`` server with ``VLLM_SERVER_DEV_MODE=1`` and
  ``--weight-transfer-config '{"backend": "ckpt_engine"}'``, through its RL routes (pause, start, update,
  finish with the version label, resume);
- ``LLMControl``: an in-process ``LLM(..., weight_transfer_config=...)``, through ``collective_rpc`` to the
  workers' weight-transfer engines; generation pauses by holding ``driver.serving()`` around ``llm.generate``;
- ``ExtensionControl``: the older ``--worker-extension-cls`` path, through ``collective_rpc("ckpt_engine_apply")``
  (on an ``LLM`` or, with dev mode, over HTTP).

``start_vllm_driver`` connects everything: it initialises the workers' receivers (they register with the
daemon as members of the engine) and starts the driver agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from ckpt_engine.errors import TornModelError
from ckpt_engine.retry import Backoff
from ckpt_engine.workers.adapters.engine_http import EngineUpdateError, checked
from ckpt_engine.workers.driver import EngineDriver

log = logging.getLogger(__name__)


class HttpControl:
    """A vLLM server's RL routes (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 pause_mode: str = "keep") -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)
        self.pause_mode = pause_mode

    def start_workers(self, init_info: dict[str, Any]) -> None:
        """Each worker's weight-transfer engine starts its receiver (``init_weight_transfer_engine``)."""
        try:
            self._post("/init_weight_transfer_engine", {"init_info": init_info})
        except EngineUpdateError as exc:
            if "HTTP 404" in str(exc):
                raise EngineUpdateError(
                    f"the vLLM server at {self.http.base_url} has no weight-update routes (HTTP 404 on "
                    "/init_weight_transfer_engine): start it with VLLM_SERVER_DEV_MODE=1 in its environment and "
                    """--weight-transfer-config '{"backend": "ckpt_engine"}'""") from exc
            raise

    def pause(self) -> None:
        self._post(f"/pause?mode={self.pause_mode}", retries=3)

    def apply(self, version: int) -> None:
        self.start()
        self.update({"version": version})
        self.finish(str(version))

    def abandon(self) -> None:
        # retried: vLLM answers a failed step with a 500 that closes the connection, and an update left open
        # would refuse every later one (the engine would stay paused for good)
        try:
            self._post("/finish_weight_update", retries=3)
        except EngineUpdateError as exc:
            if "without a matching start_weight_update" not in str(exc):
                raise
            # (vLLM closes a session whose update_weights failed: nothing was left open, an expected answer)
            log.info("the failed update was closed by vLLM already")

    def start(self) -> None:
        self._post("/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish(self, label: str | None) -> None:
        """Ends the update; vLLM publishes ``label`` as the weights' version only when it succeeded."""
        self._post("/finish_weight_update", {"weight_version": label} if label is not None else None)

    def resume(self) -> None:
        self._post("/resume", retries=3)

    def weight_version(self) -> str | None:
        return checked(self.http.get("/weight_info"), "/weight_info").get("weight_version")

    def close(self) -> None:
        self.http.close()

    def _post(self, path: str, body: dict[str, Any] | None = None, *, retries: int = 0) -> dict[str, Any]:
        """POST and check the answer; ``retries``: attempts after a connection failure (for calls that are
        safe to repeat), each on a fresh connection after a backoff."""
        backoff, attempt = Backoff(initial_s=0.2, max_s=2.0), 0
        while True:
            try:
                response = self.http.post(path, json=body) if body is not None else self.http.post(path)
                return checked(response, path)
            except httpx.TransportError as exc:
                if attempt == retries:
                    raise EngineUpdateError(f"{path}: {type(exc).__name__}: {exc}") from exc
                log.info("%s: %s: %s; retrying", path, type(exc).__name__, exc)
            except httpx.HTTPError as exc:
                raise EngineUpdateError(f"{path}: {type(exc).__name__}: {exc}") from exc
            attempt += 1
            backoff.wait()


class LLMControl:
    """An in-process ``vllm.LLM`` built with ``weight_transfer_config={"backend": "ckpt_engine"}``. Generation
    runs in the caller's thread; the driver applies versions between generations (``serving()``)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._lock = threading.Lock()

    def start_workers(self, init_info: dict[str, Any]) -> None:
        """Each worker's weight-transfer engine starts its receiver (``init_weight_transfer_engine``)."""
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def pause(self) -> None:
        self._lock.acquire()

    def apply(self, version: int) -> None:
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", kwargs={"update_info": {"version": version}})
        self.llm.collective_rpc("finish_weight_update")
        self.llm.llm_engine.engine_core.set_weight_version(str(version))

    def abandon(self) -> None:
        self.llm.collective_rpc("finish_weight_update")

    def resume(self) -> None:
        self._lock.release()

    def weight_version(self) -> str | None:
        return self.llm.llm_engine.engine_core.get_weight_version()

    @contextlib.contextmanager
    def serving(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold around ``llm.generate``: a version waits for it, and while the engine is torn it is not
        entered (TornModelError after ``timeout_s``)."""
        if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TornModelError(f"the engine was not whole (or free) within {timeout_s}s")
        try:
            yield
        finally:
            self._lock.release()


class ExtensionControl(LLMControl):
    """The older worker-extension path: each worker applies its staged version in one RPC."""

    def start_workers(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("ckpt_engine_start", args=(init_info["endpoint"],),
                                kwargs={k: v for k, v in init_info.items() if k != "endpoint"})

    def apply(self, version: int) -> None:
        self.llm.collective_rpc("ckpt_engine_apply", args=(version,))
        self.llm.llm_engine.engine_core.set_weight_version(str(version))

    def abandon(self) -> None:
        pass  # each worker closed its own reload when its apply failed


def default_engine_name(kind: str = "vllm") -> str:
    return f"{kind}-{socket.gethostname()}-{os.getpid()}"


def start_vllm_driver(control: HttpControl | LLMControl, endpoint: str, *, engine: str | None = None,
                      token: str | None = None, worker_token: str | None = None, poll_wait_s: float = 1.0,
                      take_timeout_s: float = 60.0, credentials: str | None = None,
                      staging: str | None = None, sharded: bool = False) -> EngineDriver:
    """Start the workers' receivers (through ``control``) and the driver of engine ``engine``; ``staging``:
    the engine's staging policy (auto, device, host, stream; default: the deployment's); ``sharded``: each
    worker receives only its tensor-parallel slices (the worker extension; see docs/workers.md).

    ``token``: the driver's rollout token (default: $CKPT_ENGINE_TOKEN, else the rollout token of the
    ``credentials`` file); ``worker_token``: the one the workers send (default: the same; a worker on another
    host or user than the credentials file needs it passed)."""
    from ckpt_engine.control.auth import client_token

    name = engine or default_engine_name()
    token = client_token("rollout", token, credentials)
    driver = EngineDriver(control, endpoint, engine=name, token=token, poll_wait_s=poll_wait_s).start()
    try:
        init_info = {"endpoint": endpoint, "engine": name, "token": worker_token or token,
                     "engine_key": driver.engine_key, "poll_wait_s": poll_wait_s, "take_timeout_s": take_timeout_s}
        control.start_workers(init_info | ({"staging": staging} if staging is not None else {})
                              | ({"sharded": True} if sharded else {}))
    except BaseException:
        driver.close()  # unregistered: an engine whose workers never started is not left in /receivers
        raise
    return driver
