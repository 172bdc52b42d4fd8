"""Engine configuration: YAML (``deploy/*.yaml``) loaded into typed models. Unknown keys and bad values are
errors at load time that name the key, never surprises later."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckpt_engine.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    connect_s: float = Field(30.0, gt=0, description="rendezvous of a sync group")
    collective_s: float = Field(60.0, gt=0, description="any single broadcast or allgather")
    ack_s: float = Field(120.0, gt=0, description="receivers' verify + load + acknowledgement")
    version_s: float = Field(600.0, gt=0, description="a whole version, from request to commit, in the daemon")
    heartbeat_s: float = Field(10.0, gt=0, description="an agent silent this long is marked gone")


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535)
    max_body_bytes: int = Field(64 << 10, gt=0)


class ZmqConfig(_Strict):
    endpoint: str = Field("tcp://127.0.0.1:8766", pattern=r"^(tcp|ipc)://.+")
    max_frame_bytes: int = Field(1 << 20, gt=0)


class StoreConfig(_Strict):
    history_path: str = "ckpt-engine-history.sqlite3"
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = Field(8767, ge=0, le=65535)


class EngineConfig(_Strict):
    bypass_cpu: bool = Field(False, description="copy live params straight into the broadcast buffer (no cache)")
    bucket_size_mb: float = Field(512.0, gt=0, description="target bucket size in MiB")
    alignment: int = Field(256, ge=8, description="byte alignment of tensors inside a bucket (power of two)")
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    backend: Literal["auto", "nccl", "hccl", "gloo"] = "auto"
    keep_versions: int = Field(2, ge=1, description="versions kept in the host cache (cached mode)")
    verify: bool = Field(True, description="receivers recompute and compare every tensor digest before load")
    sparse: bool = Field(False, description="send only tensors changed since the version every receiver holds")
    min_receivers: int = Field(1, ge=0, description="receivers that must commit for a version to commit")
    transport: Literal["auto", "collective", "ipc"] = Field(
        "auto", description="auto: shared memory for receivers on the sender's host, the collective for others")
    auth_token: str | None = Field(None, min_length=16, description="bearer token for HTTP and agents")
    timeouts: Timeouts = Timeouts()
    http: HttpConfig = HttpConfig()
    zmq: ZmqConfig = ZmqConfig()
    store: StoreConfig = StoreConfig()

    @property
    def bucket_size(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))


ENV_PREFIX = "CKPT_ENGINE_"


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Read a YAML file into an EngineConfig, then apply ``CKPT_ENGINE_<KEY>`` overrides from the environment
    (``__`` separates nested keys: ``CKPT_ENGINE_HTTP__PORT=9000``). Any problem is a ConfigError naming the
    file (or variable) and the key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    sources = apply_env_overrides(data, os.environ if environ is None else environ)
    return parse_config(data, source=" + ".join([str(path), *sources]))


def apply_env_overrides(data: dict, environ: Mapping[str, str]) -> list[str]:
    """Overlay environment variables that name a config key; returns the variables used."""
    used = []
    for dotted in _key_paths(EngineConfig):
        name = ENV_PREFIX + dotted.replace(".", "__").upper()
        if name not in environ:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: cannot override {dotted}: {key} is not a mapping in the file")
        try:
            node[leaf] = yaml.safe_load(environ[name])
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: unreadable value: {exc}") from exc
        used.append(name)
    return used


def _key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for key, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _key_paths(annotation, f"{prefix}{key}.")
        else:
            paths.append(prefix + key)
    return paths


def parse_config(data: dict, source: str = "config") -> EngineConfig:
    try:
        config = EngineConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{source}: {problems}") from None
    if config.alignment & (config.alignment - 1):
        raise ConfigError(f"{source}: alignment: must be a power of two, got {config.alignment}")
    return config
