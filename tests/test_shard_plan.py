"""Sharded delivery's pure plan (plan/shards.py): specs checked, classes keyed, pieces and their bytes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ckpt_engine.errors import ConfigError
from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.plan.shards import Slice, check_spec, even_split, pieces_of, spec_key

# A Llama-style layer as a checkpoint holds it (hidden 8, 4 query heads and 2 KV heads of 2, MLP 16)
TENSORS = [
    TensorSpec("embed_tokens.weight", "float32", (32, 8)),
    TensorSpec("q_proj.weight", "float32", (8, 8)),
    TensorSpec("k_proj.weight", "float32", (4, 8)),
    TensorSpec("v_proj.weight", "float32", (4, 8)),
    TensorSpec("o_proj.weight", "float32", (8, 8)),
    TensorSpec("gate_proj.weight", "float32", (16, 8)),
    TensorSpec("up_proj.weight", "float32", (16, 8)),
    TensorSpec("down_proj.weight", "float32", (8, 16)),
    TensorSpec("norm.weight", "float32", (8,)),
    TensorSpec("step", "int64", ()),
]


def tp_spec(rank: int, tp: int) -> dict[str, tuple[Slice, ...]]:
    """What TP rank ``rank`` keeps: column-parallel rows, row-parallel columns, vocab rows; norms whole."""
    spec = {}
    for t in TENSORS:
        if t.name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                      "embed_tokens.weight"):
            spec[t.name] = (even_split(0, t.shape[0], tp, rank),)
        elif t.name in ("o_proj.weight", "down_proj.weight"):
            spec[t.name] = (even_split(1, t.shape[1], tp, rank),)
    return spec


@pytest.mark.parametrize("spec, problem", [
    ({"nope": (Slice(0, 0, 1),)}, "no tensor 'nope'"),
    ({"q_proj.weight": (Slice(2, 0, 1),)}, "has 2 dim\\(s\\), a slice is along dim 2"),
    ({"q_proj.weight": (Slice(0, 6, 4),)}, "has 8 along dim 0, a slice ends at 10"),
    ({"q_proj.weight": (Slice(0, 0, 4), Slice(0, 3, 2))}, "overlap"),
    ({"q_proj.weight": (Slice(0, 0, 4), Slice(1, 4, 2))}, "several dims"),
    ({"q_proj.weight": ()}, "lists no slice"),
    ({"step": (Slice(0, 0, 1),)}, "has 0 dim"),
])
def test_a_spec_that_cannot_be_served_is_refused_naming_why(spec, problem) -> None:
    with pytest.raises(ConfigError, match=problem):
        check_spec(spec, TENSORS)


@pytest.mark.parametrize("bad", [dict(dim=-1, start=0, length=1), dict(dim=0, start=-1, length=1),
                                 dict(dim=0, start=0, length=0), dict(dim=0, start=True, length=1),
                                 dict(dim=0.0, start=0, length=1)])
def test_a_slice_is_ints_in_range(bad) -> None:
    with pytest.raises(ConfigError):
        Slice(**bad)


def test_slices_that_cover_a_tensor_keep_it_whole_and_order_does_not_matter() -> None:
    spec = {"q_proj.weight": (Slice(0, 4, 4), Slice(0, 0, 4)), "k_proj.weight": (Slice(0, 2, 2), Slice(0, 0, 1))}
    assert check_spec(spec, TENSORS) == {"k_proj.weight": (Slice(0, 0, 1), Slice(0, 2, 2))}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_form_one_class_each_and_receive_their_share(tp: int) -> None:
    specs = {f"dp{d}-tp{r}": check_spec(tp_spec(r, tp), TENSORS) for d in range(2) for r in range(tp)}
    keys = {name: spec_key(spec) for name, spec in specs.items()}
    assert all(keys[f"dp0-tp{r}"] == keys[f"dp1-tp{r}"] for r in range(tp))  # TP rank r of every replica: one class
    assert len(set(keys.values())) == tp and spec_key({}) == "whole"
    whole = pieces_of(TENSORS, {})
    assert [p.tensor for p in whole] == [t.name for t in TENSORS] and all(p.part is None for p in whole)
    total = sum(t.nbytes for t in TENSORS)
    replicated = sum(t.nbytes for t in TENSORS if t.name in ("norm.weight", "step"))
    for r in range(tp):
        pieces = pieces_of(TENSORS, specs[f"dp0-tp{r}"])
        nbytes = sum(p.nbytes for p in pieces)
        assert nbytes == (total - replicated) // tp + replicated
        assert nbytes / total <= 1 / tp + replicated / total
    # every rank's pieces of a row-parallel weight are its columns, contiguous on the wire
    down = [p for p in pieces_of(TENSORS, specs["dp0-tp1"]) if p.tensor == "down_proj.weight"]
    assert [(p.spec.name, p.spec.shape) for p in down] == [(f"down_proj.weight@1:{16 // tp}:{16 // tp}", (8, 16 // tp))]


def test_a_class_plans_its_own_buckets_of_exactly_its_pieces() -> None:
    spec = check_spec(tp_spec(1, 2), TENSORS)
    pieces = pieces_of(TENSORS, spec)
    layout = plan_layout([p.spec for p in pieces], 256)
    assert layout.total_bytes >= sum(p.nbytes for p in pieces)
    assert [s.name for s in layout.slots] == [p.spec.name for p in pieces]


def test_a_fused_checkpoint_tensor_keeps_one_range_of_each_part() -> None:
    # a checkpoint storing q, k and v fused along dim 0 (8 + 4 + 4 rows): TP rank 1 of 2 keeps rows 4-7, 10-11, 14-15
    fused = [TensorSpec("qkv_proj.weight", "bfloat16", (16, 8))]
    spec = {"qkv_proj.weight": (Slice(0, 4, 4), Slice(0, 10, 2), Slice(0, 14, 2))}
    pieces = pieces_of(fused, check_spec(spec, fused))
    assert [(p.spec.name, p.spec.shape) for p in pieces] == [
        ("qkv_proj.weight@0:4:4", (4, 8)), ("qkv_proj.weight@0:10:2", (2, 8)), ("qkv_proj.weight@0:14:2", (2, 8))]
    assert sum(p.nbytes for p in pieces) == 8 * 8 * 2


@pytest.mark.parametrize("shape,part", [
    ((6, 4), None), ((6, 4), Slice(0, 2, 3)), ((6, 4), Slice(1, 1, 2)), ((6, 4), Slice(1, 0, 4)),
    ((2, 3, 4), Slice(1, 1, 2)), ((2, 3, 4), Slice(2, 3, 1)), ((8,), Slice(0, 5, 3)), ((3, 1), Slice(0, 1, 1)),
])
def test_piece_runs_read_exactly_the_pieces_bytes_in_wire_order(shape, part) -> None:
    from ckpt_engine.plan.shards import cut, piece_runs

    full = torch.arange(math.prod(shape), dtype=torch.int16).reshape(shape)
    flat = full.view(torch.uint8).reshape(-1)
    runs = piece_runs(shape, 2, part)
    read = torch.cat([flat[offset : offset + count] for offset, count in runs])
    assert torch.equal(read, cut(full, part).view(torch.uint8).reshape(-1))
    assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(runs))  # adjacent runs are joined


def test_piece_runs_refuse_a_slice_that_does_not_fit() -> None:
    from ckpt_engine.plan.shards import piece_runs

    with pytest.raises(ConfigError):
        piece_runs((4, 4), 2, Slice(1, 2, 3))
    with pytest.raises(ConfigError):
        piece_runs((4,), 2, Slice(1, 0, 1))


@pytest.mark.parametrize("start,nbytes", [(0, 24), (0, 5), (3, 10), (8, 8), (20, 4), (23, 1)])
def test_runs_within_a_chunk_of_a_piece(start, nbytes) -> None:
    from ckpt_engine.plan.shards import runs_within

    runs = [(100, 8), (200, 8), (300, 8)]  # a piece of 24 bytes from three places
    wire = [o + i for o, n in runs for i in range(n)]  # the source offset of each of the piece's bytes
    got = runs_within(runs, start, nbytes)
    assert [src + i for src, _, n in got for i in range(n)] == wire[start : start + nbytes]
    assert [dst for _, dst, _ in got] == [sum(n for _, _, n in got[:k]) for k in range(len(got))]
