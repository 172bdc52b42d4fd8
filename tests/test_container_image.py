"""The image and the manifests against the project itself, without building anything: the Containerfile's entry
point is an installed script, its CMD and HEALTHCHECK parse with the real CLI, the config it bakes loads and
listens where EXPOSE says, its ENV names real config keys; the Kubernetes sidecar and the systemd unit run real
commands with real keys. (Building the image needs a registry for the base image: docs/deploy.md.) Plus
``ckpt-engine health`` against a real daemon (the HEALTHCHECK's command)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ckpt_engine.cli.main import _parser, health_url
from ckpt_engine.config.deployment import (
    ENV_PREFIX,
    EngineConfig,
    _key_paths,
    load_config,
    parse_config,
    parse_zmq_endpoint,
)
from ckpt_engine.control.auth import TOKEN_ENV
from tests.daemon_harness import ROOT, start_daemon, write_config

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

CONTAINERFILE = ROOT / "Containerfile"
MANIFEST = ROOT / "deploy" / "k8s-sidecar.yaml"
UNIT = ROOT / "deploy" / "ckpt-engine.service"
CONFIG_KEYS = {ENV_PREFIX + path.replace(".", "__").upper() for path in _key_paths(EngineConfig)}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    found, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
        pending = ""
    return found


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(item, str) for item in value), arguments
    return value


STEPS = instructions(CONTAINERFILE.read_text())


def only(keyword: str) -> str:
    matches = [rest for key, rest in STEPS if key == keyword]
    assert len(matches) == 1, (keyword, matches)
    return matches[0]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for key, rest in STEPS:
        if key == "ENV":
            env.update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
    return env


def baked_config() -> tuple[Path, str]:
    """(the repository file the image copies to the config path its CMD names, that path)."""
    for key, rest in STEPS:
        if key == "COPY" and rest.split()[-1] == "/etc/ckpt-engine/engine.yaml":
            return ROOT / rest.split()[0], rest.split()[-1]
    raise AssertionError("the Containerfile bakes no /etc/ckpt-engine/engine.yaml")


def test_entry_point_is_the_installed_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = exec_form(only("ENTRYPOINT"))
    assert entry == ["ckpt-engine"] and scripts["ckpt-engine"] == "ckpt_engine.cli.main:main"


def test_cmd_and_healthcheck_parse_with_the_real_cli_and_name_the_baked_config() -> None:
    source, target = baked_config()
    serve = _parser().parse_args(exec_form(only("CMD")))
    assert serve.command == "serve" and serve.config == target
    health_step = only("HEALTHCHECK")
    assert "--interval=" in health_step and "--timeout=" in health_step
    command = exec_form(health_step.split(" CMD ", 1)[1].strip())
    assert command[0] == "ckpt-engine"
    health = _parser().parse_args(command[1:])
    assert health.command == "health" and health.config == target
    assert source.is_file()


def test_the_baked_config_listens_where_the_image_exposes() -> None:
    source, _ = baked_config()
    config = load_config(source, environ=image_env())  # what `serve` reads in the image
    assert config.http.host == "0.0.0.0"  # 127.0.0.1 would be the container's own loopback: -p could not reach it
    transport, zmq_host, zmq_port = parse_zmq_endpoint(config.zmq.endpoint)
    assert transport == "tcp" and zmq_host in ("0.0.0.0", "*")
    exposed = {int(port) for port in only("EXPOSE").split()}
    assert exposed == {config.http.port, zmq_port, config.store.rendezvous_port}
    assert config.store.history_path.startswith("/var/lib/ckpt-engine/")
    assert config.auth.credentials_file.startswith("/var/lib/ckpt-engine/") and not config.auth.open
    assert only("VOLUME") == "/var/lib/ckpt-engine"
    assert health_url(config) == f"http://127.0.0.1:{config.http.port}"


def test_env_names_config_keys_and_build_args_are_used() -> None:
    assert set(image_env()) <= CONFIG_KEYS, set(image_env()) - CONFIG_KEYS
    args = {rest.split("=")[0] for key, rest in STEPS if key == "ARG"}
    assert {"PYTHON_IMAGE", "VARIANT", "TORCH_VERSION", "TORCH_INDEX_URL"} <= args
    text = CONTAINERFILE.read_text()
    for arg in args:
        assert f"${{{arg}" in text or f"${arg}" in text, f"ARG {arg} is never used"
    install = next(rest for key, rest in STEPS if key == "RUN" and "torch==" in rest)
    assert "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" in install  # a build argument, not fixed
    setup_torch = re.search(r"torch==([\w.+]+)", (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert f"ARG TORCH_VERSION={setup_torch}" in text  # the same torch as the venvs


def test_everything_the_package_needs_is_copied_and_not_ignored() -> None:
    package_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
                       .values())
    copied = {name for key, rest in STEPS if key == "COPY" for name in rest.split()[:-1]}  # (the last: where)
    assert package_dirs <= copied and {"pyproject.toml", "README.md"} <= copied
    ignored = [line.strip() for line in (ROOT / ".containerignore").read_text().splitlines() if line.strip()]
    for name in copied:
        assert (ROOT / name).exists(), name
        assert not any(Path(name).match(pattern) or name == pattern for pattern in ignored), (name, ignored)


def _k8s() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def _kind(kind: str) -> dict:
    return next(doc for doc in _k8s() if doc["kind"] == kind)


def test_sidecar_runs_the_image_as_built_with_real_keys_and_probes() -> None:
    pod = _kind("Pod")
    daemon = next(c for c in pod["spec"]["containers"] if c["name"] == "ckpt-engine")
    args = _parser().parse_args(daemon["args"])
    mount = next(m for m in daemon["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert args.command == "serve" and Path(args.config).parent == Path(mount)
    config_text = _kind("ConfigMap")["data"][Path(args.config).name]
    env_names = {item["name"] for item in daemon["env"]}
    assert env_names <= CONFIG_KEYS, env_names - CONFIG_KEYS
    # the ConfigMap as serve reads it in the pod (the pod IP comes from the env: any address of this host here)
    config = parse_config({**yaml.safe_load(config_text)})
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports == {"http": config.http.port, "zmq": parse_zmq_endpoint(config.zmq.endpoint)[2],
                     "rendezvous": config.store.rendezvous_port}
    assert {p["port"] for p in _kind("Service")["spec"]["ports"]} == set(ports.values())
    for probe in ("readinessProbe", "livenessProbe"):  # docs/daemon.md: a 503 on /health means restart it
        assert daemon[probe]["httpGet"] == {"path": "/health", "port": config.http.port}, probe
    assert daemon["livenessProbe"]["timeoutSeconds"] <= 1  # /health answers within 1 s under load (test_trust)
    uid = re.search(r"--uid (\d+)", CONTAINERFILE.read_text()).group(1)
    assert daemon["securityContext"]["runAsUser"] == int(uid) and f"USER {uid}" in CONTAINERFILE.read_text()


def test_secret_keys_are_the_ones_the_comment_creates_and_every_env_is_read() -> None:
    pod = _kind("Pod")
    used = {item["valueFrom"]["secretKeyRef"]["key"] for c in pod["spec"]["containers"] for item in c.get("env", [])
            if "secretKeyRef" in item.get("valueFrom", {})}
    created = set(re.findall(r"--from-literal=(\w+)=", MANIFEST.read_text()))
    assert used == created == {"operator_token", "trainer_token", "rollout_token"}
    assert "kubectl create secret generic ckpt-engine" in MANIFEST.read_text()
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    # what the trainer container is given, code reads: its agent's token (the endpoint is train.py's argument)
    assert {item["name"] for item in trainer["env"]} <= {TOKEN_ENV}


def test_systemd_unit_runs_a_real_command() -> None:
    line = next(line for line in UNIT.read_text().splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert Path(argv[0]).name == "ckpt-engine"
    assert _parser().parse_args(argv[1:]).command == "serve"
    env = [line.removeprefix("Environment=").split("=", 1)[0] for line in UNIT.read_text().splitlines()
           if line.startswith("Environment=")]
    assert set(env) <= CONFIG_KEYS


@pytest.mark.parametrize("host, url", [
    ("127.0.0.1", "http://127.0.0.1:8765"),
    ("0.0.0.0", "http://127.0.0.1:8765"),
    ("::", "http://[::1]:8765"),
    ("::1", "http://[::1]:8765"),
    ("localhost", "http://localhost:8765"),
])
def test_health_url_reaches_a_wildcard_bind_by_loopback(host: str, url: str) -> None:
    config = EngineConfig.model_construct(http=EngineConfig().http.model_copy(update={"host": host}))
    assert health_url(config) == url


@pytest.mark.multiproc
def test_health_command_against_a_real_daemon(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    command = [sys.executable, "-m", "ckpt_engine.cli", "health", "--config", str(config), "--timeout", "10"]
    daemon = start_daemon(config)
    try:
        up = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert up.returncode == 0 and '"ok": true' in up.stdout, (up.stdout, up.stderr)
    finally:
        assert daemon.stop() == 0
    down = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert down.returncode == 3 and "cannot reach the daemon" in down.stderr, (down.stdout, down.stderr)
