"""Receiver staging (device / host / stream): what each costs a receiver in memory and in time, and what a
trainer holds to send a model whose largest tensor is larger than a bucket. Part of the ``memory`` section:
bench/receiver_memory.py calls :func:`run` and :func:`render`.

Three measurements, each in processes of its own (spawned; gloo on 127.0.0.1; 1 torch thread per process):

1. **Receiver memory per staging.** One sender and one collective receiver per variant on one sync group,
   every version reaching all of them at once. A receiver is built as ``Receiver(group, load,
   assembler=VersionAssembler(device, load, staging=..., streams=True))``, holds its own copy of the model,
   and its ``load`` copies every tensor of ``payload.items()`` into it (whole and streamed payloads alike).
   Two models of the same size: ``plain`` (a quarter of a bucket per tensor) and ``chunked`` (the same with
   one tensor 3× the bucket, sent in pieces). Cached versions.
2. **Trainer memory.** A sender whose model's largest tensor is 4× the bucket and one receiver; cached and
   bypass_cpu each in a fresh pair of processes.
3. **Time per staging.** One sender with one publisher per variant, each on a sync group of its own with one
   receiver of that variant (so each keeps its staging buffers across versions, as in steady state);
   versions go to the variants in turn, the order rotated every round.

Variants: device, host and stream staging as the process starts, and two more stream receivers whose glibc
is set with ``mallopt`` at start-up, to tell what the library holds from what the C allocator does with the
buffer each streamed bucket gets (``no-retain``: every bucket buffer a mapping of its own, unmapped when
freed; ``retain``: bucket buffers from the heap, freed ones kept for the next).

Memory: a 1 ms /proc/self/status sampler plus the kernel's VmHWM, reset before every version (the PeakSampler
of receiver_memory.py). Every process first takes a tiny version (one 64 KiB tensor): what that adds is the
one-time cost of a process's first sync, whatever the version's size. Times: ``time.perf_counter()``
(CLOCK_MONOTONIC: comparable between the processes of one machine); receiver CPU and minor page faults from
getrusage.
"""

from __future__ import annotations

import gc
import resource
import time
from typing import Any

from ckpt_engine.bench.common import (
    MiB,
    Progress,
    barrier,
    master_store,
    paired_ratio,
    proc_status,
    run_processes,
    stats,
    sync_group,
)

STAGINGS = ("device", "host", "stream")
# (staging, allocator); "glibc": as the process starts (glibc's dynamic mmap threshold)
VARIANTS = (("device", "glibc"), ("host", "glibc"), ("stream", "glibc"), ("stream", "no-retain"),
            ("stream", "retain"))
ALLOCATORS = {
    "no-retain": "glibc's mmap threshold fixed at 1 MiB (`mallopt`): every bucket buffer is a mapping of its own, "
                 "unmapped when freed",
    "retain": "glibc's mmap threshold 32 MiB and trim threshold 1 GiB (`mallopt`): bucket buffers come from the "
              "heap and freed ones stay there for the next",
}
MEMORY_VERSIONS = 3  # versions of the model per memory run (after the tiny one)
TINY = ("tiny", (16384,))  # one 64 KiB tensor: the version that measures the one-time cost of a first sync
GOAL_STREAM_BUCKETS = 2.5  # receiver peak extra ÷ bucket, stream staging
GOAL_SENDER_BUCKETS = 2.5  # trainer peak extra ÷ bucket (beyond the cache, by design a version's size)
GOAL_STREAM_OVER_DEVICE = 1.15  # time-to-applied, stream ÷ device staging
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def key_of(variant: tuple[str, str]) -> str:
    return variant[0] if variant[1] == "glibc" else f"{variant[0]}/{variant[1]}"


def label_of(key: str) -> str:
    staging, _, allocator = key.partition("/")
    return staging if not allocator else f"{staging}, glibc {allocator}"


def _set_allocator(allocator: str) -> bool | None:
    """Set glibc up for ``allocator`` (before the process allocates its model); False where it could not be."""
    if allocator == "glibc":
        return None
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if allocator == "no-retain":
            return bool(libc.mallopt(_M_MMAP_THRESHOLD, MiB))
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 * MiB)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


# ---- models -------------------------------------------------------------------------------------------------


def model_spec(total: int, bucket: int, big: int) -> list[tuple[str, tuple[int, ...]]]:
    """float32 tensors of ``total`` bytes: one of ``big`` × the bucket (none for 0), in the middle, and the
    rest a quarter of a bucket each (four to a bucket)."""
    small = bucket // 4
    count = (total - big * bucket) // small
    specs: list[tuple[str, tuple[int, ...]]] = [(f"t{i}", (small // 4,)) for i in range(count)]
    if big:
        specs.insert(count // 2, ("big", (big * bucket // 4 // 1024, 1024)))
    return specs


def _nbytes(shape: tuple[int, ...]) -> int:
    n = 4
    for d in shape:
        n *= d
    return n


def _make(specs: list[tuple[str, tuple[int, ...]]]):
    import torch

    return {name: torch.randn(shape) for name, shape in specs}  # every page written: part of the baseline


def _copy_load(own: dict, marks: dict):
    """The receiver's load: every tensor of the version copied into the receiver's own model."""

    def load(payload) -> None:
        marks["start"] = time.perf_counter()
        for name, tensor in payload.items():
            own[name].copy_(tensor)
        marks["end"] = time.perf_counter()  # a streamed payload's items() ends once the whole version verified
        marks["streamed"] = payload.streamed

    return load


def _receiver(group, staging: str, load):
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.collective import Receiver

    assembler = VersionAssembler(group.device, load, staging=staging, streams=True)
    return Receiver(group, load, assembler=assembler), assembler


class LandingCounter:
    """Wraps a receiver's ``StagingBuffers.landing`` (the buffer a streamed bucket, or a chunked tensor being
    put together, gets of its own): at each allocation, the bytes of the earlier ones still referenced (weak
    references to their storages) plus the new one. It only observes: the buffers are the library's."""

    def __init__(self, buffers) -> None:
        import weakref

        self._ref, self._alloc, self._live = weakref.ref, buffers.landing, []
        self.max_bytes = self.max_count = 0
        buffers.landing = self

    def __call__(self, nbytes: int):
        self._live = [(ref, n) for ref, n in self._live if ref() is not None]
        buffer = self._alloc(nbytes)
        storage = buffer.untyped_storage()
        self._live.append((self._ref(storage), buffer.numel()))
        del storage
        self.max_bytes = max(self.max_bytes, sum(n for _, n in self._live))
        self.max_count = max(self.max_count, len(self._live))
        return buffer

    def window(self) -> tuple[int, int]:
        out = (self.max_bytes, self.max_count)
        self.max_bytes = self.max_count = 0
        return out


# ---- 1. receiver memory per staging ---------------------------------------------------------------------------


def _memory_child(rank: int, results: Any, port: int, args: dict) -> dict | None:
    import torch

    torch.set_num_threads(1)
    world, name = 1 + len(VARIANTS), f"staging-mem-{args['model']}"
    if rank == 0:
        from ckpt_engine.plan.tensors import NamedTensors
        from ckpt_engine.send.publisher import Publisher

        tensors = _make(args["specs"])
        named, tiny = NamedTensors(tensors), NamedTensors(_make([TINY]))
        group = sync_group(0, world, port, args["timeout_s"], name)
        publisher = Publisher(group, bucket_size=args["bucket"], keep_versions=1)
        for version in range(MEMORY_VERSIONS + 1):
            tensors["t0"].add_(1)
            barrier(group)  # every receiver has taken its reading before the version starts
            result = publisher.publish(version + 1, named if version else tiny, mode="cached").result(300)
            if not result.ok or not all(a.ok for a in result.receivers):
                raise RuntimeError(f"{args['model']} version {version}: {result.reason}")
            what = f"version {version}" if version else "the tiny version"
            results.put(("progress", 0, f"  memory, {args['model']} model: {what} ok"))
        publisher.close()
        return None

    from ckpt_engine.bench.receiver_memory import PeakSampler

    staging, allocator = VARIANTS[rank - 1]
    allocator_set = _set_allocator(allocator)
    own = _make([*args["specs"], TINY])
    load = _copy_load(own, {})
    group = sync_group(rank, world, port, args["timeout_s"], name)
    receiver, assembler = _receiver(group, staging, load)
    landing = LandingCounter(assembler.buffers)
    gc.collect()
    sampler = PeakSampler()
    time.sleep(0.2)
    baseline = proc_status()
    versions, one_time = [], None
    for version in range(MEMORY_VERSIONS + 1):
        before = sampler.window()
        landing.window()
        barrier(group)
        result = receiver.receive(300)
        peak = sampler.peak()
        after = proc_status()
        live_bytes, live_count = landing.window()
        if result is None or not result.ok:
            raise RuntimeError(f"{key_of((staging, allocator))} receiver: {result}")
        if not version:  # the tiny version
            one_time = {"peak": peak, "after": after}
            continue
        versions.append({"before": before, "peak": peak, "after": after, "staging": result.staging,
                         "seconds": result.seconds, "landing_bytes": live_bytes, "landing_count": live_count})
    if receiver.receive(60) is not None:
        raise RuntimeError("expected CLOSE")
    sampler.close()
    return {"key": key_of((staging, allocator)), "staging": staging, "allocator": allocator,
            "allocator_set": allocator_set, "baseline": baseline, "one_time": one_time, "versions": versions}


def _memory_rows(model: str, receivers: list[dict], bucket: int) -> list[dict]:
    rows = []
    for rx in receivers:
        if rx["allocator_set"] is False:
            continue  # not glibc (or mallopt refused): the row would not be what it says
        base, vs = rx["baseline"]["VmRSS"], rx["versions"]
        warm = rx["one_time"]["after"]["VmRSS"]  # once the process had its first (tiny) sync
        over_base = [v["peak"]["VmRSS"] - base for v in vs]
        over_warm = [v["peak"]["VmRSS"] - warm for v in vs]
        landing = max(v["landing_bytes"] for v in vs)
        rows.append({
            "model": model, "key": rx["key"], "staging": rx["staging"], "allocator": rx["allocator"],
            "reported": sorted({v["staging"] for v in vs}), "baseline_rss": base, "one_time": warm - base,
            "first": over_base[0], "later_max": max(over_base[1:]) if len(vs) > 1 else None,
            "worst": max(over_base), "worst_buckets": max(over_base) / bucket,
            "beyond_one_time": max(over_warm), "beyond_one_time_buckets": max(over_warm) / bucket,
            "delta": stats(v["peak"]["VmRSS"] - v["before"]["VmRSS"] for v in vs),
            "landing_bytes": landing, "landing_buckets": landing / bucket,
            "landing_count": max(v["landing_count"] for v in vs),
            "retained": vs[-1]["after"]["VmRSS"] - base,
            "hwm_reset": all(v["peak"].get("hwm_reset") for v in vs),
        })
    return rows


# ---- 2. trainer memory -------------------------------------------------------------------------------------------


def _trainer_child(rank: int, results: Any, port: int, args: dict) -> dict | None:
    import torch

    torch.set_num_threads(1)
    name = f"staging-trainer-{args['mode']}"
    if rank == 1:
        own = _make([*args["specs"], TINY])
        load = _copy_load(own, {})
        receiver, _ = _receiver(sync_group(1, 2, port, args["timeout_s"], name), "stream", load)
        for _ in range(MEMORY_VERSIONS + 1):
            barrier(receiver.group)
            result = receiver.receive(300)
            if result is None or not result.ok:
                raise RuntimeError(f"trainer run's receiver: {result}")
        if receiver.receive(60) is not None:
            raise RuntimeError("expected CLOSE")
        return None

    from ckpt_engine.bench.receiver_memory import PeakSampler

    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Publisher

    tensors = _make(args["specs"])
    named, tiny = NamedTensors(tensors), NamedTensors(_make([TINY]))
    group = sync_group(0, 2, port, args["timeout_s"], name)
    publisher = Publisher(group, bucket_size=args["bucket"], keep_versions=1)
    layout = publisher.layout_for(named)
    gc.collect()
    sampler = PeakSampler()
    time.sleep(0.2)
    baseline = proc_status()
    versions, one_time = [], None
    for version in range(MEMORY_VERSIONS + 1):
        tensors["t0"].add_(1)
        before = sampler.window()
        barrier(group)
        result = publisher.publish(version + 1, named if version else tiny, mode=args["mode"]).result(300)
        peak = sampler.peak()
        if not result.ok or not all(a.ok for a in result.receivers):
            raise RuntimeError(f"{args['mode']} version {version}: {result.reason}")
        if not version:  # the tiny version
            one_time = {"peak": peak, "after": proc_status()}
            continue
        versions.append({"before": before, "peak": peak, "after": proc_status(),
                         "cache_bytes": publisher.cache.bytes_allocated})
        results.put(("progress", 0, f"  trainer memory, {args['mode']}: version {version} ok"))
    publisher.close()
    sampler.close()
    return {"mode": args["mode"], "baseline": baseline, "one_time": one_time, "versions": versions,
            "max_bucket_bytes": layout.max_bucket_bytes, "buckets": len(layout.buckets),
            "largest_tensor": max(slot.nbytes for slot in layout.slots),
            "chunked_pieces": sum(1 for slot in layout.pieces if slot.is_piece)}


def _trainer_row(tx: dict, bucket: int) -> dict:
    base, vs = tx["baseline"]["VmRSS"], tx["versions"]
    warm = tx["one_time"]["after"]["VmRSS"]
    over_base = [v["peak"]["VmRSS"] - base for v in vs]
    cache = max(v["cache_bytes"] for v in vs)
    worst = max(over_base)
    beyond_both = max(v["peak"]["VmRSS"] - warm for v in vs) - cache
    return {"mode": tx["mode"], "baseline_rss": base, "one_time": warm - base,
            "first": over_base[0], "later_max": max(over_base[1:]) if len(vs) > 1 else None, "worst": worst,
            "cache": cache, "beyond_cache": worst - cache, "beyond_cache_buckets": (worst - cache) / bucket,
            "beyond_both": beyond_both, "beyond_both_buckets": beyond_both / bucket,
            "delta": stats(v["peak"]["VmRSS"] - v["before"]["VmRSS"] for v in vs),
            "max_bucket_bytes": tx["max_bucket_bytes"], "buckets": tx["buckets"],
            "largest_tensor": tx["largest_tensor"], "chunked_pieces": tx["chunked_pieces"],
            "hwm_reset": all(v["peak"].get("hwm_reset") for v in vs)}


# ---- 3. time per staging --------------------------------------------------------------------------------------


def schedule(repeats: int, warmup: int) -> list[tuple[int, str]]:
    """(round, variant key) in order; a round < 0 is a warm-up. The order rotates every round."""
    keys = [key_of(v) for v in VARIANTS]
    steps = []
    for r in range(-warmup, repeats):
        shift = r % len(keys)
        steps += [(r, k) for k in keys[shift:] + keys[:shift]]
    return steps


def _timing_child(rank: int, results: Any, port: int, args: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    steps = [tuple(s) for s in args["steps"]]
    if rank == 0:
        from ckpt_engine.plan.tensors import NamedTensors
        from ckpt_engine.send.publisher import Publisher

        tensors = _make(args["specs"])
        named = NamedTensors(tensors)
        publishers = {}
        for variant in VARIANTS:
            group = sync_group(0, 2, port, args["timeout_s"], f"staging-time-{key_of(variant).replace('/', '-')}")
            publishers[key_of(variant)] = Publisher(group, bucket_size=args["bucket"], keep_versions=1)
        sent = []
        for version, (rnd, key) in enumerate(steps, start=1):
            tensors["t0"].add_(1)
            time.sleep(0.1)  # the previous receiver is done (its result is in); the next one waits in receive()
            t0 = time.perf_counter()
            result = publishers[key].publish(version, named, mode="cached").result(300)
            if not result.ok or not all(a.ok for a in result.receivers):
                raise RuntimeError(f"{key} version {version}: {result.reason}")
            sent.append({"version": version, "round": rnd, "key": key, "t0": t0, "sender_done": result.finished_at})
            took = result.finished_at - t0
            results.put(("progress", 0, f"  time, round {rnd}: {key:<16} version {version} {took:.3f}s"))
        for publisher in publishers.values():
            publisher.close()
        return {"sent": sent}

    staging, allocator = VARIANTS[rank - 1]
    key = key_of((staging, allocator))
    allocator_set = _set_allocator(allocator)
    own = _make(args["specs"])
    marks: dict = {}
    load = _copy_load(own, marks)
    receiver, _ = _receiver(sync_group(1, 2, port, args["timeout_s"], f"staging-time-{key.replace('/', '-')}"),
                            staging, load)
    got = []
    for _ in [s for s in steps if s[1] == key]:
        marks.clear()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        result = receiver.receive(600)
        done = time.perf_counter()
        used = resource.getrusage(resource.RUSAGE_SELF)
        if result is None or not result.ok:
            raise RuntimeError(f"{key} receiver: {result}")
        got.append({"version": result.version, "staging": result.staging, "load_start": marks["start"],
                    "load_end": marks["end"], "streamed": marks["streamed"], "result": done,
                    "seconds": result.seconds, "minflt": used.ru_minflt - usage.ru_minflt,
                    "cpu": used.ru_utime + used.ru_stime - usage.ru_utime - usage.ru_stime,
                    "sys": used.ru_stime - usage.ru_stime})
    if receiver.receive(60) is not None:
        raise RuntimeError("expected CLOSE")
    return {"key": key, "allocator_set": allocator_set, "got": got}


_TIMES = ("verified", "applied", "load", "pause", "recv", "verify", "sender", "minflt", "cpu", "sys")


def _timing_summary(sent: list[dict], received: list[dict]) -> dict:
    by_version = {g["version"]: g for rx in received for g in rx["got"]}
    skipped = {rx["key"] for rx in received if rx["allocator_set"] is False}
    samples: dict[str, list[dict]] = {key_of(v): [] for v in VARIANTS if key_of(v) not in skipped}
    for s in sent:
        if s["round"] < 0 or s["key"] in skipped:
            continue
        g = by_version[s["version"]]
        seconds = g["seconds"]
        samples[s["key"]].append({
            "round": s["round"], "staging_reported": g["staging"], "streamed": g["streamed"],
            "verified": (g["load_end"] if g["streamed"] else g["load_start"]) - s["t0"],
            "applied": g["result"] - s["t0"], "load": seconds.get("load", float("nan")),
            "pause": seconds.get("pause", float("nan")), "recv": seconds.get("recv", 0.0),
            "verify": seconds.get("verify", 0.0), "sender": s["sender_done"] - s["t0"],
            "minflt": g["minflt"], "cpu": g["cpu"], "sys": g["sys"]})
    out: dict[str, Any] = {"samples": samples, "stats": {}, "ratios": {}, "ratios_verified": {}}
    for key, rows in samples.items():
        rows.sort(key=lambda r: r["round"])
        out["stats"][key] = {name: stats(r[name] for r in rows) for name in _TIMES}
    for key, rows in samples.items():
        if key != "device":
            for what, into in (("applied", "ratios"), ("verified", "ratios_verified")):
                out[into][f"{key}_over_device"] = paired_ratio([r[what] for r in rows],
                                                               [r[what] for r in samples["device"]])
    return out


# ---- the whole measurement ----------------------------------------------------------------------------------------


def run(opts: dict, progress: Progress) -> dict:
    quick = opts["quick"]
    total, bucket = (64 if quick else 256) * MiB, (4 if quick else 16) * MiB
    timeout = opts["timeout_s"]
    repeats = opts["repeats"] if quick else max(5, opts["repeats"])
    warmup = max(1, opts.get("warmup", 1))
    models = {"plain": model_spec(total, bucket, 0), "chunked": model_spec(total, bucket, 3)}
    trainer_specs = model_spec(total, bucket, 4)
    out: dict[str, Any] = {
        "total": total, "bucket": bucket, "repeats": repeats, "warmup": warmup, "memory_versions": MEMORY_VERSIONS,
        "models": {k: {"tensors": len(v), "largest": max(_nbytes(s) for _, s in v)} for k, v in models.items()},
        "trainer_model": {"tensors": len(trainer_specs), "largest": max(_nbytes(s) for _, s in trainer_specs)},
        "variants": [key_of(v) for v in VARIANTS], "allocators": ALLOCATORS}
    progress(f"  staging: {total / MiB:.0f} MiB models, bucket {bucket / MiB:.0f} MiB")

    t = time.perf_counter()
    rows = []
    for model, specs in models.items():
        store = master_store(timeout)
        args = {"model": model, "specs": specs, "bucket": bucket, "timeout_s": timeout}
        got = run_processes(_memory_child, [(store.port, args)] * (1 + len(VARIANTS)), deadline_s=600,
                            progress=progress, name=f"staging-mem-{model}")
        del store
        rows += _memory_rows(model, got[1:], bucket)
    out["memory"], out["memory_seconds"] = rows, time.perf_counter() - t

    t = time.perf_counter()
    trainer = []
    for mode in ("cached", "bypass_cpu"):
        store = master_store(timeout)
        args = {"mode": mode, "specs": trainer_specs, "bucket": bucket, "timeout_s": timeout}
        sender, _ = run_processes(_trainer_child, [(store.port, args)] * 2, deadline_s=600, progress=progress,
                                  name=f"staging-trainer-{mode}")
        del store
        trainer.append(_trainer_row(sender, bucket))
    out["trainer"], out["trainer_seconds"] = trainer, time.perf_counter() - t

    t = time.perf_counter()
    steps = schedule(repeats, warmup)
    store = master_store(timeout)
    args = {"specs": models["plain"], "bucket": bucket, "timeout_s": timeout, "steps": steps}
    got = run_processes(_timing_child, [(store.port, args)] * (1 + len(VARIANTS)), deadline_s=900,
                        progress=progress, name="staging-time")
    del store
    out["timing"] = _timing_summary(got[0]["sent"], got[1:])
    out["timing"]["order"] = [f"{r}:{k}" for r, k in steps]
    out["timing_seconds"] = time.perf_counter() - t
    return out


# ---- targets and report -----------------------------------------------------------------------------------------


def target_measurements(result: dict) -> dict[str, list[tuple[str, float, str]]]:
    """The suite's targets, {key: [(where, value, range)]}: receivers and trainer as the process starts."""
    out: dict[str, list[tuple[str, float, str]]] = {"stream_memory": [], "sender_memory": [], "stream_time": []}
    for r in result.get("memory", []):
        if r["key"] == "stream":
            out["stream_memory"].append((f"{r['model']} model", r["worst_buckets"], ""))
    for r in result.get("trainer", []):
        where = f"{r['mode']}" + (" (beyond the cache)" if r["mode"] == "cached" else "")
        out["sender_memory"].append((where, r["beyond_cache_buckets"], ""))
    ratio = result.get("timing", {}).get("ratios", {}).get("stream_over_device")
    if ratio:
        out["stream_time"].append(("plain model", ratio["value"],
                                   f"[{ratio['paired_min']:.3f}–{ratio['paired_max']:.3f}]"))
    return out


def _met(value: float, goal: float) -> str:
    return "**met**" if value <= goal else f"**missed** by {value - goal:.2f}"


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def _fmt(s: dict, digits: int = 3) -> str:
    return "—" if not s["n"] else f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def render(result: dict, machine: dict) -> list[str]:
    bucket, total, models = result["bucket"], result["total"], result["models"]
    quarter = f"{bucket / 4 / MiB:g} MiB"
    allocators = "; ".join(f"*{name}*: {what}" for name, what in result["allocators"].items())
    lines = [
        "### Receiver staging: memory and time per staging",
        "",
        (f"Models of {total / MiB:.0f} MiB in float32 tensors, bucket {bucket / MiB:.0f} MiB ({total / bucket:.0f} "
         f"buckets): *plain*, {models['plain']['tensors']} tensors of {quarter} (four to a bucket); *chunked*, one "
         f"tensor of {models['chunked']['largest'] / MiB:.0f} MiB ({models['chunked']['largest'] / bucket:.0f}× "
         f"the bucket, sent in pieces) among {models['chunked']['tensors'] - 1} of {quarter}. Collective (gloo) "
         "receivers, each built as `Receiver(group, load, assembler=VersionAssembler(device, load, "
         "staging=<staging>, streams=True))`; each holds its own copy of the model and its `load` copies every "
         "tensor into it (`for name, tensor in payload.items(): own[name].copy_(tensor)`, the same for whole and "
         "streamed payloads). Cached versions. On this CPU-only machine a receiver's \"device\" is host memory "
         "too: device and host staging differ only by host staging's two bucket buffers and its copy of each "
         "bucket. Besides the three stagings as a process starts, two stream receivers set glibc up at start-up "
         f"to tell what the library holds from what the C allocator does with each streamed bucket's buffer: "
         f"{allocators}."),
        "",
        "#### Receiver peak extra memory",
        "",
        (f"One sender and {len(result['variants'])} receivers (one per variant) on one group, every version "
         "reaching all of them at once; each process first takes a tiny version (one 64 KiB tensor), then "
         f"{result['memory_versions']} versions of the model. *Extra* = peak RSS during a version − the receiver's "
         "RSS before its first version (its model allocated, the group up), so what a receiver keeps between "
         "versions (whole staging buffers) counts in every version. *One-time cost* = RSS after the tiny version − "
         "that baseline (what a process's first sync adds whatever the version's size). *Landing buffers alive at "
         "once*: the buffers of streamed buckets (and a chunked tensor's assembly buffer) still referenced when "
         "the next one is allocated, plus that one (weak references through a wrapper around "
         "`StagingBuffers.landing`). Peaks: 1 ms sampler and the kernel's VmHWM, reset before every version"
         + ("" if all(r["hwm_reset"] for r in result["memory"]) else " (VmHWM could not be reset here)") + "."),
        "",
        ("| Model | Staging | one-time cost MiB | first version: extra MiB | later versions: extra MiB, max | "
         "peak − RSS just before, MiB median (max) | landing buffers alive at once: n, MiB (÷ bucket) | "
         "**worst extra ÷ bucket** | worst extra beyond the one-time cost ÷ bucket | retained after, MiB |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["memory"]:
        later = "—" if r["later_max"] is None else _mib(r["later_max"])
        landing = (f"{r['landing_count']}, {_mib(r['landing_bytes'])} ({r['landing_buckets']:.2f})"
                   if r["landing_count"] else "—")
        lines.append(f"| {r['model']} | {label_of(r['key'])} | {r['one_time'] / MiB:.1f} | {_mib(r['first'])} | "
                     f"{later} | {_mib(r['delta']['median'])} ({_mib(r['delta']['max'])}) | {landing} | "
                     f"**{r['worst_buckets']:.2f}** | {r['beyond_one_time_buckets']:.2f} | {_mib(r['retained'])} |")
    lines.append("")
    for r in result["memory"]:
        if r["staging"] == "stream":
            lines.append(f"- {label_of(r['key'])}, {r['model']} model: worst extra **{r['worst_buckets']:.2f}** "
                         f"buckets ({r['beyond_one_time_buckets']:.2f} beyond the one-time cost; landing buffers "
                         f"alive at once {r['landing_buckets']:.2f}); goal ≤ {GOAL_STREAM_BUCKETS:g}: "
                         f"{_met(r['worst_buckets'], GOAL_STREAM_BUCKETS)}.")
    lines += ["", "#### Trainer (sender) peak extra memory, largest tensor 4× the bucket", ""]
    tm, tr = result["trainer_model"], result["trainer"]
    if tr:
        lines += [
            (f"Model {total / MiB:.0f} MiB: one tensor of {tm['largest'] / MiB:.0f} MiB "
             f"({tm['largest'] / bucket:.0f}× the bucket) among {tm['tensors'] - 1} of {quarter}; its layout has "
             f"{tr[0]['buckets']} buckets, the largest {tr[0]['max_bucket_bytes'] / MiB:g} MiB, the big tensor in "
             f"{tr[0]['chunked_pieces']} pieces. One sender and one (stream) receiver, each mode in a fresh pair "
             f"of processes: the tiny version first, then {result['memory_versions']} versions. *Extra* = peak RSS "
             "from `publish()` to `result()` − the trainer's RSS once its model and publisher existed, before "
             "its first version. In cached mode the host cache holds a whole version by design (what lets a "
             "version be re-sent, repaired or sent sparse, and the training loop go on during the transfer): it is "
             "reported on its own (`VersionCache.bytes_allocated`) and the goal applies to what the trainer holds "
             "beyond it; on gloo a cached version is sent straight from the cache buffer, with no send slot. In "
             "bypass_cpu mode there is no cache: the two send slots are the extra."),
            "",
            ("| Mode | RSS baseline MiB | one-time cost MiB | first version: extra MiB | later versions: extra MiB, "
             "max | host cache MiB | **extra beyond the cache ÷ bucket** | beyond the cache and the one-time cost "
             "÷ bucket |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in tr:
            later = "—" if r["later_max"] is None else _mib(r["later_max"])
            lines.append(f"| {r['mode']} | {_mib(r['baseline_rss'])} | {r['one_time'] / MiB:.1f} | "
                         f"{_mib(r['first'])} | {later} | {_mib(r['cache'])} | **{r['beyond_cache_buckets']:.2f}** | "
                         f"{r['beyond_both_buckets']:.2f} |")
        lines.append("")
        for r in tr:
            lines.append(f"- {r['mode']}: extra beyond the cache **{r['beyond_cache_buckets']:.2f}** buckets; goal "
                         f"≤ {GOAL_SENDER_BUCKETS:g}: {_met(r['beyond_cache_buckets'], GOAL_SENDER_BUCKETS)}.")
        lines += [
            "",
            (f"Before tensors larger than a bucket were chunked (such a tensor had a bucket of its own), this "
             f"model's largest bucket would have been {tm['largest'] / MiB:.0f} MiB and bypass_cpu's two send slots "
             f"{2 * tm['largest'] / MiB:.0f} MiB = {2 * tm['largest'] / bucket:.0f} buckets (from the old layout "
             "rule, not measured here)."),
            "",
        ]
    timing = result["timing"]
    lines += [
        "#### Time to verified and to applied",
        "",
        (f"Plain model. One sender with one publisher per variant, each on a sync group of its own with one "
         "receiver of that variant (each keeps its staging buffers across versions, as in steady state); versions "
         f"go to the variants in turn, the order rotated every round: {result['warmup']} warm-up round(s), then "
         f"{result['repeats']} measured rounds. From the start of `publish()` on the trainer (it snapshots the "
         "model into the cache first, the same for every variant): *verified* = every bucket and the trailer "
         "verified (whole staging: when `load` is called; stream: when `payload.items()` ends); *applied* = the "
         "receiver's `receive()` returned its result (load done, acknowledgement exchanged). *load* = "
         "`ReceiveResult.seconds['load']`, which for stream spans the transfer (the engine is paused for it; "
         "`seconds['pause']` is the same). *Receiver CPU* (user + system) and *minor page faults*: the receiving "
         "process's during `receive()`, from getrusage. Seconds, median (min–max); ratios of medians, the "
         "per-round range in brackets."),
        "",
        ("| Staging | time to verified s | time to applied s | load s | receive (wire) s | verify s | "
         "receiver CPU s, median (of it system) | receiver minor page faults, median | applied ÷ device |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, x in timing["stats"].items():
        ratio = timing["ratios"].get(f"{key}_over_device")
        rtxt = "1.00" if key == "device" else (
            f"{ratio['value']:.3f} [{ratio['paired_min']:.3f}–{ratio['paired_max']:.3f}]" if ratio else "—")
        lines.append(f"| {label_of(key)} | {_fmt(x['verified'])} | {_fmt(x['applied'])} | {_fmt(x['load'])} | "
                     f"{_fmt(x['recv'])} | {_fmt(x['verify'])} | {x['cpu']['median']:.3f} ({x['sys']['median']:.3f}) "
                     f"| {x['minflt']['median']:,.0f} | {rtxt} |")
    ratio = timing["ratios"].get("stream_over_device")
    if ratio:
        lines += ["", (f"- stream ÷ device time-to-applied: **{ratio['value']:.3f}** (per round "
                       f"{ratio['paired_min']:.3f}–{ratio['paired_max']:.3f}); goal ≤ {GOAL_STREAM_OVER_DEVICE:g}: "
                       f"{_met(ratio['value'], GOAL_STREAM_OVER_DEVICE)}.")]
    lines += ["", f"Order of the versions (round:variant, -1 = warm-up): {', '.join(timing['order'])}.", ""]
    return lines
