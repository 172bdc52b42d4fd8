"""The knobs a framework (verl's ``engine_kwargs.ckpt_engine``) and the deployment (the daemon's YAML) both name,
and the one place that decides which value a framework's sync runs with.

The rule: a knob the framework sets wins (it is the job's own, as a ``POST /sync`` body's ``bypass_cpu`` wins
over the YAML's and a receiver's own ``staging`` over the deployment's); a knob it leaves unset takes the
deployment's value, which is its default where the YAML does not set it either. ``bypass_cpu`` and ``sparse``
go through :func:`ckpt_engine.plan.modes.resolve` like every request's: a deployment default yields to what
the framework asks (``bypass_cpu: true`` under a sparse deployment is a whole version). Values are validated as
the deployment's own: the :class:`~ckpt_engine.config.EngineConfig` fields give every type and bound.

With a daemon, the daemon settles each framework sync's knobs (its YAML is the deployment) and records them in
the version's ``knobs``; without one, the framework's side settles them against ``EngineConfig()`` (the same
defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ckpt_engine.config import EngineConfig
from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.modes import Mode, Staging, check_sparse, mode_of, resolve

# the knobs both sides name (EngineConfig's field names), in the order they are listed
KNOBS: tuple[str, ...] = ("bypass_cpu", "sparse", "staging", "bucket_size_mb", "keep_versions")
DEPLOYMENT, DEFAULT = "deployment", "default"  # where an unset knob's value came from (else: the framework's name)


def check_knobs(given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The knobs of ``given`` that are set (None: unset), validated as the deployment's YAML would be (strict: a
    "yes" is no bool, a "2" no int); a ConfigError naming ``where.<knob>`` otherwise."""
    unknown = sorted(set(given) - set(KNOBS))
    if unknown:
        raise ConfigError(f"{where}: unknown knob(s) {unknown}; known: {', '.join(KNOBS)}")
    chosen = {name: value for name, value in given.items() if value is not None}
    try:
        validated = EngineConfig.model_validate(chosen, strict=True)
    except ValidationError as exc:
        raise ConfigError("; ".join(f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})"
                                    for e in exc.errors())) from None
    out = {name: getattr(validated, name) for name in chosen}
    try:
        check_sparse(mode_of(out.get("bypass_cpu", False)), out.get("sparse", False))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return out


@dataclass(frozen=True)
class Settled:
    """What a framework's sync runs with, and why (``record``: per knob its value, where it came from, and the
    deployment's value where the framework's overrode it)."""

    bypass_cpu: bool
    sparse: bool
    staging: Staging
    bucket_size_mb: float
    keep_versions: int
    staging_share: float = 0.5  # how ``auto`` staging measures (the deployment's; no framework knob)
    staging_budget_mb: float | None = None
    record: dict[str, dict[str, Any]] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()  # one line per knob both sides set to different values

    @property
    def mode(self) -> Mode:
        return mode_of(self.bypass_cpu)

    @property
    def bucket_size(self) -> int:
        return int(self.bucket_size_mb * (1 << 20))

    @property
    def staging_budget(self) -> int | None:
        return int(self.staging_budget_mb * (1 << 20)) if self.staging_budget_mb else None

    def to_wire(self) -> dict[str, Any]:
        """For the framework's processes (the daemon's reply, actor rank 0's announcement)."""
        return {"bypass_cpu": self.bypass_cpu, "sparse": self.sparse, "staging": self.staging,
                "bucket_size_mb": self.bucket_size_mb, "keep_versions": self.keep_versions,
                "staging_share": self.staging_share, "staging_budget_mb": self.staging_budget_mb,
                "record": self.record, "overrides": list(self.overrides)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Settled:
        """What :meth:`to_wire` gave, checked again (it came from another process)."""
        values = check_knobs({k: data.get(k) for k in KNOBS}, "settled knobs")
        if set(values) != set(KNOBS):
            raise ConfigError(f"settled knobs lack {sorted(set(KNOBS) - set(values))}")
        rest = EngineConfig.model_validate({"staging_share": data.get("staging_share", 0.5),
                                            "staging_budget_mb": data.get("staging_budget_mb")})
        return cls(**values, staging_share=rest.staging_share, staging_budget_mb=rest.staging_budget_mb,
                   record=dict(data.get("record") or {}), overrides=tuple(data.get("overrides") or ()))


def settle(given: Mapping[str, Any], deployment: EngineConfig, *, framework: str = "verl",
           where: str = "engine_kwargs.ckpt_engine") -> Settled:
    """The knobs of a framework's sync: ``given`` (the framework's, None or absent: unset) over ``deployment``.
    A ConfigError naming the knob when a given value is invalid (or asks for both bypass_cpu and sparse)."""
    chosen = check_knobs(given, where)
    mode, sparse = resolve(chosen.get("bypass_cpu"), chosen.get("sparse"), default_bypass_cpu=deployment.bypass_cpu,
                           default_sparse=deployment.sparse)
    values = {"bypass_cpu": mode == "bypass_cpu", "sparse": sparse,
              **{name: chosen.get(name, getattr(deployment, name)) for name in ("staging", "bucket_size_mb",
                                                                                "keep_versions")}}
    if values["bucket_size_mb"] * (1 << 20) < deployment.alignment:  # (the deployment's own check: config.py)
        raise ConfigError(f"{where}.bucket_size_mb: {values['bucket_size_mb']} MiB is less than the deployment's "
                          f"alignment ({deployment.alignment} B)")
    record: dict[str, dict[str, Any]] = {}
    overrides = []
    for name in KNOBS:
        ours = getattr(deployment, name)
        in_yaml = name in deployment.model_fields_set
        entry: dict[str, Any] = {"value": values[name],
                                 "from": framework if name in chosen else DEPLOYMENT if in_yaml else DEFAULT}
        if name in chosen and in_yaml and chosen[name] != ours:
            entry["deployment"] = ours
            overrides.append(f"{framework}'s {name}={chosen[name]!r} overrides the deployment's {name}={ours!r} "
                             f"(the framework's setting wins; unset it in {where} to take the deployment's)")
        elif name not in chosen and values[name] != ours:  # a deployment default that yielded (see resolve)
            other = "sparse" if name == "bypass_cpu" else "bypass_cpu"
            entry["note"] = (f"the deployment's {name}={ours!r} yields to {framework}'s {other}="
                             f"{chosen.get(other)!r} (sparse works from the host cache, bypass_cpu skips it)")
        record[name] = entry
    return Settled(**values, staging_share=deployment.staging_share, staging_budget_mb=deployment.staging_budget_mb,
                   record=record, overrides=tuple(overrides))
