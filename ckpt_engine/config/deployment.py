"""Engine configuration: YAML (``deploy/*.yaml``) loaded into typed models. Unknown keys, keys given twice,
bad values and settings that would only fail later (a bind address that is not one of this host's, a ZMQ
endpoint libzmq refuses, timeouts that contradict each other, two listeners on one port) are errors at load
time that name the key, never surprises later."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import socket
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckpt_engine.control.auth import DEFAULT_CREDENTIALS_FILE, Token
from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.modes import DEFAULT_STAGING, Staging, check_sparse, mode_of

DAY_S = 86400.0
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_WILDCARDS = ("0.0.0.0", "::", "*")


def _not_bool(value: object) -> object:
    # pydantic takes true for 1: in a config file that is a typo, not a number
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


def _timeout(default: float, description: str, minimum: float = 0.0) -> Any:
    # A day at most: larger values overflow timedelta / thread waits downstream and are typos anyway.
    bound = {"ge": minimum} if minimum else {"gt": 0}
    return Field(default, **bound, le=DAY_S, allow_inf_nan=False, description=description)


def check_host(host: str) -> str:
    """An IP address literal or a host name (RFC 1123)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.split(".")
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"{host!r} is neither an IP address nor a host name")
    return host


def check_bind_host(host: str) -> str:
    """A valid host that is an address of this machine: a socket is bound to it on port 0 and closed at once,
    so a name that does not resolve, or an address of another machine, fails here instead of at start."""
    check_host(host)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"{host!r} does not resolve here: {exc}") from None
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host!r} here: {exc.strerror}") from None
    return host


def parse_zmq_endpoint(endpoint: str) -> tuple[str, str, int | None]:
    """``tcp://HOST:PORT`` (HOST: ``*``, an IP, ``[IPv6]`` or a name; PORT: 0-65535 or ``*``) or ``ipc://PATH``;
    returns (transport, host or path, port or None for ``*`` and ipc)."""
    transport, sep, rest = endpoint.partition("://")
    if not sep or transport not in ("tcp", "ipc"):
        raise ValueError(f"must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    if transport == "ipc":
        return "ipc", _check_ipc_path(rest), None
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ValueError(f"a tcp endpoint needs a host and a port (tcp://127.0.0.1:8766), got {endpoint!r}")
    number = None if port == "*" else _check_port(port)
    if host.startswith("[") and host.endswith("]"):
        if not _is_ipv6(host[1:-1]):
            raise ValueError(f"{host} is not an IPv6 address")
        check_bind_host(host[1:-1])
    elif host != "*":
        if ":" in host:
            hint = "IPv6 addresses go in brackets (tcp://[::1]:8766)" if _is_ipv6(host) else "expected HOST:PORT"
            raise ValueError(f"{hint}, got {endpoint!r}")
        if host not in _interface_names():  # libzmq also binds to an interface by name (eth0)
            check_bind_host(host)
    return "tcp", host, number


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False


def _interface_names() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


def _check_port(port: str) -> int:
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"port must be 0-65535 or '*', got {port!r}")
    return int(port)


def _check_ipc_path(path: str) -> str:
    if not path or "\x00" in path:
        raise ValueError("an ipc endpoint needs a path (ipc:///run/ckpt-engine.sock)")
    if len(path.encode()) > 107:  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL
        raise ValueError(f"ipc path is {len(path.encode())} bytes, Unix sockets allow 107")
    if not path.startswith("@") and not Path(path).parent.is_dir():  # @: abstract namespace, no file
        raise ValueError(f"the directory of ipc path {path!r} does not exist")
    return path


def is_loopback(host: str) -> bool:
    """Whether a bind address keeps a port on this host (names other than localhost count as exposed)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    connect_s: Float = _timeout(30.0, "rendezvous of a sync group")
    collective_s: Float = _timeout(60.0, "any single broadcast or allgather")
    ack_s: Float = _timeout(120.0, "receivers' verify + load + acknowledgement")
    version_s: Float = _timeout(600.0, "a whole version, from request to commit, in the daemon")
    # Agents poll about once a second: a shorter limit would mark live agents gone.
    heartbeat_s: Float = _timeout(10.0, "an agent silent this long is marked gone", minimum=1.0)


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: Int = Field(8765, ge=0, le=65535)
    # at least 1 KiB: the API's own bodies (POST /sync) must fit
    max_body_bytes: Int = Field(64 << 10, ge=1 << 10, le=1 << 30)
    # Slow and idle clients (server/connections.py): uvicorn itself waits for ever for a request's head
    header_timeout_s: Float = _timeout(10.0, "a request's line and headers must arrive within this, counted from "
                                             "the connection (or the previous response on it); then it is closed")
    body_timeout_s: Float = _timeout(30.0, "a request's body must arrive within this, counted from its headers")
    max_connections: Int = Field(512, ge=4, le=1 << 16, description="open HTTP connections at most (fewer where the "
                                 "open-file limit leaves less); past it the oldest connection waiting for a request "
                                 "is closed to make room")

    _host = field_validator("host")(check_bind_host)


class ZmqConfig(_Strict):
    endpoint: str = "tcp://127.0.0.1:8766"
    # at least 64 KiB: a trainer's report lists every receiver's acknowledgement
    max_frame_bytes: Int = Field(1 << 20, ge=64 << 10, le=1 << 30)
    handshake_timeout_s: Float = _timeout(10.0, "a connection's ZMTP handshake must end within this "
                                                "(ZMQ_HANDSHAKE_IVL)")
    # each agent holds two connections (its polls and its reports): the default fits max_agents' default
    max_peers: Int = Field(8192, ge=4, le=1 << 20, description="open ZMQ connections at most (fewer where the "
                           "open-file limit leaves less); past it the daemon closes the connection that has sent no "
                           "authenticated message for longest")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        parse_zmq_endpoint(value)
        return value


class StoreConfig(_Strict):
    history_path: str = Field("ckpt-engine-history.sqlite3", min_length=1)
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: Int = Field(8767, ge=0, le=65535)
    lock_wait_s: Float = Field(0.0, ge=0, le=DAY_S, allow_inf_nan=False,
                               description="how long a daemon waits for another that holds the same history")

    _host = field_validator("rendezvous_host")(check_bind_host)  # the store listens there (agents connect to it)

    @field_validator("history_path")
    @classmethod
    def _history_path(cls, value: str) -> str:
        if os.path.isdir(value):
            raise ValueError(f"{value!r} is a directory; name the SQLite file")
        return value


class AuthConfig(_Strict):
    """Per-role tokens (see ckpt_engine/control/auth.py). Roles without a token here get one generated once and
    kept in ``credentials_file`` (mode 0600), where local clients of the same user find them."""

    open: bool = Field(False, description="no authentication at all: anyone who reaches a port is operator, "
                                         "trainer and rollout (development only)")
    credentials_file: str = Field(DEFAULT_CREDENTIALS_FILE, min_length=1, max_length=4096)
    operator_token: Token | None = None
    trainer_token: Token | None = None
    rollout_token: Token | None = None

    @model_validator(mode="after")
    def _one_token_per_role(self) -> AuthConfig:
        # A token shared by two roles (a copy-paste slip) would let every rollout host act as the operator.
        given = [(role, getattr(self, f"{role}_token")) for role in ("operator", "trainer", "rollout")]
        for index, (role, token) in enumerate(given):
            for other, same in given[index + 1:]:
                if token is not None and token == same:
                    raise ValueError(f"auth.{role}_token and auth.{other}_token are the same token: a holder of one "
                                     "could act as both; give each role its own")
        return self


class EngineConfig(_Strict):
    bypass_cpu: bool = Field(False, description="copy live params straight into the broadcast buffer (no cache)")
    bucket_size_mb: Float = Field(512.0, gt=0, le=64 << 10, allow_inf_nan=False,
                                  description="target bucket size in MiB")
    alignment: Int = Field(256, ge=8, le=1 << 20,
                           description="byte alignment of tensors inside a bucket (power of two)")
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    backend: Literal["auto", "nccl", "hccl", "gloo"] = "auto"
    keep_versions: Int = Field(2, ge=1, le=1024, description="versions kept in the host cache (cached mode)")
    verify: bool = Field(True, description="receivers recompute and compare every tensor digest before load")
    sparse: bool = Field(False, description="send only tensors changed since the version every receiver holds")
    min_receivers: Int = Field(1, ge=1, le=1 << 16, description="receivers that must commit for a version to commit")
    max_agents: Int = Field(4096, ge=2, le=1 << 16, description="registered agents at most (each holds daemon "
                                                                  "memory; a register past it is refused)")
    staging: Staging = Field(DEFAULT_STAGING, description="where a receiver holds a version before it is applied: "
                             "device (whole, on the device), host (whole, in pinned host memory), stream (two buckets, "
                             "applied as each verifies, the engine paused for the transfer), auto (the first that "
                             "fits staging_share of free memory, per version)")
    staging_share: Float = Field(0.5, gt=0, le=1, allow_inf_nan=False,
                                 description="the part of free memory auto staging may take")
    staging_budget_mb: Float | None = Field(None, gt=0, le=1 << 30, allow_inf_nan=False,
                                            description="MiB auto staging considers free, instead of measuring")
    transport: Literal["auto", "collective", "ipc", "nixl"] = Field(
        "auto", description="auto: shared memory for receivers on the sender's host, the collective for others; "
                            "nixl: every receiver pulls cached versions from the trainer over NIXL")
    nixl_trust_receivers: bool = Field(
        False, description="required with transport nixl: over UCX's software transports (TCP, shared memory) a "
                           "puller can read any memory of the trainer's process, so every receiver must be as "
                           "trusted as the trainer (docs/security.md)")
    auth_token: Token | None = Field(None, description="one token for every role (older deployments; roles are "
                                                       "then not separated: prefer auth.*_token)")
    auth: AuthConfig = AuthConfig()
    timeouts: Timeouts = Timeouts()
    http: HttpConfig = HttpConfig()
    zmq: ZmqConfig = ZmqConfig()
    store: StoreConfig = StoreConfig()

    @property
    def bucket_size(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))

    @model_validator(mode="after")
    def _nixl_is_trusted(self) -> EngineConfig:
        if self.transport == "nixl" and not self.nixl_trust_receivers:
            raise ValueError("transport nixl lets every receiver read any memory of the trainer's process over "
                             "UCX's software transports (TCP, shared memory), its tokens included; set "
                             "nixl_trust_receivers: true only where every receiver is as trusted as the trainer "
                             "(docs/security.md, 'What is not protected')")
        return self


ENV_PREFIX = "CKPT_ENGINE_"
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the same safe constructors, in C when libyaml is there


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Read a YAML file into an EngineConfig, then apply ``CKPT_ENGINE_<KEY>`` overrides from the environment
    (``__`` separates nested keys: ``CKPT_ENGINE_HTTP__PORT=9000``). Any problem is a ConfigError naming the
    file (or variable) and the key."""
    path = Path(path)
    try:
        loader = _Loader(path.read_text())
        try:
            node = loader.get_single_node()
            duplicates = _duplicate_keys(node)
            data = (loader.construct_document(node) if node is not None else None) or {}
        finally:
            loader.dispose()
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    if duplicates:  # PyYAML would silently keep the last value
        raise ConfigError(f"{path}: " + "; ".join(f"{key}: given more than once" for key in duplicates))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    sources = apply_env_overrides(data, os.environ if environ is None else environ)
    return parse_config(data, source=" + ".join([str(path), *sources]))


# The project's other CKPT_ENGINE_ variables (the CLI's and agents', the digest's, the scripts'): never overrides
OTHER_VARIABLES = frozenset(ENV_PREFIX + name for name in (
    "TOKEN", "CREDENTIALS", "URL", "ENDPOINT", "AGENT_ENDPOINT", "DIGEST_KERNEL", "VLLM_TRACEBACKS", "VENV",
    "ENGINES_VENV", "TOOLS_VENV", "VERL_VENV", "TORCH", "VERL", "VLLM"))


def _misnamed_overrides(environ: Mapping[str, str], names: Collection[str]) -> list[str]:
    """``CKPT_ENGINE_`` variables that look like a config key's override but name none (a typo would otherwise
    be ignored while the same typo in the YAML is refused): nested (``__``) ones, and those close to a key's
    name. The prefix is shared with other settings (the CLI's, the scripts'), which are left alone."""
    out = []
    for name in environ:
        if not name.startswith(ENV_PREFIX) or name in names or name in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
        if "__" in name or close:
            out.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return sorted(out)


def apply_env_overrides(data: dict, environ: Mapping[str, str]) -> list[str]:
    """Overlay environment variables that name a config key; returns the variables used. One that looks like an
    override but names no key is an error, as an unknown key in the file is."""
    names = {ENV_PREFIX + dotted.replace(".", "__").upper(): dotted for dotted in _key_paths(EngineConfig)}
    misnamed = _misnamed_overrides(environ, names)
    if misnamed:
        raise ConfigError(f"environment: {', '.join(misnamed)}: no such config key (overrides are "
                          f"{ENV_PREFIX}<KEY>, nested keys joined by __, e.g. {ENV_PREFIX}HTTP__PORT)")
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
        try:  # text settings verbatim: a token of digits, or one starting with '*' or '!', is still text
            node[leaf] = environ[name] if dotted in _TEXT_KEYS else yaml.safe_load(environ[name])
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: unreadable value: {exc}") from exc
        used.append(name)
    return used


def _duplicate_keys(node: yaml.Node | None, prefix: str = "", seen: set[int] | None = None) -> list[str]:
    """Key paths given twice in one mapping of a composed YAML document."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:  # aliases may point back up the tree
        return []
    seen.add(id(node))
    found: list[str] = []
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            if key in keys and key != "<<":
                found.append(prefix + key)
            keys.add(key)
            found += _duplicate_keys(value_node, f"{prefix}{key}.", seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{prefix}{index}.", seen)
    return found


def _text_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for key, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= _text_keys(annotation, f"{prefix}{key}.")
        elif _is_text(annotation):
            keys.add(prefix + key)
    return keys


def _is_text(annotation: Any) -> bool:
    """``str``, possibly Annotated and/or Optional."""
    if annotation is str:
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _is_text(args[0])
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1 and _is_text(args[0])


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
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{source}: {errors}") from None
    problems = _inconsistencies(config)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return config


_BACKEND_OF = {"cuda": "nccl", "npu": "hccl"}


def _inconsistencies(config: EngineConfig) -> list[str]:
    """Settings that are each valid but do not work together; every message names the keys."""
    problems = []
    if config.alignment & (config.alignment - 1):
        problems.append(f"alignment: must be a power of two, got {config.alignment}")
    if config.bucket_size < config.alignment:
        problems.append(f"bucket_size_mb: {config.bucket_size_mb} MiB is less than alignment ({config.alignment} B)")
    try:
        check_sparse(mode_of(config.bypass_cpu), config.sparse)
    except ConfigError as exc:
        problems.append(f"sparse: {exc}")
    if config.backend in ("nccl", "hccl") and config.device in ("cpu", "cuda", "npu") and \
            _BACKEND_OF.get(config.device) != config.backend:
        problems.append(f"backend: {config.backend} does not run on device {config.device}")
    timeouts = config.timeouts
    for key in ("connect_s", "collective_s", "ack_s"):
        if getattr(timeouts, key) > timeouts.version_s:
            problems.append(f"timeouts.version_s: {timeouts.version_s:g} s is shorter than timeouts.{key} "
                            f"({getattr(timeouts, key):g} s), which is one part of a version")
    problems += _port_clashes(config)
    return problems


def _port_clashes(config: EngineConfig) -> list[str]:
    transport, zmq_host, zmq_port = parse_zmq_endpoint(config.zmq.endpoint)
    binds = [("http.port", config.http.host, config.http.port),
             ("store.rendezvous_port", config.store.rendezvous_host, config.store.rendezvous_port)]
    if transport == "tcp" and zmq_port is not None:
        binds.append(("zmq.endpoint", zmq_host, zmq_port))
    problems = []
    for i, (key_a, host_a, port_a) in enumerate(binds):
        for key_b, host_b, port_b in binds[i + 1:]:
            if port_a and port_a == port_b and _may_share(host_a, host_b):
                problems.append(f"{key_a}: port {port_a} is also {key_b}'s")
    return problems


def _may_share(a: str, b: str) -> bool:
    """Whether two bind hosts can collide on a port (the same address, a wildcard, or both loopback)."""
    a, b = a.strip("[]"), b.strip("[]")
    return a == b or a in _WILDCARDS or b in _WILDCARDS or (is_loopback(a) and is_loopback(b))


_TEXT_KEYS = _text_keys(EngineConfig)
