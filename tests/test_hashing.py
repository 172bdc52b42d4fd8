"""Digests: deterministic across processes, sensitive to bytes, order, dtype and shape; bf16 works."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ckpt_engine.plan.hashing import (
    bucket_digests,
    fold_pieces,
    reference_mix64_digest,
    slot_seed,
    tensor_digests,
    version_digest,
    xxh3_digest,
)
from ckpt_engine.plan.layout import TensorSpec, plan_layout
from ckpt_engine.plan.tensors import fill_bucket

ALGOS = ["xxh3-64", "torch-mix64"]


def digests_of(tensors: dict[str, torch.Tensor], algo: str) -> list[int]:
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    layout = plan_layout(specs, bucket_size=1 << 20)
    out: list[int] = []
    for bucket in layout.buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        fill_bucket(buf, bucket.slots, tensors, bucket.nbytes)
        out += bucket_digests(bucket, buf, algo, layout.digest).tolist()
    return out


def sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(17, 3, generator=gen),
        "bf16": torch.randn(31, generator=gen).bfloat16(),
        "i64": torch.arange(5),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 2),
    }


@pytest.mark.parametrize("algo", ALGOS)
def test_sensitive_to_a_single_bit(algo: str) -> None:
    base = sample()
    before = digests_of(base, algo)
    changed = {k: v.clone() for k, v in base.items()}
    changed["bf16"].view(torch.int16)[7] ^= 1
    after = digests_of(changed, algo)
    assert [a != b for a, b in zip(before, after)] == [False, True, False, False, False, False]


@pytest.mark.parametrize("algo", ALGOS)
def test_sensitive_to_order_within_a_tensor(algo: str) -> None:
    t = torch.arange(16, dtype=torch.float32)
    swapped = t.clone()
    swapped[[2, 9]] = swapped[[9, 2]]
    assert digests_of({"x": t}, algo) != digests_of({"x": swapped}, algo)


@pytest.mark.parametrize("algo", ALGOS)
def test_sensitive_to_dtype_and_shape_with_equal_bytes(algo: str) -> None:
    t = torch.arange(8, dtype=torch.int32)
    variants = [{"x": t}, {"x": t.view(torch.float32)}, {"x": t.view(2, 4)}, {"x": t.view(torch.int16)}]
    assert len({digests_of(v, algo)[0] for v in variants}) == 4


def test_device_digest_matches_the_plain_python_reference() -> None:
    tensors = sample()
    expected = []
    for t in tensors.values():
        raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        expected.append(reference_mix64_digest(str(t.dtype).removeprefix("torch."), tuple(t.shape), bytes(raw.tolist())))
    assert digests_of(tensors, "torch-mix64") == expected


def test_padding_bytes_do_not_change_digests() -> None:
    layout = plan_layout([TensorSpec("a", "uint8", (5,)), TensorSpec("b", "uint8", (3,))], 1024)
    bucket = layout.buckets[0]
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    buf[0:5] = 7
    for algo in ALGOS:
        clean = bucket_digests(bucket, buf, algo, layout.digest).tolist()
        dirty = buf.clone()
        dirty[5:256] = 99  # padding after tensor a
        assert bucket_digests(bucket, dirty, algo, layout.digest).tolist() == clean


def test_chunked_device_digest_matches_reference_across_chunk_boundaries(monkeypatch) -> None:
    from ckpt_engine.plan import hashing

    monkeypatch.setattr(hashing, "_CHUNK_WORDS", 5)  # force many chunks and tensors spanning them
    t = torch.randn(37)
    raw = bytes(t.view(torch.uint8).tolist())
    assert digests_of({"x": t}, "torch-mix64") == [reference_mix64_digest("float32", (37,), raw)]


def test_same_digests_in_another_process() -> None:
    code = (
        "import torch, json; from tests.test_hashing import digests_of, sample;"
        "print(json.dumps({a: digests_of(sample(), a) for a in ['xxh3-64', 'torch-mix64']}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    import json

    assert json.loads(out.stdout) == {a: digests_of(sample(), a) for a in ALGOS}


def test_version_digest_depends_on_every_input() -> None:
    base = version_digest("xxh3-64", "abc", [1, 2, 3])
    assert base == version_digest("xxh3-64", "abc", [1, 2, 3])
    others = {version_digest("torch-mix64", "abc", [1, 2, 3]), version_digest("xxh3-64", "abd", [1, 2, 3]),
              version_digest("xxh3-64", "abc", [1, 3, 2]), version_digest("xxh3-64", "abc", [1, 2, 4])}
    assert base not in others and len(others) == 4


def test_xxh3_of_a_bf16_tensor_needs_no_numpy() -> None:
    t = torch.randn(9).bfloat16()
    assert isinstance(xxh3_digest("bfloat16", (9,), t.view(torch.uint8)), int)


@pytest.mark.parametrize("chunk_words", [1, 3, 8, 61, 4 << 20])
def test_device_digest_matches_reference_on_random_layouts(monkeypatch, chunk_words: int) -> None:
    """Tensors of every size class (empty, under a word, partial last word, many words) around chunk edges."""
    import random

    from ckpt_engine.plan import hashing

    monkeypatch.setattr(hashing, "_CHUNK_WORDS", chunk_words)
    rng = random.Random(chunk_words)
    gen = torch.Generator().manual_seed(chunk_words)
    for trial in range(6):
        sizes = [rng.choice([0, 1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 250, 1000]) for _ in range(rng.randint(1, 12))]
        tensors = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for i, n in enumerate(sizes)}
        specs = [TensorSpec(name, "uint8", (t.numel(),)) for name, t in tensors.items()]
        layout = plan_layout(specs, bucket_size=rng.choice([64, 512, 4096]), alignment=rng.choice([8, 16, 256]))
        got: list[int] = []
        for bucket in layout.buckets:
            buf = torch.randint(0, 256, (bucket.nbytes,), dtype=torch.uint8, generator=gen)  # dirty padding
            fill_bucket(buf, bucket.slots, tensors, bucket.nbytes)
            got += bucket_digests(bucket, buf, "torch-mix64", layout.digest).tolist()
        # per piece (tensors larger than a bucket travel in pieces, each with a seed of its own) ...
        want = [reference_mix64_digest("uint8", s.shape, bytes(tensors[s.name][s.start : s.start + s.nbytes].tolist()),
                                       seed=slot_seed(s)) for s in layout.pieces]
        assert got == want, (trial, sizes)
        # ... and per tensor: a whole tensor's own, a chunked one's pieces folded
        whole = [reference_mix64_digest("uint8", (t.numel(),), bytes(t.tolist())) for t in tensors.values()]
        folded = tensor_digests(layout, got)
        for slot, digest, plain in zip(layout.slots, folded, whole):
            assert digest == (plain if slot.parts == 1 else fold_pieces("uint8", slot.shape, [
                d for p, d in zip(layout.pieces, got) if p.index == slot.index])), (trial, slot)


def test_a_host_buffer_keeps_its_tensor_alive() -> None:
    """Found by the third outside round: ``bytes(host_buffer(t.cpu()))`` of a device tensor read the freed
    temporary (CPU stand-in: a clone nobody else holds)."""
    import gc

    from ckpt_engine.plan.hashing import host_buffer

    expected = torch.arange(1 << 12, dtype=torch.int32).view(torch.uint8)
    for _ in range(20):
        view = host_buffer(expected.clone())  # the only reference to the clone is the view's
        gc.collect()
        _ = [torch.full((1 << 12,), 7, dtype=torch.int32) for _ in range(4)]  # reuse what a free left behind
        assert bytes(view) == bytes(host_buffer(expected))
