"""Receiver staging (device / host / stream): what each costs a receiver in memory and in time, and what a
trainer holds to send a model whose largest tensor is larger than a bucket. Part of the ``memory`` section:
bench/receiver_memory.py calls :func:`run` and :func:`render`.

Three measurements, each in processes of its own (spawned; gloo on 127.0.0.1; 1 torch thread per process):

1. **Receiver memory per staging.** One sender and one collective receiver per variant on one sync group,
   every version reaching all of them at once. A receiver is built as ``Receiver(group, load,
   assembler=VersionAssembler(device, load, staging=..., streams=True))``, holds its own copy of the model,
   and its ``load`` copies every tensor of ``payload.items()`` into it (whole and streamed payloads alike).
   Two models of the same size: ``plain`` (a quarter of a bucket per tensor) and ``chunked`` (the same with
   one tensor 3× the bucket, sent in pieces). Cached versions. A stream receiver's pool of bucket buffers
   (``StagingBuffers.pool``) is read after every ``landing`` call (:class:`PoolObserver`).
2. **Trainer memory.** A sender whose model's largest tensor is 4× the bucket and one receiver; cached and
   bypass_cpu each in a fresh pair of processes.
3. **Time per staging.** One sender with one publisher per staging, each on a sync group of its own with one
   receiver of that staging (so each keeps its staging buffers across versions, as in steady state);
   versions go to the stagings in turn, the order rotated every round; ratios are medians of the per-round
   ratios.

Variants: device, host and stream staging; in the memory runs one more stream receiver whose load lets go of
each tensor once copied (``del tensor``), to tell what the library holds from what the load's loop variable
keeps (a ``for name, tensor in payload.items()`` load holds its last tensor while it asks for the next).

Memory: a 1 ms /proc/self/status sampler plus the kernel's VmHWM, reset before every version (the PeakSampler
of receiver_memory.py). Every process first takes a tiny version (one 64 KiB tensor): what that adds is the
one-time cost of a process's first sync, whatever the version's size. Times: ``time.perf_counter()``
(CLOCK_MONOTONIC: comparable between the processes of one machine); receiver CPU and minor page faults from
getrusage.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
from typing import Any

from ckpt_engine.bench.common import (
    MiB,
    Progress,
    barrier,
    expect_close,
    master_store,
    proc_status,
    receive_versions,
    run_processes,
    stats,
    sync_group,
)
from ckpt_engine.plan.modes import StagingMode

STAGINGS: tuple[StagingMode, ...] = ("device", "host", "stream")
MEMORY_VARIANTS = (*STAGINGS, "stream-drop")  # stream-drop: a stream receiver whose load lets go of each tensor
LABELS = {"stream-drop": "stream, load lets go of each tensor"}
MEMORY_VERSIONS = 3  # versions of the model per memory run (after the tiny one)
TINY = ("tiny", (16384,))  # one 64 KiB tensor: the version that measures the one-time cost of a first sync
# A sync's memory has two parts, each with its own goal so that both hold at every bucket size: what scales
# with the bucket (a receiver's or a trainer's peak extra beyond its process's first sync, ÷ bucket), and what a
# process's first sync adds once whatever the bucket (~4-5 MiB: lazily imported modules, threads, gloo's own
# buffers). Read as one figure ÷ bucket, the fixed part alone is ~1 bucket at the quick run's 4 MiB buckets.
GOAL_STREAM_BUCKETS = 2.5  # receiver peak extra ÷ bucket, stream staging, beyond the one-time cost
GOAL_SENDER_BUCKETS = 2.5  # trainer peak extra ÷ bucket, beyond the cache (a version's size) and the one-time cost
GOAL_ONE_TIME_MIB = 8.0  # what a process's first sync adds once, receiver or trainer
GOAL_STREAM_OVER_DEVICE = 1.15  # time-to-applied, stream ÷ device staging (median of the per-round ratios)
TIME_ROUNDS = {False: 11, True: 5}  # measured rounds of the time measurement at least, by --quick


def label_of(key: str) -> str:
    return LABELS.get(key, key)


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


def _copy_load(own: dict, marks: dict, drop: bool = False):
    """The receiver's load: every tensor of the version copied into the receiver's own model (``drop``: each
    tensor let go of once copied). ``marks``: its start and end, and the seconds its copies took."""

    def load(payload) -> None:
        marks["start"] = time.perf_counter()
        copying = 0.0
        for name, tensor in payload.items():
            t0 = time.perf_counter()
            own[name].copy_(tensor)
            copying += time.perf_counter() - t0
            if drop:
                del tensor
        marks["end"] = time.perf_counter()  # a streamed payload's items() ends once the whole version verified
        marks["streamed"], marks["copy"] = payload.streamed, copying

    return load


def _staging_of(key: str) -> StagingMode:
    """The staging a variant key names ("stream-drop": stream)."""
    for staging in STAGINGS:
        if key.partition("-")[0] == staging:
            return staging
    raise ValueError(f"variant {key!r} names no staging of {STAGINGS}")


def _receiver(group, staging: StagingMode, load):
    from ckpt_engine.receive.assembly import VersionAssembler
    from ckpt_engine.receive.collective import Receiver

    assembler = VersionAssembler(group.device, load, staging=staging, streams=True)
    return Receiver(group, load, assembler=assembler), assembler


class PoolObserver:
    """Wraps a receiver's ``StagingBuffers.landing`` (the buffer a streamed bucket, or a chunked tensor being
    put together, lands in: a view of a buffer of the receiver's pool, reused once nothing refers to it) and
    reads the pool after each call: its buffers, their bytes, and those in use (their storage's use count above
    the count the pool recorded when nothing referred to them, as ``buffers.py`` itself decides; the view just
    handed out counts as a use). It only observes: the buffers are the library's."""

    def __init__(self, buffers) -> None:
        from ckpt_engine.receive import buffers as module

        self._buffers, self._landing, self._uses = buffers, buffers.landing, module._uses
        self.counts_uses = module._COUNTS_USES  # (without it the library cannot reuse a buffer)
        self.window()
        buffers.landing = self

    def __call__(self, nbytes: int):
        view = self._landing(nbytes)
        pool = self._buffers.pool
        used = [buffer.numel() for buffer, free_at in pool if self._uses(buffer) > free_at]
        self._max["calls"] += 1
        for key, value in (("in_use", len(used)), ("in_use_bytes", sum(used)), ("buffers", len(pool)),
                           ("bytes", sum(buffer.numel() for buffer, _ in pool))):
            self._max[key] = max(self._max[key], value)
        return view

    def window(self) -> dict[str, int]:
        """The maxima since the last window (and the landing calls), and a new window."""
        out = getattr(self, "_max", {})
        self._max = {"calls": 0, "in_use": 0, "in_use_bytes": 0, "buffers": 0, "bytes": 0}
        return out


def _sampling():
    """A PeakSampler started on a settled process, and the process's memory readings then (its baseline)."""
    from ckpt_engine.bench.common import PeakSampler

    gc.collect()
    sampler = PeakSampler()
    time.sleep(0.2)
    return sampler, proc_status()


def _publisher(args: dict, world: int, port: int, name: str):
    """Rank 0: the model of ``args['specs']`` (its tensors, and named), the tiny version, the group ``name``
    and a publisher on it."""
    from ckpt_engine.plan.tensors import NamedTensors
    from ckpt_engine.send.publisher import Publisher

    tensors = _make(args["specs"])
    group = sync_group(0, world, port, args["timeout_s"], name)
    publisher = Publisher(group, bucket_size=args["bucket"], keep_versions=1)
    return tensors, NamedTensors(tensors), NamedTensors(_make([TINY])), group, publisher


# ---- 1. receiver memory per staging ---------------------------------------------------------------------------


def _memory_child(rank: int, results: Any, port: int, args: dict) -> dict | None:
    import torch

    torch.set_num_threads(1)
    world, name = 1 + len(MEMORY_VARIANTS), f"staging-mem-{args['model']}"
    if rank == 0:
        tensors, named, tiny, group, publisher = _publisher(args, world, port, name)
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

    key = MEMORY_VARIANTS[rank - 1]
    staging = _staging_of(key)
    own = _make([*args["specs"], TINY])
    group = sync_group(rank, world, port, args["timeout_s"], name)
    receiver, assembler = _receiver(group, staging, _copy_load(own, {}, drop=key.endswith("-drop")))
    pool = PoolObserver(assembler.buffers)
    sampler, baseline = _sampling()
    versions, one_time = [], None
    for version in range(MEMORY_VERSIONS + 1):
        before = sampler.window()
        pool.window()
        barrier(group)
        result = receiver.receive(300)
        peak = sampler.peak()
        after = proc_status()
        seen = pool.window()
        if result is None or not result.ok:
            raise RuntimeError(f"{key} receiver: {result}")
        if not version:  # the tiny version
            one_time = {"peak": peak, "after": after}
            continue
        versions.append({"before": before, "peak": peak, "after": after, "staging": result.staging,
                         "seconds": result.seconds, "pool": seen, "pool_after": len(assembler.buffers.pool)})
    expect_close(receiver)
    sampler.close()
    return {"key": key, "staging": staging, "counts_uses": pool.counts_uses, "baseline": baseline,
            "one_time": one_time, "versions": versions}


def _memory_rows(model: str, receivers: list[dict], bucket: int) -> list[dict]:
    rows = []
    for rx in receivers:
        base, vs = rx["baseline"]["VmRSS"], rx["versions"]
        warm = rx["one_time"]["after"]["VmRSS"]  # once the process had its first (tiny) sync
        over_base = [v["peak"]["VmRSS"] - base for v in vs]
        over_warm = [v["peak"]["VmRSS"] - warm for v in vs]
        pool = {key: max(v["pool"][key] for v in vs) for key in vs[0]["pool"]}
        rows.append({
            "model": model, "key": rx["key"], "staging": rx["staging"],
            "reported": sorted({v["staging"] for v in vs}), "baseline_rss": base, "one_time": warm - base,
            "first": over_base[0], "later_max": max(over_base[1:]) if len(vs) > 1 else None,
            "worst": max(over_base), "worst_buckets": max(over_base) / bucket,
            "beyond_one_time": max(over_warm), "beyond_one_time_buckets": max(over_warm) / bucket,
            "delta": stats(v["peak"]["VmRSS"] - v["before"]["VmRSS"] for v in vs),
            "pool": pool, "pool_buckets": pool["bytes"] / bucket, "pool_in_use_buckets": pool["in_use_bytes"] / bucket,
            "pool_kept": vs[-1]["pool_after"], "counts_uses": rx["counts_uses"],
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
        receiver, _ = _receiver(sync_group(1, 2, port, args["timeout_s"], name), "stream", _copy_load(own, {}))
        receive_versions(receiver, MEMORY_VERSIONS + 1, before_each=lambda: barrier(receiver.group))
        return None

    tensors, named, tiny, group, publisher = _publisher(args, 2, port, name)
    layout = publisher.layout_for(named)
    sampler, baseline = _sampling()
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


def schedule(repeats: int, warmup: int) -> list[tuple[int, StagingMode]]:
    """(round, variant key) in order; a round < 0 is a warm-up. The order rotates every round."""
    keys = list(STAGINGS)
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
        for key in STAGINGS:
            group = sync_group(0, 2, port, args["timeout_s"], f"staging-time-{key}")
            publishers[key] = Publisher(group, bucket_size=args["bucket"], keep_versions=1)
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
            results.put(("progress", 0, f"  time, round {rnd}: {key:<6} version {version} {took:.3f}s"))
        for publisher in publishers.values():
            publisher.close()
        return {"sent": sent}

    key = STAGINGS[rank - 1]
    own = _make(args["specs"])
    marks: dict = {}
    receiver, assembler = _receiver(sync_group(1, 2, port, args["timeout_s"], f"staging-time-{key}"), key,
                                    _copy_load(own, marks))
    idle = WireIdle(assembler)
    got = []
    for _ in [s for s in steps if s[1] == key]:
        marks.clear()
        idle.window()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        result = receiver.receive(600)
        done = time.perf_counter()
        used = resource.getrusage(resource.RUSAGE_SELF)
        if result is None or not result.ok:
            raise RuntimeError(f"{key} receiver: {result}")
        got.append({"version": result.version, "staging": result.staging, "load_start": marks["start"],
                    "load_end": marks["end"], "streamed": marks["streamed"], "copy": marks["copy"], "result": done,
                    "seconds": result.seconds, "wire_idle": idle.window(), "minflt": used.ru_minflt - usage.ru_minflt,
                    "cpu": used.ru_utime + used.ru_stime - usage.ru_utime - usage.ru_stime,
                    "sys": used.ru_stime - usage.ru_stime})
    expect_close(receiver)
    return {"key": key, "got": got}


class WireIdle:
    """A stream receiver's wire left idle: for each bucket, the seconds from its bytes' arrival (its check
    starting) to the next bucket's start on the wire (its ``landing``), summed per version; 0 for whole
    staging, where the next bucket is on the wire before a bucket is checked. Wraps ``check_bucket`` and
    ``buffers.landing``; it only observes."""

    def __init__(self, assembler) -> None:
        self._check, self._landing = assembler.check_bucket, assembler.buffers.landing
        self._arrived: float | None = None
        self._idle = 0.0
        assembler.check_bucket, assembler.buffers.landing = self.check, self.landing

    def check(self, incoming, bucket, expected) -> None:
        self._arrived = time.perf_counter()
        self._check(incoming, bucket, expected)

    def landing(self, nbytes: int):
        if self._arrived is not None:
            self._idle += time.perf_counter() - self._arrived
            self._arrived = None
        return self._landing(nbytes)

    def window(self) -> float:
        out, self._idle, self._arrived = self._idle, 0.0, None
        return out


_TIMES = ("verified", "applied", "load", "pause", "recv", "verify", "copy", "wire_idle", "sender", "minflt", "cpu",
          "sys")


def _timing_summary(sent: list[dict], received: list[dict]) -> dict:
    by_version = {g["version"]: g for rx in received for g in rx["got"]}
    samples: dict[str, list[dict]] = {key: [] for key in STAGINGS}
    for s in sent:
        if s["round"] < 0:
            continue
        g = by_version[s["version"]]
        seconds = g["seconds"]
        samples[s["key"]].append({
            "round": s["round"], "staging_reported": g["staging"], "streamed": g["streamed"],
            "verified": (g["load_end"] if g["streamed"] else g["load_start"]) - s["t0"],
            "applied": g["result"] - s["t0"], "load": seconds.get("load", float("nan")),
            "pause": seconds.get("pause", float("nan")), "recv": seconds.get("recv", 0.0),
            "verify": seconds.get("verify", 0.0), "copy": g["copy"], "wire_idle": g["wire_idle"],
            "sender": s["sender_done"] - s["t0"], "minflt": g["minflt"], "cpu": g["cpu"], "sys": g["sys"]})
    out: dict[str, Any] = {"samples": samples, "stats": {}, "ratios": {}, "ratios_verified": {}}
    for key, rows in samples.items():
        rows.sort(key=lambda r: r["round"])
        out["stats"][key] = {name: stats(r[name] for r in rows) for name in _TIMES}
    device = {r["round"]: r for r in samples["device"]}
    for key, rows in samples.items():
        if key != "device":
            for what, into in (("applied", "ratios"), ("verified", "ratios_verified")):
                out[into][f"{key}_over_device"] = _paired(
                    [(r[what], device[r["round"]][what]) for r in rows if r["round"] in device])
    return out


def _paired(pairs: list[tuple[float, float]]) -> dict[str, Any] | None:
    """A ratio of variants measured back to back in each round: the median of the per-round ratios (the
    value), their range, each of them, and the ratio of the medians."""
    per_round = [a / b for a, b in pairs if b > 0]
    if not per_round:
        return None
    return {"value": statistics.median(per_round), "paired_min": min(per_round), "paired_max": max(per_round),
            "per_round": per_round, "of_medians": statistics.median(a for a, _ in pairs)
            / statistics.median(b for _, b in pairs)}


# ---- the whole measurement ----------------------------------------------------------------------------------------


def run(opts: dict, progress: Progress) -> dict:
    quick = opts["quick"]
    total, bucket = (64 if quick else 256) * MiB, (4 if quick else 16) * MiB
    timeout = opts["timeout_s"]
    repeats = max(TIME_ROUNDS[quick], opts["repeats"])  # cheap rounds: enough for a median of per-round ratios
    warmup = max(1, opts.get("warmup", 1))
    models = {"plain": model_spec(total, bucket, 0), "chunked": model_spec(total, bucket, 3)}
    trainer_specs = model_spec(total, bucket, 4)
    out: dict[str, Any] = {
        "total": total, "bucket": bucket, "repeats": repeats, "warmup": warmup, "memory_versions": MEMORY_VERSIONS,
        "models": {k: {"tensors": len(v), "largest": max(_nbytes(s) for _, s in v)} for k, v in models.items()},
        "trainer_model": {"tensors": len(trainer_specs), "largest": max(_nbytes(s) for _, s in trainer_specs)},
        "variants": list(MEMORY_VARIANTS)}
    progress(f"  staging: {total / MiB:.0f} MiB models, bucket {bucket / MiB:.0f} MiB")

    t = time.perf_counter()
    rows = []
    for model, specs in models.items():
        store = master_store(timeout)
        args = {"model": model, "specs": specs, "bucket": bucket, "timeout_s": timeout}
        got = run_processes(_memory_child, [(store.port, args)] * (1 + len(MEMORY_VARIANTS)), deadline_s=600,
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
    got = run_processes(_timing_child, [(store.port, args)] * (1 + len(STAGINGS)), deadline_s=900,
                        progress=progress, name="staging-time")
    del store
    out["timing"] = _timing_summary(got[0]["sent"], got[1:])
    out["timing"]["order"] = [f"{r}:{k}" for r, k in steps]
    out["timing_seconds"] = time.perf_counter() - t
    return out


# ---- targets and report -----------------------------------------------------------------------------------------


def target_measurements(result: dict) -> dict[str, list[tuple[str, float, str]]]:
    """The suite's targets, {key: [(where, value, range)]}. Receiver memory: the plain model (no tensor larger
    than a bucket); the chunked model has a bound of its own (2 buckets + its largest tensor), in the report."""
    out: dict[str, list[tuple[str, float, str]]] = {"stream_memory": [], "sender_memory": [], "stream_time": [],
                                                     "one_time_memory": []}
    buckets = f"{result['total'] // result['bucket']} buckets" if result.get("bucket") else ""
    for r in result.get("memory", []):
        if r["key"] == "stream" and r["model"] == "plain":
            out["stream_memory"].append((f"{r['model']} model, {buckets}", r["beyond_one_time_buckets"], ""))
            out["one_time_memory"].append(("stream receiver", r["one_time"] / MiB, ""))
    for r in result.get("trainer", []):
        where = f"{r['mode']}" + (" (beyond the cache)" if r["mode"] == "cached" else "")
        out["sender_memory"].append((where, r["beyond_both_buckets"], ""))
        out["one_time_memory"].append((f"{r['mode']} trainer", r["one_time"] / MiB, ""))
    ratio = result.get("timing", {}).get("ratios", {}).get("stream_over_device")
    if ratio:
        out["stream_time"].append((f"plain model, {len(ratio['per_round'])} rounds", ratio["value"],
                                   f"[{ratio['paired_min']:.3f}–{ratio['paired_max']:.3f}]"))
    return out


def _met(value: float, goal: float) -> str:
    return "**met**" if value <= goal else f"**missed** by {value - goal:.2f}"


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def _fmt(s: dict, digits: int = 3) -> str:
    return "—" if not s["n"] else f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _ratio(r: dict | None) -> str:
    return "—" if r is None else f"{r['value']:.3f} [{r['paired_min']:.3f}–{r['paired_max']:.3f}]"


def render(result: dict, machine: dict) -> list[str]:
    bucket, total, models = result["bucket"], result["total"], result["models"]
    quarter = f"{bucket / 4 / MiB:g} MiB"
    chunked = models["chunked"]["largest"]
    lines = [
        "### Receiver staging: memory and time per staging",
        "",
        (f"Models of {total / MiB:.0f} MiB in float32 tensors, bucket {bucket / MiB:.0f} MiB ({total / bucket:.0f} "
         f"buckets): *plain*, {models['plain']['tensors']} tensors of {quarter} (four to a bucket); *chunked*, one "
         f"tensor of {chunked / MiB:.0f} MiB ({chunked / bucket:.0f}× the bucket, sent in pieces) among "
         f"{models['chunked']['tensors'] - 1} of {quarter}. Collective (gloo) receivers, each built as "
         "`Receiver(group, load, assembler=VersionAssembler(device, load, staging=<staging>, streams=True))`; "
         "each holds its own copy of the model and its `load` copies every tensor into it (`for name, tensor in "
         "payload.items(): own[name].copy_(tensor)`, the same for whole and streamed payloads). Cached versions. "
         "On this CPU-only machine a receiver's \"device\" is host memory too: device and host staging differ only "
         "by host staging's two bucket buffers and its copy of each bucket."),
        "",
        "#### Receiver peak extra memory",
        "",
        (f"One sender and {len(result['variants'])} receivers on one group, every version reaching all of them at "
         "once: one per staging, and a stream receiver whose load lets go of each tensor once copied (`del "
         "tensor`), to tell what the library holds from what the load's loop variable keeps. Each process first "
         f"takes a tiny version (one 64 KiB tensor), then {result['memory_versions']} versions of the model. "
         "*Extra* = peak RSS during a version − the receiver's RSS before its first version (its model allocated, "
         "the group up), so what a receiver keeps between versions (whole staging buffers, the stream pool) counts "
         "in every version. *One-time cost* = RSS after the tiny version − that baseline (what a process's first "
         "sync adds whatever the version's size). *Pool*: the stream receiver's `StagingBuffers.pool` (the "
         "buffers streamed buckets, and a chunked tensor being put together, land in, reused once nothing refers "
         "to them), read after every `landing` call: buffers in use at once (use count above the pool's record, "
         "the one just handed out included) and the pool's bytes, maxima over the versions. Peaks: 1 ms sampler "
         "and the kernel's VmHWM, reset before every version"
         + ("" if all(r["hwm_reset"] for r in result["memory"]) else " (VmHWM could not be reset here)") + "."),
        "",
        ("| Model | Staging | one-time cost MiB | first version: extra MiB | later versions: extra MiB, max | "
         "peak − RSS just before, MiB median (max) | pool: buffers in use at once, MiB in use (÷ bucket) | pool "
         "MiB, max (÷ bucket) | **worst extra ÷ bucket** | worst extra beyond the one-time cost ÷ bucket | "
         "retained after, MiB |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["memory"]:
        later = "—" if r["later_max"] is None else _mib(r["later_max"])
        pool = r["pool"]
        in_use = (f"{pool['in_use']}, {_mib(pool['in_use_bytes'])} ({r['pool_in_use_buckets']:.2f})"
                  if pool["calls"] else "—")
        held = f"{_mib(pool['bytes'])} ({r['pool_buckets']:.2f})" if pool["calls"] else "—"
        lines.append(f"| {r['model']} | {label_of(r['key'])} | {r['one_time'] / MiB:.1f} | {_mib(r['first'])} | "
                     f"{later} | {_mib(r['delta']['median'])} ({_mib(r['delta']['max'])}) | {in_use} | {held} | "
                     f"**{r['worst_buckets']:.2f}** | {r['beyond_one_time_buckets']:.2f} | {_mib(r['retained'])} |")
    lines.append("")
    bound = 2 + chunked / bucket
    for r in result["memory"]:
        if r["staging"] != "stream":
            continue
        head = (f"- {label_of(r['key'])}, {r['model']} model: worst extra **{r['worst_buckets']:.2f}** buckets "
                f"({r['beyond_one_time_buckets']:.2f} beyond the one-time cost; pool {r['pool_buckets']:.2f}, "
                f"{r['pool']['in_use']} buffers in use at once)")
        if r["model"] == "plain":
            goal = (f"goal ≤ {GOAL_STREAM_BUCKETS:g} beyond the one-time cost: "
                    f"{_met(r['beyond_one_time_buckets'], GOAL_STREAM_BUCKETS)}; the one-time cost "
                    f"{r['one_time'] / MiB:.1f} MiB, goal ≤ {GOAL_ONE_TIME_MIB:g} MiB: "
                    f"{_met(r['one_time'] / MiB, GOAL_ONE_TIME_MIB)}")
        else:
            over = r["pool_buckets"] - bound
            goal = (f"what streaming needs by design here, 2 buckets + the chunked tensor put together = {bound:g} "
                    "buckets: the pool " + ("within it" if over <= 1e-9 else f"above it by {over:.2f} bucket"))
        lines.append(f"{head}; {goal}.")
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
            lines.append(f"- {r['mode']}: extra beyond the cache **{r['beyond_cache_buckets']:.2f}** buckets, "
                         f"{r['beyond_both_buckets']:.2f} beyond the one-time cost too (goal ≤ "
                         f"{GOAL_SENDER_BUCKETS:g}: {_met(r['beyond_both_buckets'], GOAL_SENDER_BUCKETS)}); the "
                         f"one-time cost {r['one_time'] / MiB:.1f} MiB (goal ≤ {GOAL_ONE_TIME_MIB:g} MiB: "
                         f"{_met(r['one_time'] / MiB, GOAL_ONE_TIME_MIB)}).")
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
        (f"Plain model. One sender with one publisher per staging, each on a sync group of its own with one "
         "receiver of that staging (each keeps its staging buffers across versions, as in steady state); versions "
         f"go to the stagings in turn, back to back, the order rotated every round: {result['warmup']} warm-up "
         f"round(s), then {result['repeats']} measured rounds. From the start of `publish()` on the trainer (it "
         "snapshots the model into the cache first, the same for every staging): *verified* = every bucket and "
         "the trailer verified (whole staging: when `load` is called; stream: when `payload.items()` ends); "
         "*applied* = the receiver's `receive()` returned its result (load done, acknowledgement exchanged). "
         "*load* = `ReceiveResult.seconds['load']`, which for stream spans the transfer (the engine is paused for "
         "it); *load's copies*: the seconds the load's `copy_` calls took; *wire idle* (stream): from each "
         "bucket's arrival to the next bucket's start on the wire (its `landing` call), summed (whole staging "
         "starts the next bucket before checking one). *Receiver CPU* (user + system) and *minor page faults*: "
         "the receiving process's during `receive()`, from getrusage. Seconds, median (min–max). Ratios ÷ device: "
         "the median of the per-round ratios (each round's two versions ran back to back), the per-round range "
         "in brackets."),
        "",
        ("| Staging | time to verified s | time to applied s | load s | receive (wire) s | verify s | load's "
         "copies s | wire idle s | receiver CPU s, median (of it system) | receiver minor page faults, median | "
         "applied ÷ device | verified ÷ device |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, x in timing["stats"].items():
        applied = "1.00" if key == "device" else _ratio(timing["ratios"].get(f"{key}_over_device"))
        verified = "1.00" if key == "device" else _ratio(timing["ratios_verified"].get(f"{key}_over_device"))
        lines.append(f"| {label_of(key)} | {_fmt(x['verified'])} | {_fmt(x['applied'])} | {_fmt(x['load'])} | "
                     f"{_fmt(x['recv'])} | {_fmt(x['verify'])} | {_fmt(x['copy'])} | {_fmt(x['wire_idle'])} | "
                     f"{x['cpu']['median']:.3f} ({x['sys']['median']:.3f}) | {x['minflt']['median']:,.0f} | "
                     f"{applied} | {verified} |")
    ratio = timing["ratios"].get("stream_over_device")
    if ratio:
        lines += ["", (f"- stream ÷ device time-to-applied: **{ratio['value']:.3f}** (median of "
                       f"{len(ratio['per_round'])} per-round ratios, {ratio['paired_min']:.3f}–"
                       f"{ratio['paired_max']:.3f}; ratio of the medians {ratio['of_medians']:.3f}); goal ≤ "
                       f"{GOAL_STREAM_OVER_DEVICE:g}: {_met(ratio['value'], GOAL_STREAM_OVER_DEVICE)}.")]
    lines += ["", f"Order of the versions (round:staging, -1 = warm-up): {', '.join(timing['order'])}.", ""]
    return lines
