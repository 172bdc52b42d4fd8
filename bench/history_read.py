"""The daemon's history read path, this checkout against another revision, side by side in one run: what
``GET /versions`` (a page of 50 records, turned into dicts) and ``GET /status`` (versions per status) cost
in ``HistoryStore``, with 1,200 committed versions of 2 receivers each.

    python -m ckpt_engine.bench.history_read [--against REV] [--rounds N]

``--against`` (default: the commit before the shallow ``to_dict``) is loaded with ``git show`` from this
repository; nothing is installed. Medians of ``--rounds`` calls each.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from ckpt_engine.server.launch import REPO

_BEFORE_SHALLOW_TO_DICT = "0833148"
_RECEIVERS = [{"rank": r, "agent_id": f"a{r}", "transport": "collective", "engine": None, "ok": True, "reason": None,
               "version_digest": "x" * 32, "seconds": {"load": 0.1, "verify": 0.2}, "missing_report": False,
               "serving_after": 1, "torn": False} for r in (1, 2)]


def _module_at(revision: str) -> ModuleType:
    source = subprocess.run(["git", "show", f"{revision}:server/history.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "history_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("history_at_revision", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load server/history.py of {revision}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _filled(module: ModuleType, versions: int) -> Any:
    store = module.HistoryStore(Path(tempfile.mkdtemp()) / "history.sqlite3")
    for step in range(versions):
        record = store.create(mode="cached", step=step)
        store.update(record.id, status="committed", receivers=_RECEIVERS, stages={"snapshot": 0.1, "broadcast": 0.2})
    return store


def _median_ms(call: Any, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default=_BEFORE_SHALLOW_TO_DICT, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--versions", type=int, default=1200)
    args = parser.parse_args(argv)
    stores = {args.against: _filled(_module_at(args.against), args.versions),
              "this checkout": _filled(importlib.import_module("ckpt_engine.server.history"), args.versions)}
    rows = {}
    for label, store in stores.items():
        page = _median_ms(lambda s=store: [r.to_dict() for r in s.list(limit=50)], args.rounds)
        counts = _median_ms(lambda s=store: s.counts(), args.rounds)
        rows[label] = (page, counts)
        print(f"{label:>14}: GET /versions page of 50 {page:.3f} ms, /status counts {counts:.3f} ms")
    (old_page, old_counts), (new_page, new_counts) = rows.values()
    print(f"{'ratio':>14}: {new_page / old_page:.2f}x and {new_counts / old_counts:.2f}x of {args.against}")


if __name__ == "__main__":
    main()
