"""SGLang adapter: applies verified versions to a running SGLang server over its HTTP API.

    adapter = SGLangAdapter("http://127.0.0.1:30000", PushSettings("127.0.0.1", 29600, world_size=1 + tp))
    adapter.connect()                              # init_weights_update_group, concurrent with our join
    RolloutAgent(adapter.load, endpoint).start()

Schema-exact with SGLang 0.5.23 (``srt/managers/io_struct.py``, ``srt/entrypoints/http_server.py``); read,
not run: SGLang does not install on a CPU-only machine. Per version:

    pause_generation {mode: retract} -> begin_weight_update {} -> per batch, update_weights_from_distributed
    {names, dtypes, shapes, group_name, flush_cache, weight_version} while the batch is broadcast (one tensor
    per name, in order) -> end_weight_update {} -> continue_generation {}

``flush_cache`` and ``weight_version`` go with the last batch only: SGLang applies ``weight_version`` after
every successful request, so sending it earlier would label the server with the new version before its
last batch landed (and a flush refuses while requests wait, failing a batch that was applied).

A streamed version (staging ``stream``: ``RolloutAgent(adapter.load, ..., streams=True)``) is pushed batch by
batch as its buckets verify, inside the same session, with generation paused from the first batch; the last
batch (with the label) goes only after the whole version and its trailer verified.

No torn model: a batch that fails after an earlier one was applied leaves SGLang with a mix; the adapter then
keeps generation paused and reports the load torn, and the daemon re-sends the version this receiver served
last; once a version applies whole, generation continues. A failure before any weight was sent changes
nothing: generation continues and the version is refused.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import httpx

from ckpt_engine.errors import ApplyRefused, CkptEngineError, SyncTimeoutError, TornModelError
from ckpt_engine.plan.dtypes import dtype_name
from ckpt_engine.receive.collective import VersionPayload
from ckpt_engine.receive.payload import StreamFailed
from ckpt_engine.workers.adapters.engine_http import EngineUpdateError, checked
from ckpt_engine.workers.adapters.push_group import Batch, PushGroup, PushSettings, batches, distinct, push_while

__all__ = ["EngineUpdateError", "SGLangAdapter"]
log = logging.getLogger(__name__)


class SGLangAdapter:
    def __init__(self, base_url: str, push: PushSettings, *, pause_mode: str = "retract",
                 api_key: str | None = None, group: PushGroup | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=push.timeout_s)
        self.push = push
        self.pause_mode = pause_mode  # "in_place" keeps requests, and then no flush can succeed: retract
        self.group = group or PushGroup(push)
        self.version: int | None = None
        self.torn: str | None = None  # SGLang holds a mix: generation stays paused until a whole version
        self._stale: str | None = None  # why the update group must be joined anew before the next version

    def connect(self) -> None:
        """Create the update group on the server and join it from here, concurrently (they rendezvous). A group
        of the same name left on the server (by an earlier run of this agent) is destroyed first: SGLang, like
        torch, refuses a second group by one name."""
        self._destroy_server_group()
        body = {"master_address": self.push.master_address, "master_port": self.push.master_port,
                "rank_offset": 1, "world_size": self.push.world_size, "group_name": self.push.group_name,
                "backend": self.push.backend}
        push_while(lambda: self.post("/init_weights_update_group", body), self.group.join, self.push.timeout_s)
        self._stale = None

    def load(self, payload: VersionPayload) -> None:
        """LoadFn: push one verified version; raises if SGLang refuses it (ApplyRefused when nothing changed)."""
        self._check_still_ours(payload)
        if self._stale is not None:  # a broadcast failed (e.g. SGLang restarted): a new group first
            self._reconnect(payload.version)
        if self.torn is None:
            self.post("/pause_generation", {"mode": self.pause_mode})
        opened, done = False, 0
        try:
            self.post("/begin_weight_update", {})
            opened = True
            for batch, last in batches(distinct(payload.items()), self.push.chunk_bytes):
                update = _update(batch, self.push.group_name, last, payload.version)
                push_while(functools.partial(self.post, "/update_weights_from_distributed", update),
                           functools.partial(self.group.broadcast, (t for _, t in batch)), self.push.timeout_s)
                done += 1
            self.post("/end_weight_update", {})
        except Exception as exc:  # noqa: BLE001 - _failed closes the session and raises why
            self._failed(payload.version, exc, opened, done)
        self.version, self.torn = payload.version, None
        self.post("/continue_generation", {})

    def _check_still_ours(self, payload: VersionPayload) -> None:
        """SGLang still labels its weights with the version this adapter applied last. A restarted SGLang
        serves its checkpoint instead (and has no update group): a whole version simply replaces that, but a
        sparse one would make a mix, so the engine is declared torn and the daemon repairs it whole."""
        if self.version is None:
            return
        try:
            label = self.weight_version()
        except (httpx.HTTPError, EngineUpdateError) as exc:
            self._stale = f"SGLang unreachable: {exc}"
            raise ApplyRefused(f"version {payload.version} not pushed: SGLang is unreachable ({exc})") from exc
        if label == str(self.version):
            return
        self._stale = f"SGLang reports weight version {label!r}, not {self.version}"
        self.version = None
        if payload.sparse:
            self.post("/pause_generation", {"mode": self.pause_mode})
            self.torn = f"{self._stale}: it restarted or another client changed it; a whole version repairs it"
            raise TornModelError(self.torn)

    def _failed(self, version: int, exc: Exception, opened: bool, done: int) -> None:
        if opened:
            self._close_session()  # only our own: another client's open session is not ours to end
        if isinstance(exc, StreamFailed):  # our side: the version failed to verify part way, the group is fine
            pass
        elif not isinstance(exc, EngineUpdateError) or "Failed to receive weights" in str(exc):
            self._stale = f"{type(exc).__name__}: {exc}"  # the group may be broken: join a new one next time
        if done or (opened and _may_have_landed(exc)):  # some weights may have landed: a mix is not served
            self.torn = f"version {version} failed part way: {exc}"
            self.version = None
            raise exc
        if self.torn is None:
            self.post("/continue_generation", {})
        raise ApplyRefused(f"SGLang refused version {version} before any weight landed: {exc}") from exc

    def _reconnect(self, version: int) -> None:
        log.warning("version %d: joining a new update group with SGLang (the last one failed: %s)", version,
                    self._stale)
        self.group.close()
        self.group = PushGroup(self.push, self.group.device)  # a fresh store: no keys of the broken rendezvous
        try:
            self.connect()
        except Exception as exc:
            raise ApplyRefused(f"could not join a new update group with SGLang: {exc}") from exc

    def weight_version(self) -> str | None:
        """The version label SGLang reports (``GET /model_info``)."""
        return checked(self.http.get("/model_info"), "/model_info").get("weight_version")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return checked(self.http.post(path, json=body), path)

    def close(self) -> None:
        self.group.close()
        self.http.close()

    def _close_session(self) -> None:
        try:
            self.post("/end_weight_update", {})
        except (EngineUpdateError, httpx.HTTPError) as exc:  # the server closed it, or is gone
            log.info("closing the weight-update session: %s", exc)

    def _destroy_server_group(self) -> None:
        try:
            self.post("/destroy_weights_update_group", {"group_name": self.push.group_name})
        except EngineUpdateError:  # "The group to be destroyed does not exist.": nothing to clean up
            pass


def _may_have_landed(exc: Exception) -> bool:
    """Whether a failed first batch may have changed SGLang's weights. SGLang says "Failed to receive weights"
    when the broadcast failed (nothing was loaded); a batch refused before its broadcast, a connection that
    never reached the server, or our own side failing before SGLang received all of it change nothing. No
    answer at all (a timeout), or any other failure, may have come after a load."""
    if isinstance(exc, EngineUpdateError):
        text = str(exc)
        return not any(sign in text for sign in ("Failed to receive weights", "must run between",
                                                  "Please call `init_weights_update_group`"))
    if isinstance(exc, SyncTimeoutError):
        return True
    return not isinstance(exc, (httpx.ConnectError, CkptEngineError))


def _update(batch: Batch, group_name: str, last: bool, version: int) -> dict[str, Any]:
    """``UpdateWeightsFromDistributedReqInput`` of one batch."""
    return {"names": [name for name, _ in batch], "dtypes": [dtype_name(t.dtype) for _, t in batch],
            "shapes": [list(t.shape) for _, t in batch], "group_name": group_name, "flush_cache": last,
            "weight_version": str(version) if last else None}
