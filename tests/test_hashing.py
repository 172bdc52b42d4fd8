"""Digests: deterministic across processes, sensitive to bytes, order, dtype and shape; bf16 works. The device
digest (torch-block64) against its plain-Python definition on every dtype and odd size, its eager and compiled
forms against each other, and the properties it must keep wherever a tensor lies in a bucket."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from ckpt_engine.errors import ProtocolError
from ckpt_engine.plan import hashing
from ckpt_engine.plan.dtypes import DTYPE_BY_NAME
from ckpt_engine.plan.hashing import (
    bucket_digests,
    check_algo,
    fold_pieces,
    reference_block64_digest,
    slot_seed,
    tensor_digests,
    version_digest,
    xxh3_digest,
)
from ckpt_engine.plan.layout import Layout, TensorSpec, plan_layout
from ckpt_engine.plan.tensors import fill_bucket

ALGOS = ["xxh3-64", "torch-block64"]
DEVICE = "torch-block64"


def digests_of(tensors: dict[str, torch.Tensor], algo: str, *, bucket_size: int = 1 << 20, alignment: int = 256,
               dirt: int | None = None) -> list[int]:
    """Per-piece digests of ``tensors`` laid out in buckets; ``dirt``: a seed for random bytes written over every
    padding byte after the fill (the digests must not see them)."""
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    layout = plan_layout(specs, bucket_size=bucket_size, alignment=alignment)
    out: list[int] = []
    for bucket in layout.buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        fill_bucket(buf, bucket.slots, tensors, bucket.nbytes)
        if dirt is not None:
            _dirty_padding(buf, bucket, dirt)
        out += bucket_digests(bucket, buf, algo, layout.digest).tolist()
    return out


def _dirty_padding(buf: torch.Tensor, bucket, seed: int) -> None:
    used = torch.zeros(buf.numel(), dtype=torch.bool)
    for slot in bucket.slots:
        used[slot.offset : slot.offset + slot.nbytes] = True
    noise = torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buf[~used] = noise[~used]


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist()) if t.numel() else b""


def reference(tensors: dict[str, torch.Tensor]) -> list[int]:
    return [reference_block64_digest(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw_bytes(t))
            for t in tensors.values()]


def random_bytes_as(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


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
    assert digests_of(tensors, DEVICE) == reference(tensors)


# byte sizes around the word (8) and row (256) edges
ODD_BYTES = [1, 7, 8, 9, 255, 256, 257, 511, 512, 1000]


@pytest.mark.parametrize("dtype_name", sorted(DTYPE_BY_NAME))
def test_every_dtype_and_odd_size_matches_the_reference(dtype_name: str) -> None:
    """0-dim, empty, 1 byte, 7 bytes, 255/256/257 bytes (in whole elements of the dtype), 2-D, with dirty
    padding, in one bucket and in buckets so small that sizes end mid-bucket and tensors travel in pieces."""
    dtype = DTYPE_BY_NAME[dtype_name]
    gen = torch.Generator().manual_seed(len(dtype_name))
    shapes: list[tuple[int, ...]] = [(), (0,), (0, 3)]
    shapes += [(max(1, nbytes // dtype.itemsize),) for nbytes in ODD_BYTES]
    shapes += [(3, 37), (5, 64 // dtype.itemsize)]
    tensors = {f"t{i}": random_bytes_as(dtype, shape, gen) for i, shape in enumerate(shapes)}
    assert digests_of(tensors, DEVICE, dirt=1) == reference(tensors)
    # buckets of 512 bytes: most tensors end mid-bucket, the larger ones are split into pieces
    specs = [TensorSpec(n, dtype_name, tuple(t.shape)) for n, t in tensors.items()]
    layout = plan_layout(specs, bucket_size=512)
    assert layout.chunked
    got = _layout_pieces(layout, tensors, dirt=2)
    assert got == _reference_pieces(layout, tensors)
    assert tensor_digests(layout, got) == _reference_tensors(layout, tensors, got)


def _layout_pieces(layout: Layout, tensors: dict[str, torch.Tensor], dirt: int) -> list[int]:
    out: list[int] = []
    for bucket in layout.buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        fill_bucket(buf, bucket.slots, tensors, bucket.nbytes)
        _dirty_padding(buf, bucket, dirt + bucket.index)
        out += bucket_digests(bucket, buf, DEVICE, layout.digest).tolist()
    return out


def _reference_pieces(layout: Layout, tensors: dict[str, torch.Tensor]) -> list[int]:
    """Per piece: its bytes under its own seed (a whole tensor's seed is its header seed)."""
    return [reference_block64_digest(s.dtype, s.shape, raw_bytes(tensors[s.name])[s.start : s.start + s.nbytes],
                                     seed=slot_seed(s)) for s in layout.pieces]


def _reference_tensors(layout: Layout, tensors: dict[str, torch.Tensor], pieces: list[int]) -> list[int]:
    """Per tensor: a whole tensor's own reference digest, a chunked one's pieces folded in order."""
    out = []
    for slot in layout.slots:
        if slot.parts == 1:
            out.append(reference_block64_digest(slot.dtype, slot.shape, raw_bytes(tensors[slot.name])))
        else:
            out.append(fold_pieces(slot.dtype, slot.shape, [d for p, d in zip(layout.pieces, pieces)
                                                            if p.index == slot.index]))
    return out


@pytest.mark.parametrize("algo", ALGOS)
def test_padding_bytes_do_not_change_digests(algo: str) -> None:
    tensors = {"a": torch.full((5,), 7, dtype=torch.uint8), "b": torch.arange(300, dtype=torch.int16),
               "c": torch.ones(3, dtype=torch.uint8)}
    for alignment in (256, 8):
        clean = digests_of(tensors, algo, alignment=alignment)
        assert all(digests_of(tensors, algo, alignment=alignment, dirt=seed) == clean for seed in range(3))


def test_a_tensor_digests_alike_wherever_it_lies() -> None:
    """The same tensor first, after other tensors, after a large one, alone, in a later bucket, or laid out with
    alignment 8 (slow path): the same digest."""
    gen = torch.Generator().manual_seed(5)
    probe = random_bytes_as(torch.bfloat16, (333,), gen)  # 666 bytes: its last row is partial
    want = reference({"probe": probe})[0]
    neighbours = [{}, {"a": torch.ones(3)}, {"a": random_bytes_as(torch.uint8, (10_000,), gen)},
                  {"a": torch.ones(1), "b": random_bytes_as(torch.float16, (129,), gen)}]
    for before in neighbours:
        for alignment in (256, 512, 8, 16):
            for bucket_size in (1 << 20, 4096):
                tensors = {**before, "probe": probe, "z": torch.arange(7)}
                specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
                layout = plan_layout(specs, bucket_size=bucket_size, alignment=alignment)
                got = tensor_digests(layout, _layout_pieces(layout, tensors, dirt=9))
                assert got[len(before)] == want, (list(before), alignment, bucket_size)


def test_a_flipped_bit_changes_exactly_its_tensor() -> None:
    gen = torch.Generator().manual_seed(6)
    sizes = [1, 7, 255, 256, 257, 3000, 64, 511]
    tensors = {f"t{i}": random_bytes_as(torch.uint8, (n,), gen) for i, n in enumerate(sizes)}
    before = digests_of(tensors, DEVICE, dirt=3)
    rng = random.Random(6)
    for name, t in tensors.items():
        for position in {0, t.numel() - 1, rng.randrange(t.numel())}:
            for bit in (0, 7):
                changed = {k: v.clone() for k, v in tensors.items()}
                changed[name][position] ^= 1 << bit
                after = digests_of(changed, DEVICE, dirt=3)
                assert [a != b for a, b in zip(before, after)] == [k == name for k in tensors], (name, position)


def test_swapped_rows_or_words_change_the_digest() -> None:
    gen = torch.Generator().manual_seed(7)
    t = random_bytes_as(torch.int64, (4, 32), gen)  # four rows of 32 words
    base = digests_of({"x": t}, DEVICE)
    rows = t[[2, 1, 0, 3]]
    words = t.clone()
    words[1, [3, 17]] = words[1, [17, 3]]
    across = t.clone()
    across[[0, 3], 5] = across[[3, 0], 5]  # the same column of two rows
    half = torch.cat([t[:, 16:], t[:, :16]], dim=1)  # every row's halves swapped
    variants = [rows, words, across, half]
    got = [digests_of({"x": v}, DEVICE)[0] for v in variants]
    assert base[0] not in got and len(set(got)) == len(variants)
    assert got == [reference({"x": v})[0] for v in variants]


def test_same_digests_in_another_process() -> None:
    code = (
        "import torch, json; from tests.test_hashing import digests_of, sample;"
        "print(json.dumps({a: digests_of(sample(), a) for a in ['xxh3-64', 'torch-block64']}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""},
                         cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    import json

    assert json.loads(out.stdout) == {a: digests_of(sample(), a) for a in ALGOS}


def test_version_digest_depends_on_every_input() -> None:
    base = version_digest("xxh3-64", "abc", [1, 2, 3])
    assert base == version_digest("xxh3-64", "abc", [1, 2, 3])
    others = {version_digest("torch-block64", "abc", [1, 2, 3]), version_digest("xxh3-64", "abd", [1, 2, 3]),
              version_digest("xxh3-64", "abc", [1, 3, 2]), version_digest("xxh3-64", "abc", [1, 2, 4])}
    assert base not in others and len(others) == 4


def test_the_retired_device_digest_is_refused_clearly() -> None:
    """torch-mix64 (before issue 36) is no longer computed: a header naming it is refused saying why, not as an
    unknown name."""
    assert check_algo("torch-block64") == "torch-block64"
    with pytest.raises(ProtocolError, match=r"'torch-mix64' is no longer supported.*older ckpt-engine"):
        check_algo("torch-mix64")
    with pytest.raises(ProtocolError, match="unknown digest algorithm 'md5'"):
        check_algo("md5")


def test_xxh3_of_a_bf16_tensor_needs_no_numpy() -> None:
    t = torch.randn(9).bfloat16()
    assert isinstance(xxh3_digest("bfloat16", (9,), t.view(torch.uint8)), int)


@pytest.mark.parametrize("chunk_rows", [1, 3, 4096])
def test_device_digest_matches_reference_on_random_layouts(monkeypatch, chunk_rows: int) -> None:
    """Tensors of every size class (empty, under a word, partial last row, many rows) in buckets of every size,
    with every alignment (below 256: the slow path), the eager level 1 in chunks of 1, 3 or 4096 rows."""
    monkeypatch.setattr(hashing, "_HOST_CHUNK_ROWS", chunk_rows)
    rng = random.Random(chunk_rows)
    gen = torch.Generator().manual_seed(chunk_rows)
    for trial in range(6):
        sizes = [rng.choice([0, 1, 3, 7, 8, 9, 255, 256, 257, 1000, 2048, 5000]) for _ in range(rng.randint(1, 12))]
        tensors = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for i, n in enumerate(sizes)}
        specs = [TensorSpec(name, "uint8", (t.numel(),)) for name, t in tensors.items()]
        layout = plan_layout(specs, bucket_size=rng.choice([64, 512, 4096]), alignment=rng.choice([8, 16, 256, 512]))
        got = _layout_pieces(layout, tensors, dirt=trial)
        assert got == _reference_pieces(layout, tensors), (trial, sizes, layout.alignment)
        assert tensor_digests(layout, got) == _reference_tensors(layout, tensors, got), (trial, sizes)


def test_the_kernel_is_eager_on_the_cpu_unless_asked(monkeypatch, caplog) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv(hashing.KERNEL_ENV, raising=False)
    assert hashing.device_digest_kernel(cpu) == "eager"
    monkeypatch.setenv(hashing.KERNEL_ENV, "eager")
    assert hashing.device_digest_kernel(cpu) == "eager"
    monkeypatch.setenv(hashing.KERNEL_ENV, "fused")  # not a choice: the default, with a warning
    with caplog.at_level("WARNING"):
        assert hashing.device_digest_kernel(cpu) == "eager"
    assert "neither 'eager' nor 'compiled'" in caplog.text


def test_compiled_equals_eager_on_the_cpu(monkeypatch) -> None:
    """torch.compile of the digest (C++ inductor here; Triton on CUDA) against the eager ops, on buckets of every
    shape: one compile with dynamic shapes serves them all (no recompiles). A compiler failure fails the test."""
    import torch._dynamo

    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    layouts = []
    for _ in range(5):
        sizes = [rng.choice([0, 1, 7, 256, 257, 700, 4096, 20_000]) for _ in range(rng.randint(1, 40))]
        tensors = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for i, n in enumerate(sizes)}
        specs = [TensorSpec(name, "uint8", (t.numel(),)) for name, t in tensors.items()]
        layout = plan_layout(specs, bucket_size=rng.choice([256, 4096, 1 << 16]), alignment=rng.choice([8, 256, 256]))
        layouts.append((layout, tensors))

    def run() -> list[list[int]]:
        return [_layout_pieces(layout, tensors, dirt=3) for layout, tensors in layouts]

    monkeypatch.setenv(hashing.KERNEL_ENV, "eager")
    eager = run()
    monkeypatch.setenv(hashing.KERNEL_ENV, "compiled")
    kernel = hashing.device_digest_kernel(torch.device("cpu"))  # compiles and checks on probes: raises if it cannot
    assert kernel == "compiled", hashing.compile_failure(torch.device("cpu"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert run() == eager
    with torch.inference_mode():  # an engine's buffers and calls may be in inference mode: the same graph
        assert run() == eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
    assert eager == [_reference_pieces(layout, tensors) for layout, tensors in layouts]


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
