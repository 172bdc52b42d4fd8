"""Request and response bodies of the HTTP API, so /openapi.json states what every status really returns
(the fuzz test, tests/test_fuzz_http.py, checks live responses against it)."""

from __future__ import annotations

from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from ckpt_engine.plan.modes import Mode
from ckpt_engine.server.decisions.receivers import STATES
from ckpt_engine.server.history import STATUSES, VersionRecord

Status = Literal[STATUSES]  # type: ignore[valid-type]  # the store's statuses, one list for both


class FieldProblem(BaseModel):
    loc: list[str | int]
    msg: str


class ErrorBody(BaseModel):
    """Every 4xx and 5xx the API itself produces."""

    error: str = Field(description="short class of the error: unauthorized, not found, conflict, ...")
    detail: str | list[FieldProblem] = Field(description="what was wrong; for 422 one entry per bad field")
    record: dict[str, Any] | None = Field(None, description="the version record concerned (503: the failed "
                                          "version; 409: {in_flight: id})")


class _Out(BaseModel):
    # Responses are validated against these models; a field added on the server side passes through
    # instead of being dropped silently.
    model_config = ConfigDict(extra="allow")


# One row of the version history: the store's own record, with its mode and status spelled out for the schema.
_SPELLED_OUT = {"mode": Mode, "status": Status}
VersionOut = create_model(  # type: ignore[call-overload]  # (fields built at import: no static signature)
    "VersionOut", __base__=_Out, __doc__="One row of the version history (``HistoryStore``).",
    **{name: (_SPELLED_OUT.get(name, hint), ...) for name, hint in get_type_hints(VersionRecord).items()},
)


class SyncAccepted(_Out):
    version: int
    status_url: str


class PushAccepted(SyncAccepted):
    source_version: int


class VersionList(_Out):
    versions: list[VersionOut]
    next_before: int | None = Field(None, description="pass as before= for the next (older) page; null at the end")


_AGENT_STATES = ("registered", *STATES)


class AgentOut(_Out):
    agent_id: str
    role: Literal["trainer", "receiver", "driver"]
    rank: int
    host: str
    pid: int
    device: str
    host_id: str | None
    versions: list[int]
    sync_every: int
    registered_at: float
    seconds_since_seen: float
    engine: str | None = None
    driven: bool = False
    members: int | None = None
    state: Literal[_AGENT_STATES] = Field(  # type: ignore[valid-type]  # (built from STATES; 3.10: no star in an index)
        description="receivers (server/decisions/receivers.py): new (holds no whole version the daemon knows of: "
                    "just registered, or its outcome of a version was never heard; a catch-up brings it one), "
                    "serving (holds `serving` whole, proven), staged (verified, waiting for its engine's driver), "
                    "torn (a failed apply changed the model part way; it is not served until repaired), unable "
                    "(out of the quorums for `unable_for_s`: `unable`); trainers and drivers: registered")
    serving: int | None = None
    staged: int | None = None
    torn: str | None = None
    unable: str | None = None
    unable_for_s: float | None = None
    proven: bool = Field(False, description="receivers: took a whole version under this registration. Until then "
                                            "what it says it holds is a claim, and it is sent versions of its own "
                                            "(catch-ups) rather than joining everyone's")
    whole_versions: bool = Field(False, description="its engine takes whole versions only (vLLM): never sent sparse")
    pulls: bool = Field(False, description="receivers: asked to pull every version over NIXL (transport nixl)")
    joins_next: bool | None = Field(None, description="receivers: it would be in the next regular version now (not "
                                                      "waiting for a catch-up or repair, not benched, heartbeating)")
    waits_because: str | None = Field(None, description="receivers not in the next regular version: why (silent, "
                                                         "benched, waiting for a catch-up, a newcomer's turn ...)")


class AgentList(_Out):
    agents: list[AgentOut]


class StatusOut(_Out):
    in_flight: int | None
    queued_push: int | None = Field(None, description="a rollback (POST /push) waiting for a framework's next sync "
                                    "(verl jobs)")
    generation: int
    trainer: str | None
    receivers: int
    versions: dict[str, int]
    cache_versions: list[int]
    cache_kept_for_repairs: list[int] = Field(default_factory=list, description="cached versions the trainer was "
                                              "told never to evict to make room: what receivers serve, which a "
                                              "repair or catch-up re-sends (newest first)")
    started_at: float
    history_id: str
    degraded: bool
    storage: dict[str, Any]
    torn: list[str]
    unable: list[str]
    newcomers_held_for_s: float = Field(0.0, description="receivers that never proved themselves join no regular "
                                        "version for this long: a newcomer never joined one (server/decisions/"
                                        "newcomers.py)")
    newcomers_held_because: str | None = None
    config: dict[str, Any]
    version: str


class Health(_Out):
    ok: bool  # false (HTTP 503) while the controller's periodic work keeps failing: restart the daemon
    degraded: bool = False  # the history cannot be written (reads and the versions in memory still work)
    problem: str | None = None


_DESCRIPTIONS = {
    400: "Bad request: sparse combined with bypass_cpu (in the body, or one of them from the deployment)",
    401: "Missing or wrong bearer token",
    403: "The token's role may not do this (writes need the operator's token)",
    404: "Unknown version",
    409: "Conflict: a version is in flight, or the version is not in the trainer's cache",
    413: "Request body over http.max_body_bytes",
    429: "Too many requests are waiting on agents already",
    422: "Invalid parameters or body",
    503: "Not enough agents registered (the refused version is recorded as failed), or the history cannot be "
         "written now (no new version until it can; reads still work)",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for error statuses, all with the ErrorBody schema."""
    return {code: {"model": ErrorBody, "description": _DESCRIPTIONS[code]} for code in codes}
