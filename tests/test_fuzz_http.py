"""Schemathesis against the real daemon's live /openapi.json (trials/fuzz_http.py runs the same, longer), and
regression tests for what it found: 500s from ids beyond SQLite's INTEGER, undeclared statuses and content
types, 405s without the right Allow header, a chunked body over the limit answered 400 instead of 413."""

from __future__ import annotations

import httpx
import pytest

from ckpt_engine.trials.fuzz_http import EXPECTED_5XX, format_summary, run_fuzz
from tests.daemon_harness import DaemonProcess, start_daemon, write_config

pytestmark = pytest.mark.multiproc

TOKEN = "fuzz-test-token-0123456789"
CASES = 50  # per operation and phase: about 5 s here; trials/fuzz_http.py runs 200 (or more) the same way
OPERATIONS = {"POST /sync", "GET /versions", "GET /versions/latest", "GET /versions/{version}",
              "POST /versions/{version}/push", "DELETE /versions/{version}", "GET /receivers", "GET /status",
              "GET /health", "GET /metrics"}
NO_AGENTS = "no trainer agent (role trainer, rank 0) is registered"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> DaemonProcess:
    daemon = start_daemon(write_config(tmp_path_factory.mktemp("fuzz-http"), auth_token=TOKEN))
    yield daemon
    assert daemon.stop() == 0


def test_generated_requests_with_the_token_get_declared_answers_and_no_5xx(daemon: DaemonProcess) -> None:
    summary = run_fuzz(daemon.url, token=TOKEN, max_examples=CASES, seed=0)
    report = format_summary(summary)
    assert summary.ok, report
    assert set(summary.operations) == OPERATIONS, report
    assert all(op["cases"] >= 10 for op in summary.operations.values()), report
    for label, operation in summary.operations.items():  # the only 5xx: a sync refused for lack of agents
        fives = {s for s in operation["statuses"] if s.startswith("5")}
        assert fives <= {str(s) for s in EXPECTED_5XX.get(label, ())}, report
    with daemon.client() as client:
        assert client.get("/health").json() == {"ok": True, "degraded": False, "problem": None}
        history = client.get("/versions", params={"limit": 1000}).json()["versions"]
    # Every generated sync was refused and recorded as such: nothing else appeared in history.
    assert history and {(v["status"], v["reason"]) for v in history} == {("failed", NO_AGENTS)}


def test_generated_requests_without_the_token_get_401_except_health(daemon: DaemonProcess) -> None:
    summary = run_fuzz(daemon.url, token=TOKEN, max_examples=5, seed=0, send_token=False)
    report = format_summary(summary)
    assert summary.ok, report
    for label, operation in summary.operations.items():
        expected = {"200", "405"} if label == "GET /health" else {"401"}
        assert set(operation["statuses"]) <= expected, report


def test_the_schema_declares_errors_auth_and_media_types(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {"HTTPBearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            if path != "/health":
                assert {"401", "413"} <= set(responses) and operation["security"], (method, path)
            if operation.get("parameters") or "requestBody" in operation:
                body = responses["422"]["content"]["application/json"]["schema"]
                assert body == {"$ref": "#/components/schemas/ErrorBody"}, (method, path)
    assert list(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert {"200", "202", "400", "409", "502", "503", "504"} <= set(schema["paths"]["/sync"]["post"]["responses"])


@pytest.mark.parametrize("method, path, kwargs", [
    ("get", f"/versions/{1 << 63}", {}),
    ("delete", f"/versions/{1 << 63}", {}),
    ("post", f"/versions/{1 << 63}/push", {}),
    ("get", f"/versions/{-(1 << 64)}", {}),
    ("post", "/sync", {"json": {"step": 1 << 63}}),
    ("post", "/sync", {"json": {"step": 1 << 53}}),  # above what every JSON parser holds exactly
])
def test_ids_beyond_the_store_range_are_422_not_500(daemon: DaemonProcess, method: str, path: str,
                                                    kwargs: dict) -> None:
    # Regression: these reached SQLite and came back as 500 "OverflowError: Python int too large".
    with daemon.client() as client:
        response = getattr(client, method)(path, **kwargs)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid request"


@pytest.mark.parametrize("method, path, allow", [
    ("TRACE", "/versions/1", "DELETE, GET"),  # was only "GET": Starlette names the first matching route's
    ("OPTIONS", "/sync", "POST"),
    ("PUT", "/versions/1/push", "POST"),
    ("DELETE", "/versions/latest", "GET"),  # was a 422 from DELETE /versions/{version}
    ("PATCH", "/health", "GET"),
])
def test_unsupported_methods_get_405_with_allow(daemon: DaemonProcess, method: str, path: str, allow: str) -> None:
    with daemon.client() as client:
        response = client.request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == allow, (response.headers, response.text)
    assert response.json()["error"] == "method not allowed"


def test_a_chunked_body_over_the_limit_is_413(daemon: DaemonProcess) -> None:
    # Regression: without Content-Length the limit tripped inside FastAPI's body reading, which made it a 400.
    def chunks():
        for _ in range(80):
            yield b" " * 1024

    with daemon.client() as client:
        response = client.post("/sync", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"] == "payload too large"


def test_401_says_how_to_authenticate(daemon: DaemonProcess) -> None:
    response = httpx.get(f"{daemon.url}/status", headers={"Authorization": "Bearer " + "x" * 26})
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"


def test_metrics_are_plain_text(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
