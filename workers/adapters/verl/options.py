"""``engine_kwargs.ckpt_engine``: the verl backend's options, checked when verl builds the backend.

Two kinds. The knobs the deployment names too (``bypass_cpu``, ``sparse``, ``staging``, ``keep_versions``; and
the bucket size, which verl passes as ``update_weights_bucket_megabytes``) have no default here: unset, a sync
takes the daemon's value (its YAML), or without a daemon the deployment's default; set, verl's value wins.
Their types and bounds are the deployment's own (ckpt_engine/config/deployment.py ``EngineConfig``, through
ckpt_engine/config/knobs.py, which also decides each sync's values). The others are verl's alone (where actor rank 0
serves the rendezvous, the transfer's timeouts, the daemon's endpoint, sharded delivery), with their bounds
here. No verl import.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckpt_engine.config.knobs import check_knobs
from ckpt_engine.errors import ConfigError

BACKEND = "ckpt_engine"
WHERE = f"engine_kwargs.{BACKEND}"
MIN_WAIT_S = 1.0  # below this a sync cannot even rendezvous
MAX_WAIT_S = 7 * 86400.0


class VerlOptions(BaseModel):
    """What ``engine_kwargs.ckpt_engine`` may say (an unknown key is refused by name)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # the deployment's knobs (None: unset); checked by the deployment's own EngineConfig below
    bypass_cpu: Any = None
    sparse: Any = None
    staging: Any = None
    keep_versions: Any = None
    # verl's own
    host: str | None = Field(None, pattern=r"^[^\s*]{1,253}$", description="where actor rank 0 serves the "
                             "rendezvous (default: its Ray node address)")
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    timeout_s: float = Field(120.0, ge=MIN_WAIT_S, le=MAX_WAIT_S, allow_inf_nan=False)
    load_timeout_s: float = Field(600.0, ge=MIN_WAIT_S, le=MAX_WAIT_S, allow_inf_nan=False)
    group_name: str = Field("verl", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    endpoint: str | None = None
    credentials: str | None = None
    # sharded delivery (rollout workers; docs/workers.md): each worker receives only the slices its TP rank keeps
    sharded: bool = False
    tensor_parallel_size: int | None = Field(None, ge=1, le=1024)
    model_path: str | None = Field(None, min_length=1, max_length=4096)

    @field_validator("timeout_s", "load_timeout_s", mode="before")
    @classmethod
    def _seconds(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):  # (strict: 120 is a number of seconds too)
            return float(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a number of seconds from {MIN_WAIT_S:.0f} to {MAX_WAIT_S:.0f}")
        return value

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        # a host to connect to: a bind wildcard such as * names none
        match = re.fullmatch(r"tcp://([^:/\s*]+|\[[0-9a-fA-F:]+\]):(\d{1,5})", value) if value is not None else None
        if value is not None and (match is None or not 0 < int(match.group(2)) < 65536):
            raise ValueError("must be the daemon's zmq endpoint, tcp://host:port")
        return value

    @field_validator("credentials")
    @classmethod
    def _credentials(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(value):
            raise ValueError(f"{value!r} is not a file this process can see (the daemon's credentials file; each "
                             "process takes its role's token from it)")
        return value

    @model_validator(mode="after")
    def _sharded(self) -> VerlOptions:
        if self.sharded and (self.tensor_parallel_size is None or self.model_path is None):
            raise ValueError("sharded: true needs tensor_parallel_size (verl's rollout tensor_model_parallel_size) "
                             "and model_path (the local model directory the rollout serves)")
        return self

    @property
    def knobs(self) -> dict[str, Any]:
        """The deployment's knobs verl set."""
        return {name: value for name in ("bypass_cpu", "sparse", "staging", "keep_versions")
                if (value := getattr(self, name)) is not None}

    @classmethod
    def parse(cls, options: dict[str, Any]) -> VerlOptions:
        """``options`` checked; a ConfigError naming every bad key."""
        try:
            parsed = cls.model_validate(options)
        except ValidationError as exc:
            known = ", ".join(cls.model_fields)
            raise ConfigError("; ".join(
                f"{WHERE}.{'.'.join(map(str, e['loc'])) or '<options>'}: {e['msg']}"
                + (f" (got {e['input']!r})" if e["type"] != "extra_forbidden" else f" (known: {known})")
                for e in exc.errors())) from None
        check_knobs(parsed.knobs, WHERE)
        return parsed
