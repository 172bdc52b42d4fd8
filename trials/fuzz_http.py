"""Schemathesis against the real daemon's HTTP API: the schema comes from the live ``/openapi.json``, cases
are generated from it (examples, coverage of boundaries and invalid values, random fuzzing) and every
response is checked: no 5xx, status code and content type declared for the operation, body valid against
the declared schema, unsupported methods get 405 with an ``Allow`` header, auth is enforced, and so on
(schemathesis' default checks).

The daemon runs with an auth token and no agents: ``POST /sync`` then refuses with 503 and records a failed
version, by design, so 503 is an expected status for that operation only. Generation is deterministic
(derandomized, fixed seed): a run with the same ``--cases`` repeats the same requests.

    python -m ckpt_engine.trials.fuzz_http [--cases 200] [--seed 0] [--json bench/results/fuzz_http.json]

:func:`run_fuzz` is also what tests/test_fuzz_http.py runs, with fewer cases.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpt_engine.server.launch import REPO

RESULT = REPO / "bench" / "results" / "fuzz_http.json"
TOKEN = "fuzz-http-token-0123456789abcdef"
PHASES = ("examples", "coverage", "fuzzing")
# The one 5xx that is by design: a version refused for lack of agents (recorded in history as failed).
EXPECTED_5XX = {"POST /sync": (503,)}


@dataclass
class FuzzSummary:
    base_url: str
    authenticated: bool
    seed: int
    max_examples: int
    elapsed_s: float = 0.0
    stop_reason: str = ""
    cases: int = 0
    operations: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> {cases, statuses}
    statuses: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0  # every 5xx, the expected 503s included
    unexpected_server_errors: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # engine errors (schema problems, network)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.errors and self.unexpected_server_errors == 0


def schemathesis_config(*, token: str | None, max_examples: int, seed: int, phases: tuple[str, ...] = PHASES):
    import schemathesis

    enabled = {name: {"enabled": name in phases} for name in ("examples", "coverage", "fuzzing", "stateful")}
    return schemathesis.Config.from_dict({
        "seed": seed,
        "headers": {"Authorization": f"Bearer {token}"} if token else {},
        "generation": {"max-examples": max_examples, "mode": "all", "deterministic": True, "database": "none"},
        "phases": enabled,
        "cache": {"enabled": False},
        "operations": [{"include-path": "/sync", "include-method": "POST", "checks": {
            "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx",
                                                         *map(str, EXPECTED_5XX["POST /sync"])]}}}],
    })


def run_fuzz(base_url: str, *, token: str | None, max_examples: int, seed: int = 0, phases: tuple[str, ...] = PHASES,
             send_token: bool = True) -> FuzzSummary:
    """Load ``base_url``/openapi.json (with ``token``: the schema is behind it too) and run schemathesis'
    engine over every operation; the cases carry the token only with ``send_token``."""
    import schemathesis
    from schemathesis.engine import events, from_schema

    sent = token if send_token else None
    config = schemathesis_config(token=sent, max_examples=max_examples, seed=seed, phases=phases)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config, headers=headers, timeout=30)
    schema.hook("filter_failure")(_keep_failure)
    summary = FuzzSummary(base_url, sent is not None, seed, max_examples)
    started = time.monotonic()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            _record(summary, event.recorder)
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            summary.errors.append(_engine_error(event))
        elif isinstance(event, events.EngineFinished):
            summary.stop_reason = str(event.stop_reason)
    summary.elapsed_s = round(time.monotonic() - started, 2)
    summary.statuses = dict(sorted(summary.statuses.items()))
    return summary


def _keep_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """Every failure but a 422 for integers spelled as whole floats (``{"step": 2.0}``): JSON Schema counts 2.0
    as an integer, and schemathesis sends such spellings of JSON integers on purpose; the daemon refuses them
    (strict bodies, docs/daemon.md), which no schema keyword can say."""
    return not _whole_floats_refused(case.body, response)


def _whole_floats_refused(body: Any, response: Any) -> bool:
    if response.status_code != 422 or not isinstance(body, dict):
        return False
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        return False
    if not isinstance(detail, list) or not detail:
        return False
    for problem in detail:
        loc = problem.get("loc") if isinstance(problem, dict) else None
        if not isinstance(loc, list) or len(loc) != 2 or loc[0] != "body" or problem.get("msg") != \
                "Input should be a valid integer":
            return False
        value = body.get(loc[1])
        if not (isinstance(value, float) and value.is_integer()):
            return False
    return True


def _record(summary: FuzzSummary, recorder: Any) -> None:
    label = recorder.label
    operation = summary.operations.setdefault(label, {"cases": 0, "statuses": {}})
    for interaction in recorder.interactions.values():
        status = str(interaction.response.status_code) if interaction.response is not None else "no response"
        summary.cases += 1
        operation["cases"] += 1
        operation["statuses"][status] = operation["statuses"].get(status, 0) + 1
        summary.statuses[status] = summary.statuses.get(status, 0) + 1
        if status.startswith("5"):
            summary.server_errors += 1
            if int(status) not in EXPECTED_5XX.get(label, ()):
                summary.unexpected_server_errors += 1
    for checks in recorder.checks.values():
        for check in checks:
            if check.failure_info is not None:
                failure = check.failure_info.failure
                summary.failures.append({"operation": label, "check": check.name, "title": failure.title,
                                         "message": failure.message, "reproduce": check.failure_info.code_sample})


def _engine_error(event: Any) -> str:
    if hasattr(event, "info"):
        return f"{event.label}: {event.info.title}: {event.info.message}"
    return f"fatal: {type(event.exception).__name__}: {event.exception}"


def format_summary(summary: FuzzSummary) -> str:
    lines = [f"schemathesis on {summary.base_url} ({'with' if summary.authenticated else 'without'} token, "
             f"max-examples {summary.max_examples}, seed {summary.seed}): {summary.cases} cases in "
             f"{summary.elapsed_s:.1f} s, stop: {summary.stop_reason}",
             f"  statuses: {summary.statuses}",
             f"  5xx: {summary.server_errors} (unexpected: {summary.unexpected_server_errors}); "
             f"check failures: {len(summary.failures)}; engine errors: {len(summary.errors)}"]
    for label, operation in sorted(summary.operations.items()):
        lines.append(f"  {label:<32} {operation['cases']:>6} cases  {dict(sorted(operation['statuses'].items()))}")
    for failure in summary.failures:
        lines.append(f"  FAILURE {failure['operation']} [{failure['check']}] {failure['title']}: "
                     f"{failure['message']}\n    {failure['reproduce']}")
    lines += [f"  ERROR {error}" for error in summary.errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_engine.trials.fuzz_http",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="generated cases per operation and phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=RESULT, help="where to write the summary")
    args = parser.parse_args(argv)
    from ckpt_engine.server.launch import start_daemon, write_config

    with tempfile.TemporaryDirectory(prefix="ckpt-fuzz-http-") as tmp:
        daemon = start_daemon(write_config(Path(tmp), auth_token=TOKEN))
        try:
            summary = run_fuzz(daemon.url, token=TOKEN, max_examples=args.cases, seed=args.seed)
            with daemon.client() as client:
                alive = daemon.proc.poll() is None and client.get("/health").status_code == 200
        finally:
            code = daemon.stop()
    report = {**asdict(summary), "ok": summary.ok and alive, "daemon_alive_after": alive, "daemon_exit_code": code}
    print(format_summary(summary))
    print(f"daemon alive after the run: {alive}; exit code on SIGTERM: {code}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
