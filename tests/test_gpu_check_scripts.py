"""scripts/gpu-check.sh and its helper on this machine: which wheels it would install, the package tree it
stages, a dry run, and a real run without CUDA (it says so, the GPU tests skip, it exits 0)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check.sh"


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


gpu_check = _helper()


def _wheel(folder: Path, name: str, version: str, requires: list[str], tag: str = "py3-none-any") -> Path:
    """A minimal wheel: only what the planner reads (file name and METADATA)."""
    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Requires-Dist: {r}" for r in requires]
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_requirements_are_the_dependencies_without_torch_plus_the_test_runner() -> None:
    names = [r.split(">")[0].split("=")[0].split("<")[0] for r in gpu_check.requirements()]
    assert "torch" not in names
    assert {"fastapi", "uvicorn", "pyzmq", "pydantic", "pytest", "pytest-timeout"} <= set(names)


def test_plan_takes_only_what_is_missing_and_what_that_needs(tmp_path: Path) -> None:
    _wheel(tmp_path, "alpha_pkg", "1.0", ["beta-pkg>=2", "pytest>=1", "gamma-pkg; python_version < '3'",
                                          "delta-pkg; extra == 'fancy'"])
    _wheel(tmp_path, "beta_pkg", "1.5", [])
    _wheel(tmp_path, "beta_pkg", "2.1", [])
    wheels = gpu_check.WheelDir(tmp_path, gpu_check._tags.sys_tags())
    chosen = gpu_check.plan(["alpha-pkg>=1", "pytest>=1"], wheels)  # pytest is installed here: kept
    assert {name: path.name for name, path in chosen.items()} == {
        "alpha-pkg": "alpha_pkg-1.0-py3-none-any.whl", "beta-pkg": "beta_pkg-2.1-py3-none-any.whl"}
    with pytest.raises(gpu_check.CheckError, match=r"gpu-wheels.sh"):
        gpu_check.plan(["epsilon-pkg"], wheels)


def test_closure_checks_wheels_for_the_target_python_not_this_one(tmp_path: Path) -> None:
    _wheel(tmp_path, "native_pkg", "1.0", [], tag="cp399-cp399-manylinux_2_17_x86_64")
    target = gpu_check.WheelDir(tmp_path, gpu_check._target_tags("3.99", gpu_check.MANYLINUX_X86_64))
    assert list(gpu_check.plan(["native-pkg"], target, assume_nothing_installed=True)) == ["native-pkg"]
    here = gpu_check.WheelDir(tmp_path, gpu_check._tags.sys_tags())
    with pytest.raises(gpu_check.CheckError, match="installs on this Python"):
        gpu_check.plan(["native-pkg"], here)


def test_staged_package_has_server_and_workers_under_ckpt_engine(tmp_path: Path) -> None:
    packages = gpu_check.stage(tmp_path / "pkg")
    assert {"ckpt_engine.server", "ckpt_engine.workers", "ckpt_engine.workers.adapters"} <= set(packages)
    code = "import ckpt_engine, ckpt_engine.server.daemon, ckpt_engine.workers.agent; print(ckpt_engine.__file__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120, check=True)
    assert out.stdout.strip() == str(tmp_path / "pkg" / "ckpt_engine" / "__init__.py")


def _gpu_check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "CKPT_GPU_SITE": str(tmp_path / "site"), "TMPDIR": str(tmp_path)}
    (tmp_path / "wheels").mkdir(exist_ok=True)  # everything is installed here: nothing is taken from it
    return subprocess.run(["bash", str(SCRIPT), "--wheels", str(tmp_path / "wheels"), *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=240)


def test_dry_run_prints_the_commands_and_runs_none(tmp_path: Path) -> None:
    out = _gpu_check(tmp_path, "--dry-run", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "would run:" in out.stdout and "-m pytest" in out.stdout and "gpu_check.py report" in out.stdout
    assert "-m ckpt_engine.bench.anchor_bench" in out.stdout and "side by side" in out.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "site").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the whole GPU check")
def test_without_cuda_it_says_so_skips_the_gpu_tests_and_exits_0(tmp_path: Path) -> None:
    out = _gpu_check(tmp_path, str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no CUDA device here" in out.stderr
    report = (tmp_path / "out" / "report.md").read_text()
    assert "No CUDA device on this machine" in report and " 0 failed, 0 errors, " in report
    junit = gpu_check.read_junit(tmp_path / "out" / "gpu-tests.xml")
    assert junit["counts"]["skipped"] == len(junit["tests"]) > 0
    assert not (tmp_path / "out" / "gpu-bench.json").exists()
    assert "side by side with MoonshotAI's checkpoint-engine is skipped" in out.stderr
    assert "## Side by side with MoonshotAI's checkpoint-engine" in report and "Not run (no CUDA)." in report
    assert not (tmp_path / "out" / "anchor-bench.json").exists()


def test_wheel_list_includes_the_anchor_and_gpu_wheels_asks_for_it(capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main(["requirements", "--anchor"]) == 0
    assert "checkpoint-engine==0.4.2" in capsys.readouterr().out.splitlines()
    assert gpu_check.main(["requirements"]) == 0
    assert "checkpoint-engine==0.4.2" not in capsys.readouterr().out  # the check itself does not need it
    script = (REPO / "scripts" / "gpu-wheels.sh").read_text()
    assert "requirements --anchor" in script and "--no-deps" in script and "anchor-deps" in script


def test_anchor_deps_are_its_requirements_without_torch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _wheel(tmp_path, "checkpoint_engine", "0.4.2", ["torch>=2.5.0", "loguru", "mooncake-x; extra == 'p2p'"])
    assert gpu_check.main(["anchor-deps", "--wheels", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == ["loguru"]


def test_anchor_wheels_are_installed_when_present_and_skipped_when_not(tmp_path: Path) -> None:
    wheels = gpu_check.WheelDir(tmp_path, gpu_check._tags.sys_tags())
    assert gpu_check.anchor_plan(wheels) == {}  # no wheels: the side by side is skipped, the check goes on
    _wheel(tmp_path, "checkpoint_engine", "0.4.2", ["torch>=2.5.0", "loguru-pkg", "mooncake-x; extra == 'p2p'"])
    _wheel(tmp_path, "loguru_pkg", "1.0", [])
    wheels = gpu_check.WheelDir(tmp_path, gpu_check._tags.sys_tags())
    chosen = gpu_check.anchor_plan(wheels)
    assert sorted(chosen) == ["checkpoint-engine", "loguru-pkg"]  # torch is the machine's own


def _anchor_bench():
    sys.path.insert(0, str(REPO))
    from ckpt_engine.bench import anchor_bench

    return anchor_bench


def test_anchor_sizes_scale_down_to_the_memory_there_is() -> None:
    ab = _anchor_bench()
    GiB = 1 << 30
    assert ab.scaled_sizes(ab.FULL_SIZES, 141 * GiB, 1024 * GiB) == list(ab.FULL_SIZES)
    assert ab.scaled_sizes(ab.FULL_SIZES, 80 * GiB, 1024 * GiB) == [(4, 500), (4, 20000), (8, 500), (8, 20000)]
    assert ab.scaled_sizes(ab.FULL_SIZES, 16 * GiB, 1024 * GiB) == [(1, 500), (1, 20000)]
    assert ab.scaled_sizes(ab.FULL_SIZES, 4 * GiB, 1024 * GiB) == []


def test_anchor_table_has_time_rate_and_ratio_per_round() -> None:
    ab = _anchor_bench()
    records = [{"variant": v, "round": r, "seconds": s, "update": s / 2}
               for r in (-1, 0, 1, 2) for v, s in (("theirs", 2.0), ("ours_cached", 1.5), ("ours_bypass", 1.0))]
    digest = {"kernel": "compiled", "gbps": 900.0, "seconds": {}}
    config = ab.summarize({"gib": 1, "tensors": 500}, {"bytes": 1 << 30, "records": records, "digest": digest})
    assert config["ours_over_theirs"]["ours_bypass"]["value"] == pytest.approx(0.5)
    result = {"path": "colocated (CUDA IPC on cuda:0)", "gpus": 1, "anchor": "0.4.2", "configs": [config],
              "args": {"bucket_size": 256 << 20, "repeats": 3, "warmup": 1, "timeout_s": 60}}
    text = "\n".join(ab.render(result))
    assert "**0.75**" in text and "**0.50**" in text
    assert "device digest torch-block64 (compiled) 900.0 GB/s (goal ≥ 1,000 GB/s)" in text
    assert "not measured (no CUDA" in "\n".join(ab.render(ab.run({}, print)))


def test_anchor_sizes_are_read_as_gib_x_tensors_and_bad_ones_refused() -> None:
    ab = _anchor_bench()
    assert ab._sizes("16x500,4x20000") == ((16, 500), (4, 20000))
    for bad in ("16x", "16", "0x500", "16x-1", "ax500", "1_6x500", " 16x500", "1x100000000", "16x500,"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab._sizes(bad)


@pytest.mark.parametrize("odd", [False, True])
def test_fill_parts_runs_on_the_cpu_and_times_every_part(odd: bool) -> None:
    """The diagnostic the GPU runs (docs/gpu-runs.md): here only its structure (the CPU's figures mean nothing)."""
    cmd = [sys.executable, "-m", "ckpt_engine.bench.fill_parts", "--device", "cpu", "--mib", "1", "--count", "40",
           "--rounds", "1", *(["--odd"] if odd else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["tensors"] == 40 and (lines[0]["padding_views"] > 0) == odd
    assert lines[0]["memset_spans"] == 0  # never on the CPU (zero_whole_span)
    assert {line["form"] for line in lines[1:]} == {"fill", "foreach_copy_only", "foreach_zero_gaps_only",
                                                    "zero_whole_slots", "d2d_copy", "fill_host_queue_only"}


def test_fill_parts_times_the_padding_views_also_where_the_fill_takes_one_memset(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Found by the outside attack: on a GPU the fill zeroes a span in one memset, its plan holds no views, and
    the diagnostic reported no padding at all. The decision is forced here as a GPU makes it."""
    sys.path.insert(0, str(REPO))
    from ckpt_engine.bench import fill_parts
    from ckpt_engine.plan import tensors as plan_tensors

    monkeypatch.setattr(plan_tensors, "zero_whole_span", lambda device_type, gaps, span_bytes: True)
    monkeypatch.setattr(sys, "argv", ["fill_parts", "--device", "cpu", "--mib", "1", "--count", "40", "--rounds",
                                      "1", "--odd"])
    fill_parts.main()
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["padding_views"] > 0 and first["memset_spans"] >= 1


def _nixl_wheel(folder: Path, name: str = "nixl_cu12") -> Path:
    """A wheel laid out as nixl-cu12 1.5.1's (its folders, a plugin it needs and one it does not), with a
    RECORD as pip writes it: CSV, a name holding a comma quoted."""
    path = folder / f"{name}-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    members = {f"{name}/_api.py": b"api", f"{name}.libs/nixl/libplugin_UCX.so": b"ucx",
               f"{name}.libs/nixl/libplugin_GDS.so": b"gds", "nixl_ep_cu12/kernels.so": b"ep" * 100,
               f"{name}/odd,name.py": b"odd", f"{name}.scripts/nixlbench": b"tool"}
    record = "".join(f'"{n}",sha256=x,{len(d)}\n' if "," in n else f"{n},sha256=x,{len(d)}\n"
                     for n, d in members.items()) + f"{name}-1.5.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)
        archive.writestr(f"{name}-1.5.1.dist-info/RECORD", record)
    return path


def test_a_slimmed_nixl_wheel_keeps_what_the_transport_loads_and_its_record_lists_exactly_that(
        tmp_path: Path) -> None:
    import csv
    import io

    wheel = _nixl_wheel(tmp_path)
    gpu_check.slim_nixl(wheel)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        rows = list(csv.reader(io.StringIO(archive.read("nixl_cu12-1.5.1.dist-info/RECORD").decode())))
    assert names == {"nixl_cu12/_api.py", "nixl_cu12.libs/nixl/libplugin_UCX.so", "nixl_cu12/odd,name.py",
                     "nixl_cu12-1.5.1.dist-info/RECORD"}
    assert {row[0] for row in rows} == names  # (the quoted name kept, as one name)
    assert not list(tmp_path.glob("*.slim"))


def test_slimming_refuses_a_wheel_that_is_not_nixl_and_leaves_it_untouched(tmp_path: Path) -> None:
    wheel = _nixl_wheel(tmp_path, name="other_pkg")
    before = wheel.read_bytes()
    with pytest.raises(gpu_check.CheckError, match="not a NIXL wheel"):
        gpu_check.slim_nixl(wheel)
    assert wheel.read_bytes() == before and not list(tmp_path.glob("*.slim"))


@pytest.mark.parametrize(("torch_cuda", "hint"), [("12.8", "--nixl 12"), ("13.0", "--nixl 13"), (None, "--nixl N")])
def test_the_report_names_the_nixl_build_for_the_cuda_of_its_torch(torch_cuda: str | None, hint: str) -> None:
    lines = gpu_check.nixl_section({"cuda": True, "torch_cuda": torch_cuda, "nixl_md": None})
    assert hint in "\n".join(lines)


@pytest.mark.parametrize("damage", ["unterminated quote", "not utf-8", "not a zip"])
def test_slimming_refuses_a_wheel_whose_record_it_cannot_read_whole(tmp_path: Path, damage: str) -> None:
    """Outside attack, 2026-11-29: an unterminated quote swallowed the rest of the RECORD (rows dropped, exit
    0); invalid UTF-8 or a file that is not a zip ended in a traceback."""
    wheel = _nixl_wheel(tmp_path)
    if damage == "not a zip":
        wheel.write_bytes(b"not a zip")
    else:
        with zipfile.ZipFile(wheel) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
        record = "nixl_cu12-1.5.1.dist-info/RECORD"
        members[record] = (b'"nixl_cu12/_api.py,sha256=x,3\n' if damage == "unterminated quote" else b"\xff\xfe") \
            + members[record]
        with zipfile.ZipFile(wheel, "w") as archive:
            for name, data in members.items():
                archive.writestr(name, data)
    before = wheel.read_bytes()
    with pytest.raises(gpu_check.CheckError):
        gpu_check.slim_nixl(wheel)
    assert wheel.read_bytes() == before and not list(tmp_path.glob("*.slim"))
