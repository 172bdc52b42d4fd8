#!/usr/bin/env python3
"""Helper of scripts/gpu-check.sh and scripts/gpu-wheels.sh. Standard library only (plus pip's vendored
``packaging`` where ``packaging`` itself is not installed), so it runs before any dependency is there.

    gpu_check.py requirements [--anchor]       what a GPU check needs besides torch, one requirement a line
                                               (--anchor: also MoonshotAI's checkpoint-engine, for the side by side)
    gpu_check.py requirements --nixl 13        the NIXL build for that CUDA major, alone (optional: the colocated
                                               pull's bench)
    gpu_check.py anchor-deps --wheels DIR      what the anchor's wheel in DIR needs, without torch (pip download
                                               of the anchor itself would pull a CUDA torch build)
    gpu_check.py missing --wheels DIR          the wheels of DIR to install here: every requirement that is
                                               missing or too old, with what those wheels need in turn
    gpu_check.py closure --wheels DIR --python 3.12
                                               check that DIR holds a wheel for every requirement, transitively,
                                               for that Python on manylinux x86-64 (nothing installed counts)
    gpu_check.py slim-nixl WHEEL               rewrite a NIXL wheel (nixl-cu12 / nixl-cu13) without what the nixl
                                               transport never loads, to fit a GPU machine's carry (see NIXL_UNUSED)
    gpu_check.py stage DEST                    the package tree as pip would install it (pyproject's package-dir
                                               maps server/ and workers/ to ckpt_engine.server / .workers)
    gpu_check.py probe                         JSON: Python, torch, CUDA, GPUs (imports torch)
    gpu_check.py report OUTDIR ...             report.md + report.json of a run, from the files it left in OUTDIR
"""

from __future__ import annotations

import argparse
import csv
import email.parser
import importlib.metadata
import io
import json
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

try:  # a real packaging when installed, else the copy every pip carries
    from packaging import tags as _tags
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pragma: no cover - depends on the machine
    from pip._vendor.packaging import tags as _tags  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
# From the test extra: what running tests/gpu needs (transformers and schemathesis serve other tests).
TEST_TOOLS = ("pytest", "pytest-timeout")
# The anchor of the side by side (bench/anchor_bench.py); optional on the GPU machine: without its wheels the
# rest of the check still runs and the report says the side by side was skipped.
ANCHOR = ("checkpoint-engine==0.4.2",)
# NIXL for the colocated pull (bench/nixl_colocated.py), also optional: fetched by gpu-wheels.sh --nixl only, as
# its wheel is large. It needs torch and numpy, which the GPU machine has; nothing else is installed for it.
NIXL_DISTRIBUTIONS = ("nixl-cu12", "nixl-cu13")
NOT_FROM_WHEELS = ("torch",)  # the machine's own build is kept
MANYLINUX_X86_64 = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                    "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
                    "linux_x86_64")


class CheckError(Exception):
    """Something the operator must fix; printed without a traceback."""


# ---- requirements and wheels ---------------------------------------------------------------------------


def _pyproject() -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements() -> list[str]:
    """The project's dependencies without torch, and the test tools the GPU tests run under."""
    project = _pyproject()["project"]
    deps = [r for r in project["dependencies"] if canonicalize_name(Requirement(r).name) not in NOT_FROM_WHEELS]
    tools = [r for r in project["optional-dependencies"]["test"]
             if canonicalize_name(Requirement(r).name) in {canonicalize_name(t) for t in TEST_TOOLS}]
    return deps + tools


def nixl_requirement(cuda_major: str) -> str:
    """NIXL for CUDA ``cuda_major``, at the version the project's ``nixl`` extra asks for (which names the
    CUDA 12 build, the one that runs on the CPU too)."""
    [extra] = _pyproject()["project"]["optional-dependencies"]["nixl"]
    return f"nixl-cu{cuda_major}{Requirement(extra).specifier}"


def anchor_plan(wheels: WheelDir) -> dict[str, Path]:
    """The anchor's wheels to install here, or nothing (with the reason on stderr) when the folder lacks them."""
    try:
        return plan(list(ANCHOR), wheels)
    except CheckError as exc:
        print(f"gpu_check: the side by side with {ANCHOR[0]} will be skipped: {exc}", file=sys.stderr)
        return {}


class WheelDir:
    """The wheels of one folder, by distribution name."""

    def __init__(self, folder: Path, supported: Iterable[Any]) -> None:
        if not folder.is_dir():
            raise CheckError(f"no wheel folder at {folder}: fetch one with scripts/gpu-wheels.sh on a machine "
                             "with internet access and copy it here")
        self.folder = folder
        self.supported = set(supported)
        self.by_name: dict[str, list[tuple[Any, Path, frozenset]]] = {}
        for path in sorted(folder.glob("*.whl")):
            name, version, _, wheel_tags = parse_wheel_filename(path.name)
            self.by_name.setdefault(canonicalize_name(name), []).append((version, path, wheel_tags))

    def best(self, req: Any) -> Path:
        """The newest wheel that satisfies ``req`` and installs on the target."""
        found = [(v, p) for v, p, t in self.by_name.get(canonicalize_name(req.name), [])
                 if req.specifier.contains(v, prereleases=True) and t & self.supported]
        if not found:
            have = [p.name for _, p, _ in self.by_name.get(canonicalize_name(req.name), [])]
            raise CheckError(f"{self.folder} has no wheel for {req} that installs on this Python "
                             f"({'found: ' + ', '.join(have) if have else 'none at all'}); fetch them with "
                             "scripts/gpu-wheels.sh for this Python version")
        return max(found)[1]


def nixl_plan(wheels: WheelDir) -> dict[str, Path]:
    """The NIXL wheel of the folder to install here (none when NIXL imports already, or the folder has none)."""
    if any(installed_version(name) is not None for name in NIXL_DISTRIBUTIONS):
        return {}
    for name in NIXL_DISTRIBUTIONS:
        try:
            return {name: wheels.best(Requirement(name))}
        except CheckError:
            continue
    return {}


# Parts of a NIXL wheel that the nixl transport never loads (it starts a UCX backend only): the expert-parallel
# kernels built for several torch versions (two thirds of the wheel), the command-line tools, UCX's perftest
# modules, and the plugins of other backends (storage, libfabric, GPUNetIO). The bundled shared libraries stay:
# libnixl itself links some of them.
NIXL_UNUSED_PREFIXES = ("nixl_ep_",)
NIXL_UNUSED_PARTS = (".scripts/", "perftest")


def nixl_part_unused(name: str) -> bool:
    """Whether a NIXL wheel's member ``name`` is left out of the slimmed wheel (see NIXL_UNUSED_PREFIXES)."""
    if name.startswith(NIXL_UNUSED_PREFIXES) or any(part in name for part in NIXL_UNUSED_PARTS):
        return True
    folder, _, leaf = name.rpartition("/")
    plugin_folder = folder.endswith("/plugins") or folder.endswith(".libs/nixl")
    return plugin_folder and leaf.startswith("libplugin_") and leaf != "libplugin_UCX.so"


def slim_nixl(wheel: Path) -> tuple[int, int]:
    """Rewrite ``wheel`` in place without its unused parts, its RECORD listing what is left; (bytes before,
    after)."""
    before = wheel.stat().st_size
    staged = wheel.with_suffix(".slim")
    try:
        _write_slim(wheel, staged)
    except BaseException:
        staged.unlink(missing_ok=True)  # (nothing half-written left beside the wheel)
        raise
    staged.replace(wheel)
    return before, wheel.stat().st_size


def _write_slim(wheel: Path, staged: Path) -> None:
    if not wheel.name.startswith(tuple(n.replace("-", "_") + "-" for n in NIXL_DISTRIBUTIONS)):
        raise CheckError(f"{wheel.name} is not a NIXL wheel ({', '.join(NIXL_DISTRIBUTIONS)})")
    try:
        with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as out:
            kept = [info for info in source.infolist() if not nixl_part_unused(info.filename)]
            record = next((i for i in kept if i.filename.count("/") == 1
                           and i.filename.endswith(".dist-info/RECORD")), None)
            if record is None:
                raise CheckError(f"{wheel.name} has no RECORD: not a wheel")
            names = {info.filename for info in kept}
            for info in kept:
                data = source.read(info)
                if info is record:
                    data = _record_of(data, names, wheel.name)
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    except (zipfile.BadZipFile, UnicodeDecodeError, csv.Error) as exc:
        raise CheckError(f"{wheel.name} is not a wheel that can be slimmed: {type(exc).__name__}: {exc}") from exc


def _record_of(record: bytes, names: set[str], wheel: str) -> bytes:
    """A wheel's RECORD (CSV: a name with a comma is quoted) keeping only the rows of ``names``; a CheckError
    unless it lists every one of them."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    listed = set()
    for row in csv.reader(io.StringIO(record.decode("utf-8-sig")), strict=True):
        if row and row[0] in names:
            writer.writerow(row)
            listed.add(row[0])
    if missing := sorted(names - listed):
        raise CheckError(f"{wheel}: its RECORD does not list {len(missing)} of its files (e.g. {missing[0]})")
    return out.getvalue().encode()


def wheel_requires(path: Path) -> list[Any]:
    """Requires-Dist of a wheel, without the ones that apply only to extras or to other environments."""
    with zipfile.ZipFile(path) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = email.parser.Parser().parsestr(archive.read(meta).decode())
    out = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def installed_version(name: str) -> Any | None:
    try:
        return Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def plan(reqs: list[str], wheels: WheelDir, *, assume_nothing_installed: bool = False,
         environment: dict[str, str] | None = None) -> dict[str, Path]:
    """distribution -> wheel for every requirement not met here, and for what those wheels need."""
    chosen: dict[str, Path] = {}
    queue = [Requirement(r) for r in reqs]
    while queue:
        req = queue.pop(0)
        if req.marker is not None and not req.marker.evaluate({**(environment or {}), "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in NOT_FROM_WHEELS:
            continue
        if name in chosen:
            version = parse_wheel_filename(chosen[name].name)[1]
            if not req.specifier.contains(version, prereleases=True):
                raise CheckError(f"conflict: {chosen[name].name} does not satisfy {req}")
            continue
        have = None if assume_nothing_installed else installed_version(req.name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue
        chosen[name] = wheels.best(req)
        queue.extend(wheel_requires(chosen[name]))
    return chosen


def _target_tags(python: str, platforms: Iterable[str]) -> list[Any]:
    major, minor = (int(x) for x in python.split(".")[:2])
    interpreter = f"cp{major}{minor}"
    out = list(_tags.cpython_tags((major, minor), [interpreter], list(platforms)))
    out += list(_tags.compatible_tags((major, minor), interpreter, list(platforms)))
    return out


def _target_environment(python: str) -> dict[str, str]:
    """Marker values of the target machine (CPython on x86-64 Linux) for ``closure``."""
    full = python if python.count(".") >= 2 else f"{python}.0"
    return {"python_version": ".".join(python.split(".")[:2]), "python_full_version": full,
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": "x86_64", "os_name": "posix"}


# ---- the package tree ------------------------------------------------------------------------------------


def stage(dest: Path) -> list[str]:
    """Copy each package's modules where pip would install them; returns the packages."""
    tool = _pyproject()["tool"]["setuptools"]
    mapping: dict[str, str] = tool.get("package-dir", {})
    packages: list[str] = tool["packages"]
    if dest.exists():
        shutil.rmtree(dest)
    for package in packages:
        source = REPO / _package_source(package, mapping)
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        modules = [p for p in source.iterdir() if p.is_file() and (p.suffix == ".py" or p.name == "py.typed")]
        if not any(p.name == "__init__.py" for p in modules):
            raise CheckError(f"package {package} maps to {source}, which has no __init__.py")
        for module in modules:
            shutil.copy2(module, target / module.name)
    return packages


def _package_source(package: str, mapping: dict[str, str]) -> str:
    """The folder of ``package`` under setuptools' package-dir rules (nearest mapped ancestor)."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return "/".join([mapping[prefix], *parts[cut:]]).lstrip("/")
    return "/".join([mapping.get("", ""), *parts]).lstrip("/")


# ---- probe ------------------------------------------------------------------------------------------------


def probe() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "host": platform.node(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "gpus": []}
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["gpus"].append({"index": index, "name": props.name, "memory_bytes": props.total_memory,
                                 "capability": f"{props.major}.{props.minor}"})
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - a build without NCCL: the 2-GPU tests will say so
            info["nccl"] = f"unavailable ({exc})"
    info["driver"] = _nvidia_smi("driver_version")
    return info


def _nvidia_smi(field: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def describe_machine(env: dict[str, Any]) -> str:
    if not env.get("cuda_available"):
        return f"no CUDA device (torch {env.get('torch')}, Python {env.get('python')})"
    names: dict[str, int] = {}
    for gpu in env["gpus"]:
        names[gpu["name"]] = names.get(gpu["name"], 0) + 1
    gpus = ", ".join(f"{n} × {name}" for name, n in names.items())
    return (f"{gpus}; torch {env['torch']} (CUDA {env['torch_cuda']}), NCCL {env.get('nccl')}, driver "
            f"{env.get('driver') or 'unknown'}, Python {env['python']}")


# ---- report ----------------------------------------------------------------------------------------------


def read_junit(path: Path) -> dict[str, Any]:
    """Counts and the per-test outcome of a pytest --junitxml file."""
    if not path.is_file():
        return {"present": False, "tests": []}
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                detail = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else ""
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})
    counts = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    return {"present": True, "counts": counts, "tests": cases}


def build_report(outdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = json.loads((outdir / "env.json").read_text()) if (outdir / "env.json").is_file() else {}
    tests = read_junit(outdir / "gpu-tests.xml")
    bench_path = outdir / "gpu-bench.json"
    bench = json.loads(bench_path.read_text()) if bench_path.is_file() else None
    anchor_path = outdir / "anchor-bench.json"
    anchor = json.loads(anchor_path.read_text()) if anchor_path.is_file() else None
    anchor_md_path = outdir / "anchor-bench.md"
    anchor_md = anchor_md_path.read_text() if anchor_md_path.is_file() else None
    nixl_md_path = outdir / "nixl-colocated.md"
    nixl_md = nixl_md_path.read_text() if nixl_md_path.is_file() else None
    gpu_result = (bench or {}).get("results", {}).get("gpu")
    targets = [t for t in (bench or {}).get("targets", []) if t["target"].startswith("GPU")]
    return {"generated_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": env,
            "machine_summary": describe_machine(env), "command": args.command, "installed": args.installed or [],
            "cuda": bool(env.get("cuda_available")), "tests_rc": args.tests_rc, "bench_rc": args.bench_rc,
            "tests": tests, "bench": {"ran": bench is not None, "targets": targets, "result": gpu_result,
                                      "errors": (bench or {}).get("errors", {})},
            "anchor": anchor, "anchor_md": anchor_md, "anchor_rc": args.anchor_rc, "nixl_md": nixl_md,
            "nixl_rc": args.nixl_rc, "note": args.note,
            "ok": args.tests_rc == 0 and (args.bench_rc in (0, None)) and bool(env.get("cuda_available"))}


def render_report(report: dict[str, Any]) -> str:
    lines = ["# ckpt-engine GPU check", "", f"- generated {report['generated_utc']} by `{report['command']}`",
             f"- machine: {report['machine_summary']}"]
    if report["installed"]:
        lines.append(f"- installed from the wheel folder: {', '.join(report['installed'])}")
    else:
        lines.append("- installed from the wheel folder: nothing (every dependency was already there)")
    lines.append("")
    if report.get("note"):
        lines += [f"**Stopped early:** {report['note']}.", ""]
    if not report["cuda"]:
        lines += ["**No CUDA device on this machine.** The GPU tests were collected and skipped; the GPU benchmark "
                  "was not run. Nothing here proves the CUDA path: run this on a CUDA machine.", ""]
    tests = report["tests"]
    lines += ["## GPU tests (tests/gpu)", ""]
    if not tests["present"]:
        lines += [f"No test results (pytest exit code {report['tests_rc']}); see gpu-tests.log.", ""]
    else:
        c = tests["counts"]
        lines += [f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
                  f"(pytest exit code {report['tests_rc']}).", "", "| Test | Outcome | s | Detail |",
                  "|---|---|---:|---|"]
        for case in tests["tests"]:
            detail = case["detail"].replace("|", "\\|")
            lines.append(f"| `{case['test']}` | {case['outcome']} | {case['seconds']:.1f} | {detail} |")
        lines.append("")
    lines += ["## GPU benchmark (bench/gpu_bench.py)", ""]
    bench = report["bench"]
    if not bench["ran"]:
        lines += ["Not run" + (" (no CUDA)." if not report["cuda"] else f" or failed (exit code {report['bench_rc']}); "
                                                                          "see gpu-bench.log."), ""]
    else:
        if bench["errors"]:
            lines += [f"Errors: {', '.join(bench['errors'])} (see gpu-bench.log)", ""]
        lines += ["| Target | Threshold | Measured | Status |", "|---|---|---|---|"]
        for t in bench["targets"]:
            threshold = f"{t['op']} {t['threshold']:g}{t['unit']}"
            lines.append(f"| {t['target']} | {threshold} | {t['summary']} | **{t['status']}** |")
        lines += [""] + key_figures(bench["result"])
        lines += ["", "Every figure with its method: [gpu-bench.md](gpu-bench.md); raw samples: gpu-bench.json.", ""]
    lines += anchor_section(report)
    lines += nixl_section(report)
    lines += ["Files: env.json (machine), gpu-tests.log / gpu-tests.xml (pytest), gpu-bench.log / gpu-bench.md / "
              "gpu-bench.json (benchmark), anchor-bench.log / anchor-bench.md / anchor-bench.json (side by side), "
              "nixl-colocated.log / .md / .json (the colocated NIXL pull), report.json (this report as data).", ""]
    return "\n".join(lines)


def anchor_section(report: dict[str, Any]) -> list[str]:
    """The side by side with MoonshotAI's checkpoint-engine: its table, or why it did not run."""
    lines = [f"## Side by side with MoonshotAI's checkpoint-engine (bench/anchor_bench.py, {ANCHOR[0]})", ""]
    if report.get("anchor_md") is None:
        why = "no CUDA" if not report["cuda"] else f"failed, exit code {report.get('anchor_rc')}; see anchor-bench.log"
        return lines + [f"Not run ({why}).", ""]
    # The table as anchor_bench rendered it, without its own heading: this helper imports nothing of ours.
    body = [line for line in report["anchor_md"].splitlines() if not line.startswith("## ")]
    return lines + body + [""]


def nixl_section(report: dict[str, Any]) -> list[str]:
    """The colocated NIXL pull beside our CUDA IPC path: its table, or why it did not run."""
    lines = ["## The colocated NIXL pull (bench/nixl_colocated.py)", ""]
    if report.get("nixl_md") is None:
        major = str(report.get("torch_cuda") or "").split(".")[0] or "N"
        if not report["cuda"]:
            why = "no CUDA"
        elif report.get("nixl_rc") is None:
            why = f"NIXL is not installed here (scripts/gpu-wheels.sh --nixl {major}, the CUDA major of this torch)"
        else:
            why = f"failed, exit code {report['nixl_rc']}; see nixl-colocated.log"
        return lines + [f"Not run ({why}).", ""]
    body = [line for line in report["nixl_md"].splitlines() if not line.startswith("## ")]
    return lines + body + [""]


def key_figures(result: dict[str, Any] | None) -> list[str]:
    """The figures the issue asks about, from the gpu section's result: rates, and cached vs bypass_cpu."""
    if not result or result.get("skipped"):
        return []
    lines = [f"- digest kernel: {result.get('kernel')}"]
    for c in result.get("local", []):
        v = c["variants"]
        r = c.get("ratios", {})
        ratio = lambda key, r=r: f"{r[key]['value']:.3f}" if key in r else "?"  # noqa: E731
        lines.append(f"- {c['name']}: PCIe {c['pcie_gbps']:.1f} GB/s (best of D2H/H2D), device copy "
                     f"{v['d2d_copy']['gbps']['median']:.0f} GB/s, digest {v['digest']['gbps']['median']:.0f} GB/s, "
                     f"snapshot {v['snapshot']['gbps']['median']:.1f} GB/s (÷ pinned copy {ratio('snapshot_vs_d2h')}, "
                     f"goal ≥ 0.8), bypass fill {v['fill']['gbps']['median']:.0f} GB/s (÷ device copy "
                     f"{ratio('fill_vs_d2d')}, goal ≥ 0.5)")
    for c in result.get("digest", []):  # issue 36: the device digest at memory speed
        v, r = c["variants"], c.get("ratios", {})
        read = r.get("digest_vs_read", {}).get("value")
        lines.append(f"- device digest, {c['name']}: {v['digest']['gbps']['median']:.0f} GB/s (goal ≥ 1,000), "
                     f"÷ read floor {read if read is None else f'{read:.2f}'} (goal ≥ 0.25; read floor "
                     f"{v['read']['gbps']['median']:.0f} GB/s)")
    for kind in ("ipc", "nccl"):
        p = result.get(kind) or {}
        if "variants" not in p:
            lines.append(f"- {kind}: {p.get('skipped', 'not measured')}")
            continue
        cached, bypass = (p["variants"][f"{kind}_{m}"] for m in ("cached", "bypass"))
        r = p["ratios"]
        lines.append(f"- {kind}: time-to-verified cached {cached['seconds']['median']:.4f} s, bypass_cpu "
                     f"{bypass['seconds']['median']:.4f} s (bypass ÷ cached {r['bypass_over_cached']['value']:.2f}; "
                     f"the seed claims ~0.76); trainer held cached {cached['held']['median']:.4f} s, bypass_cpu "
                     f"{bypass['held']['median']:.4f} s")
    return lines


# ---- command line ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    reqs = sub.add_parser("requirements")
    reqs.add_argument("--anchor", action="store_true", help="also the side by side's anchor package")
    reqs.add_argument("--nixl", choices=("12", "13"), default=None, help="NIXL alone, for this CUDA major")
    anchor_deps = sub.add_parser("anchor-deps")
    anchor_deps.add_argument("--wheels", type=Path, required=True)
    missing = sub.add_parser("missing")
    missing.add_argument("--wheels", type=Path, required=True)
    closure = sub.add_parser("closure")
    closure.add_argument("--wheels", type=Path, required=True)
    closure.add_argument("--python", required=True, help="target Python version, e.g. 3.12")
    closure.add_argument("--platform", action="append", default=None, help="target platform tag (repeatable)")
    slim = sub.add_parser("slim-nixl")
    slim.add_argument("wheel", type=Path)
    stage_p = sub.add_parser("stage")
    stage_p.add_argument("dest", type=Path)
    sub.add_parser("probe")
    report = sub.add_parser("report")
    report.add_argument("outdir", type=Path)
    report.add_argument("--command", default="scripts/gpu-check.sh")
    report.add_argument("--tests-rc", type=int, default=None)
    report.add_argument("--bench-rc", type=int, default=None)
    report.add_argument("--anchor-rc", type=int, default=None)
    report.add_argument("--nixl-rc", type=int, default=None)
    report.add_argument("--installed", nargs="*", default=[])
    report.add_argument("--note", default=None, help="why the run stopped early")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except CheckError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "requirements" and args.nixl:
        print(nixl_requirement(args.nixl))
    elif args.cmd == "requirements":
        print("\n".join(requirements() + (list(ANCHOR) if args.anchor else [])))
    elif args.cmd == "anchor-deps":
        wheel = WheelDir(args.wheels, _tags.sys_tags()).best(Requirement(ANCHOR[0]))
        print("\n".join(str(r) for r in wheel_requires(wheel) if canonicalize_name(r.name) not in NOT_FROM_WHEELS))
    elif args.cmd == "missing":
        wheels = WheelDir(args.wheels, _tags.sys_tags()) if args.wheels.is_dir() else None
        if wheels is None:
            unmet = [r for r in requirements() if not _met(Requirement(r))]
            if unmet:
                raise CheckError(f"missing here: {', '.join(unmet)}; and no wheel folder at {args.wheels} "
                                 "(fetch one with scripts/gpu-wheels.sh on a machine with internet access)")
            return 0
        chosen = plan(requirements(), wheels)
        for name, path in [*anchor_plan(wheels).items(), *nixl_plan(wheels).items()]:
            chosen.setdefault(name, path)
        for path in chosen.values():
            print(path)
    elif args.cmd == "closure":
        platforms = args.platform or list(MANYLINUX_X86_64)
        wheels = WheelDir(args.wheels, _target_tags(args.python, platforms))
        chosen = plan(requirements() + list(ANCHOR), wheels, assume_nothing_installed=True,
                      environment=_target_environment(args.python))
        for name, path in sorted(chosen.items()):
            print(f"{name:<22} {path.name}")
        print(f"complete: {len(chosen)} wheels cover every requirement for CPython {args.python} "
              f"({platforms[0]} and older)", file=sys.stderr)
    elif args.cmd == "slim-nixl":
        before, after = slim_nixl(args.wheel)
        print(f"gpu_check: {args.wheel.name} slimmed from {before / 2**20:.1f} MiB to {after / 2**20:.1f} MiB",
              file=sys.stderr)
    elif args.cmd == "stage":
        print(f"gpu_check: staged {', '.join(stage(args.dest))} in {args.dest}", file=sys.stderr)
    elif args.cmd == "probe":
        print(json.dumps(probe(), indent=1))
    elif args.cmd == "report":
        data = build_report(args.outdir, args)
        (args.outdir / "report.json").write_text(json.dumps(data, indent=1, default=str))
        (args.outdir / "report.md").write_text(render_report(data))
        print(f"wrote {args.outdir / 'report.md'} and report.json")
    return 0


def _met(req: Any) -> bool:
    have = installed_version(req.name)
    return have is not None and req.specifier.contains(have, prereleases=True)


if __name__ == "__main__":
    sys.exit(main())
