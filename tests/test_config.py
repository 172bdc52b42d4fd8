"""Deployment YAML: the shipped file loads; bad keys and values fail at load, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.config import load_config, parse_config
from ckpt_engine.errors import ConfigError

DEPLOY = Path(__file__).parents[1] / "deploy" / "engine.yaml"


def test_shipped_deploy_file_loads() -> None:
    config = load_config(DEPLOY)
    assert config.bypass_cpu is False and config.bucket_size == 512 << 20 and config.timeouts.ack_s == 120


def test_bypass_cpu_toggle(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("bypass_cpu: true\n")
    assert load_config(path).bypass_cpu is True


@pytest.mark.parametrize("data, key", [
    ({"bypass_cpu": "maybe"}, "bypass_cpu"),
    ({"bucket_size_mb": 0}, "bucket_size_mb"),
    ({"keep_versions": 0}, "keep_versions"),
    ({"device": "tpu"}, "device"),
    ({"timeouts": {"ack_s": -1}}, "timeouts.ack_s"),
    ({"timeouts": {"typo_s": 1}}, "timeouts.typo_s"),
    ({"bucket_sise_mb": 5}, "bucket_sise_mb"),
    ({"alignment": 384}, "alignment"),
])
def test_bad_values_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(data)


def test_unreadable_or_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


@pytest.mark.parametrize("path", sorted(DEPLOY.parent.glob("engine*.yaml")), ids=lambda p: p.name)
def test_every_engine_yaml_in_deploy_loads(path: Path) -> None:
    config = load_config(path, environ={})
    assert config.bypass_cpu == ("bypass" in path.name)


def test_environment_overrides_nested_keys(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("http: {port: 1}\n")
    config = load_config(path, environ={"CKPT_ENGINE_HTTP__PORT": "9000", "CKPT_ENGINE_BYPASS_CPU": "true",
                                       "CKPT_ENGINE_TORCH": "not a config key"})
    assert config.http.port == 9000 and config.bypass_cpu is True
    with pytest.raises(ConfigError, match="CKPT_ENGINE_KEEP_VERSIONS"):
        load_config(path, environ={"CKPT_ENGINE_KEEP_VERSIONS": "zero"})


def test_sparse_can_be_switched_on() -> None:
    assert parse_config({"sparse": True}).sparse is True


@pytest.mark.parametrize("variable, hint", [
    ("CKPT_ENGINE_BYPASSCPU", "did you mean CKPT_ENGINE_BYPASS_CPU?"),
    ("CKPT_ENGINE_AUTH__OPERATR_TOKEN", "did you mean CKPT_ENGINE_AUTH__OPERATOR_TOKEN?"),
    ("CKPT_ENGINE_TIMEOUTS__NOPE_S", "no such config key"),
])
def test_an_override_naming_no_key_is_refused_as_a_typo_in_the_file_is(tmp_path: Path, variable: str,
                                                                        hint: str) -> None:
    """(outside attack) Typos in environment overrides were ignored while the same typo in the YAML is refused.
    The project's other CKPT_ENGINE_ variables (the CLI's token, the scripts' venvs) are left alone."""
    path = tmp_path / "engine.yaml"
    path.write_text("bucket_size_mb: 4\n")
    with pytest.raises(ConfigError, match=f"{variable}.*{hint}"):
        load_config(path, {variable: "true"})
    others = {"CKPT_ENGINE_TOKEN": "t" * 40, "CKPT_ENGINE_VENV": "/v", "CKPT_ENGINE_DIGEST_KERNEL": "eager",
              "CKPT_ENGINE_CREDENTIALS": "/c", "CKPT_ENGINE_BYPASS_CPU": "true"}
    assert load_config(path, others).bypass_cpu is True


def test_transport_nixl_needs_receivers_trusted_with_the_trainers_memory() -> None:
    """Found by the outside attack on issue 39: over UCX's TCP and shared-memory transports a puller can read (or
    crash on) any address of the trainer's process, its tokens included. The deployment must say it trusts its
    receivers that far."""
    with pytest.raises(ConfigError, match="nixl_trust_receivers"):
        parse_config({"transport": "nixl"})
    assert parse_config({"transport": "nixl", "nixl_trust_receivers": True}).transport == "nixl"
    assert parse_config({"nixl_trust_receivers": True}).transport == "auto"  # (no effect on other transports)
