"""The operator page (GET /) in a real headless Chromium, over a real daemon with a trainer and two receivers,
one of which tears on an apply and is repaired: the rendered DOM shows the committed versions, the torn
version repaired, the receiver's last error and state, and the stage timings. The page's own files need no
token; its data does, and the token never appears in a URL.

Set CKPT_ENGINE_PAGE_SCREENSHOT=docs/operator-page.png to refresh the README's screenshot."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from ckpt_engine.server.cli import main

from tests.browser import Browser, find_chromium
from tests.daemon_harness import ROOT, start_daemon, write_config
from tests.procs import start_processes
from tests.test_elastic import agents_of, wait_until
from tests.test_torn_repair import _wait_for_repair, streaming_receiver, tearing_receiver, versions_trainer

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def browser() -> Browser:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium: install the distribution's package (apt-get install chromium; scripts/setup.sh "
                    "does as root) or set CKPT_ENGINE_CHROMIUM to a Chromium binary")
    browser = Browser(binary)
    yield browser
    browser.close()


def test_the_page_needs_no_token_but_its_data_does(tmp_path: Path) -> None:
    daemon = start_daemon(write_config(tmp_path))
    with httpx.Client(base_url=daemon.url, timeout=10) as anonymous:
        page = anonymous.get("/")
        assert page.status_code == 200 and "page.js" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert anonymous.get("/page/page.js").status_code == 200
        assert {anonymous.get(p).status_code for p in ("/status", "/versions", "/receivers", "/page/other.js")} == {401}
        assert anonymous.post("/").status_code == 401
    with daemon.client() as http:
        assert "/" not in http.get("/openapi.json").json()["paths"]
    assert daemon.stop() == 0


def test_the_page_shows_versions_the_torn_and_repaired_receiver_and_stage_timings(
        tmp_path: Path, browser: Browser, capsys: pytest.CaptureFixture) -> None:
    daemon = start_daemon(write_config(tmp_path, keep_versions=3, transport="collective"))
    stop, armed = tmp_path / "stop", tmp_path / "armed"
    procs = start_processes([(versions_trainer, (daemon.zmq, str(stop))),
                             (tearing_receiver, (daemon.zmq, str(stop), str(armed))),
                             (streaming_receiver, (daemon.zmq, str(stop)))])
    try:
        with daemon.client() as http:
            wait_until(lambda: len(agents_of(http)) == 3, what="registration")
            first = http.post("/sync", json={"wait": True, "timeout_s": 60}).json()
            assert first["status"] == "committed", first
            armed.touch()
            torn = http.post("/sync", json={"wait": True, "timeout_s": 60}).json()
            tearing = next(e for e in torn["receivers"] if e["torn"])["agent_id"]
            repair = _wait_for_repair(http)
            assert repair["status"] == "committed", repair
            wait_until(lambda: http.get("/status").json()["in_flight"] is None, what="the repair's end")
            last = http.post("/sync", json={"wait": True, "timeout_s": 60}).json()
            assert last["status"] == "committed", last
        token = daemon.tokens()["operator"]
        tab = browser.tab()
        tab.goto(daemon.url + "/")
        tab.wait_for("!document.getElementById('login').hidden", what="the token form")
        tab.evaluate(f"document.getElementById('token').value = {token!r}; "
                     "document.getElementById('login').requestSubmit(); true")
        tab.wait_for(f"document.querySelector('#versions tr[data-version=\"{last['id']}\"]')", what="the versions")
        shown = tab.evaluate(_READ_PAGE)
        if target := os.environ.get("CKPT_ENGINE_PAGE_SCREENSHOT"):
            (ROOT / target).write_bytes(tab.screenshot())
        else:
            assert tab.screenshot()[:8] == b"\x89PNG\r\n\x1a\n"
        assert tab.evaluate("location.href") == daemon.url + "/"  # the token went into no URL
        terminal = _cli(capsys, daemon.url, token, "status")
        watched = _cli(capsys, daemon.url, token, "versions", "--watch", "--count", "2", "--interval", "0.05")
    finally:
        stop.touch()
        procs.collect(120)
    versions = shown["versions"]
    for committed in (first, repair, last):
        assert versions[str(committed["id"])]["status"] == "committed", versions
    assert "torn" in versions[str(torn["id"])]["marks"], versions[str(torn["id"])]
    assert f"repaired by v{repair['id']}" in versions[str(torn["id"])]["marks"]
    assert f"repair of v{first['id']}" in versions[str(repair["id"])]["marks"]
    stages = versions[str(last["id"])]["stages"]
    assert {"snapshot", "verify"} <= set(stages), stages  # drawn as bars, one per stage
    assert shown["legend"] and set(stages) <= set(shown["legend"])
    receivers = shown["receivers"]
    assert receivers[tearing]["state"] == "serving" and receivers[tearing]["serving"] == f"v{last['id']}"
    assert receivers[tearing]["error"].startswith(f"v{torn['id']}: ") and "injected" in receivers[tearing]["error"]
    assert {r["staging"].split()[0] for r in receivers.values()} == {"device", "stream"}, receivers
    assert all(r["lag"] == "0" for r in receivers.values()), receivers
    assert shown["trainers"] == ["0"] and shown["health"] == "ok"
    # the same in the terminal: ckpt-engine status and versions --watch
    row = next(line for line in terminal if line.startswith(tearing))
    assert row.split()[2:5] == ["serving", f"v{last['id']}", "0"] and "injected" in row, terminal
    assert "no version in flight" in terminal and "  rank 0" in "\n".join(terminal)
    assert watched.count("no version in flight") == 2 and sum(line.startswith("   id") for line in watched) == 2


def _cli(capsys: pytest.CaptureFixture, url: str, token: str, *command: str) -> list[str]:
    capsys.readouterr()
    assert main(["--url", url, "--token", token, *command]) == 0
    return capsys.readouterr().out.splitlines()


# What the test reads of the rendered page (text as shown, bars as drawn).
_READ_PAGE = """(() => {
  const text = (row, i) => row.cells[i].textContent.trim();
  const versions = {}, receivers = {};
  for (const row of document.querySelectorAll('#versions tbody tr')) {
    versions[row.dataset.version] = {status: row.dataset.status,
      marks: [...row.querySelectorAll('.mark')].map((m) => m.textContent),
      stages: [...row.querySelectorAll('rect[data-stage]')].map((r) => r.dataset.stage)};
  }
  for (const row of document.querySelectorAll('#receivers tbody tr')) {
    receivers[row.dataset.agent] = {state: text(row, 4), serving: text(row, 5), lag: text(row, 6),
      staging: text(row, 7), error: text(row, 8)};
  }
  return {versions, receivers,
    legend: [...document.querySelectorAll('#legend .key')].map((k) => k.textContent),
    trainers: [...document.querySelectorAll('#trainers tbody tr')].map((r) => text(r, 0)),
    health: document.getElementById('health').textContent};
})()"""
