"""Engine configuration: YAML (``deploy/*.yaml``) loaded into typed models. Unknown keys and bad values are
errors at load time that name the key, never surprises later."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckpt_engine.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    connect_s: float = Field(30.0, gt=0, description="rendezvous of a sync group")
    collective_s: float = Field(60.0, gt=0, description="any single broadcast or allgather")
    ack_s: float = Field(120.0, gt=0, description="receivers' verify + load + acknowledgement")


class EngineConfig(_Strict):
    bypass_cpu: bool = Field(False, description="copy live params straight into the broadcast buffer (no cache)")
    bucket_size_mb: float = Field(512.0, gt=0, description="target bucket size in MiB")
    alignment: int = Field(256, ge=8, description="byte alignment of tensors inside a bucket (power of two)")
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    backend: Literal["auto", "nccl", "hccl", "gloo"] = "auto"
    keep_versions: int = Field(2, ge=1, description="versions kept in the host cache (cached mode)")
    verify: bool = Field(True, description="receivers recompute and compare every tensor digest before load")
    timeouts: Timeouts = Timeouts()

    @property
    def bucket_size(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))


def load_config(path: str | Path) -> EngineConfig:
    """Read a YAML file into an EngineConfig; any problem is a ConfigError naming the file and key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return parse_config(data, source=str(path))


def parse_config(data: dict, source: str = "config") -> EngineConfig:
    try:
        config = EngineConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{source}: {problems}") from None
    if config.alignment & (config.alignment - 1):
        raise ConfigError(f"{source}: alignment: must be a power of two, got {config.alignment}")
    return config
