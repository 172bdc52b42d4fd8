"""The pulled-pieces section (bench/pull_pieces.py): its read counts agree with the reads a puller plans for the
netns bench's model, and it measures what it says over real NIXL agents in two processes."""

from __future__ import annotations

import pytest

from ckpt_engine.bench import pull_pieces
from ckpt_engine.bench.netns_cluster import model_shapes
from ckpt_engine.plan.shards import Slice, piece_runs


@pytest.mark.parametrize("tp", [2, 4])
def test_the_counted_reads_are_the_runs_a_puller_plans_for_the_netns_model(tp: int) -> None:
    shapes = model_shapes(48, 4)
    column = [s for name, s in shapes.items() if name.endswith(("o_proj.weight", "down_proj.weight"))]
    runs = [piece_runs(s, 4, Slice(1, 0, s[1] // tp)) for s in column]
    layers = len(column) // 2
    counted = pull_pieces.column_reads(layers, 512, 2048, tp, 4, len(shapes) - len(column))
    assert counted["column_reads"] == sum(len(r) for r in runs)
    assert counted["column_piece_bytes"] * counted["column_reads"] == sum(n for r in runs for _, n in r)
    assert counted["reads"] == counted["column_reads"] + len(shapes) - len(column)


def test_the_section_reads_the_owners_bytes_whole_and_in_pieces() -> None:
    """It measures real reads: every variant's bytes are checked against the owner's (it raises otherwise)."""
    from ckpt_engine.transport.nixl import nixl_missing

    if (why := nixl_missing()) is not None:
        pytest.skip(why)
    import os

    before = {key: os.environ.get(key) for key in ("UCX_TLS", "UCX_NET_DEVICES")}
    result = pull_pieces.measure(1, 1, lambda _: None)
    assert {key: os.environ.get(key) for key in before} == before  # (later tests' agents keep their transports)
    rows = {r["piece"]: r for r in result["rows"]}
    assert rows[0]["reads"] == 1
    assert all(rows[p]["reads"] * p == 1 << 20 for p in pull_pieces._PIECES)
    assert all(len(pull_pieces._ranges(p, 1 << 20)) == rows[p]["reads"] for p in pull_pieces._PIECES)
    assert all(len(r["samples"]["wall"]) == 1 for r in rows.values())


def test_what_a_piece_read_must_land_is_every_other_piece_of_the_owners_bytes() -> None:
    pattern = pull_pieces._pattern(64)
    assert pull_pieces._expected(pattern, 0, 32).tolist() == list(range(32))
    assert pull_pieces._expected(pattern, 8, 32).tolist() == [*range(0, 8), *range(16, 24), *range(32, 40),
                                                               *range(48, 56)]
    assert pull_pieces._ranges(8, 32).tolist() == [[0, 0, 8], [16, 8, 8], [32, 16, 8], [48, 24, 8]]
