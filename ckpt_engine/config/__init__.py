"""The deployment: its YAML schema and environment overrides (``deployment``), read by the daemon and by the
framework adapters that share its knobs (``knobs``: a framework's values over the deployment's, checked by
the same rules)."""

from ckpt_engine.config.deployment import (
    ENV_PREFIX,
    EngineConfig,
    is_loopback,
    load_config,
    parse_config,
    parse_zmq_endpoint,
)

__all__ = ["ENV_PREFIX", "EngineConfig", "is_loopback", "load_config", "parse_config", "parse_zmq_endpoint"]
