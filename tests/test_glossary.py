"""docs/glossary.md: it defines the words the operator page and /receivers use, the page links to it, and the
daemon serves the copy shipped in the package (server/page/glossary.md), which must be the same text."""

from __future__ import annotations

import re

from fastapi import FastAPI
from fastapi.testclient import TestClient

from ckpt_engine.server.page_routes import PAGE_FILES, add_page
from tests.daemon_harness import ROOT

GLOSSARY = ROOT / "docs" / "glossary.md"
SHIPPED = ROOT / "server" / "page" / "glossary.md"
TERMS = ["owners", "class", "quorum", "torn", "unable", "proven", "kept for repairs", "staging", "new", "serving",
         "staged", "catch-up", "repair", "lag", "degraded", "sparse", "bucket"]


def test_the_shipped_copy_is_the_glossary() -> None:
    assert SHIPPED.read_text() == GLOSSARY.read_text(), "cp docs/glossary.md server/page/glossary.md"


def test_every_word_the_page_uses_is_defined() -> None:
    text = GLOSSARY.read_text()
    defined = {term.lower() for term in re.findall(r"\*\*([^*]+)\*\*", text)}
    missing = [term for term in TERMS if not any(term in entry for entry in defined)]
    assert not missing, missing
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):  # relative links resolve in the repository
        assert (GLOSSARY.parent / link).exists(), link


def test_the_page_links_to_it_and_the_daemon_serves_it_without_a_token() -> None:
    index = (ROOT / "server" / "page" / "index.html").read_text()
    assert 'href="/page/glossary.md"' in index and "/page/glossary.md" in PAGE_FILES
    app = FastAPI()
    add_page(app)
    reply = TestClient(app).get("/page/glossary.md")
    assert reply.status_code == 200 and reply.text == GLOSSARY.read_text()
    assert reply.headers["content-type"].startswith("text/plain")
    assert "glossary.md" in (ROOT / "README.md").read_text()
