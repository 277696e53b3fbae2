"""The GPU kit (gpu/kit.py) and the GPU check (gpu/check.py), proved on a CPU.

The kit's rules run on hand-made wheels; the dry run (``make gpu-check GPU=0``) runs the
whole check as a lent GPU machine would, on the CPU with tiny sizes. It downloads the
dry run's few pure-Python wheels from PyPI the first time (``.gpu-kit-dry/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "gpu"))
import kit  # noqa: E402


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel of one module ``name`` holding ``VERSION``."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def test_the_requirement_lists_pin_each_package_once():
    required, fallback = kit.pins(kit.REQUIREMENTS), kit.pins(kit.FALLBACK)
    for line in [*required.values(), *fallback.values()]:
        assert "==" in line, line
    assert not set(required) & set(fallback)
    assert {kit.canonical(n) for n in (*kit.DRY_RUN, *kit.BUILT)} <= set(required)
    device = {kit.canonical(n) for n in kit.read_list(kit.DEVICE)}
    assert not set(required) & device  # the kit is what the machine lacks


def test_unmet_names_requirements_nothing_meets(tmp_path):
    _wheel(tmp_path / "kit", "alpha", "1.0", ("beta>=2", "torch", "gamma; extra == 'x'",
                                              "delta; python_version < '3.12'"))
    _wheel(tmp_path / "kit", "beta", "1.5")
    _wheel(tmp_path / "kit", "omega", "1.0", ("zeta",))
    kits, fallback = kit.wheels(tmp_path / "kit"), kit.wheels(tmp_path / "none")
    assert kit.unmet(kits, fallback, {"torch"}) == [
        "alpha needs beta>=2, the kit has 1.5",
        "omega needs zeta: not in the kit, nor on the machine (gpu/device.txt)"]
    (tmp_path / "kit" / "beta-1.5-py3-none-any.whl").unlink()
    _wheel(tmp_path / "kit", "beta", "2.0")
    _wheel(tmp_path / "fallback", "zeta", "3.0")
    assert kit.unmet(kit.wheels(tmp_path / "kit"), kit.wheels(tmp_path / "fallback"),
                     {"torch"}) == []


def test_install_takes_a_fallback_wheel_only_where_this_python_lacks_it(tmp_path):
    _wheel(tmp_path / "kit" / "wheels", "alpha", "1.0", ("beta>=2", "packaging>=20"))
    _wheel(tmp_path / "kit" / "fallback", "beta", "2.0")
    _wheel(tmp_path / "kit" / "fallback", "packaging", "0.1")  # this Python has a newer one
    target = tmp_path / "fresh" / "site-packages"
    target.mkdir(parents=True)
    (target / "stale.txt").write_text("from an earlier install")
    report = kit.install(tmp_path / "kit", target)
    assert report["kit"] == {"alpha": "1.0"}
    assert report["fallback_taken"] == {"beta": "missing"}
    assert report["unmet"] == []
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith("dist-info")) == \
        ["alpha", "beta"]  # fresh: the stale file is gone, packaging is this Python's own
    with pytest.raises(SystemExit, match="site-packages"):
        kit.install(tmp_path / "kit", tmp_path / "elsewhere")


def test_a_runs_figures_are_its_steady_medians(tmp_path):
    import check

    records = [{"iteration": i, "samples": 8, "iteration_s": s, "reward_mean": r,
                "stage_s": {"generate": g}, "gen_tokens_per_s": 100.0 * (i + 1)}
               for i, (s, r, g) in enumerate([(9.0, 0.1, 5.0), (1.0, 0.2, 0.5),
                                              (3.0, 0.3, 0.7), (2.0, 0.4, 0.6)])]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = check.run_figures(metrics)
    assert figures["iteration_s"] == 2.0 and figures["samples_per_s"] == 4.0
    assert figures["stage_s"] == {"generate": 0.6}
    assert (figures["reward_first"], figures["reward_last"]) == (0.1, 0.4)
    assert check.run_figures(tmp_path / "missing.jsonl") == {}


@pytest.mark.slow
def test_the_dry_run_installs_the_kit_fresh_and_writes_every_part(tmp_path):
    """``make gpu-check GPU=0``: the kit's wheels installed into a fresh folder for
    CPython 3.12 on manylinux and imported from there, every part run (TRL skipped where
    it is not installed) in an environment holding only the GPU machine's packages and
    the kit's, and one JSON of figures."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "gpu/check.py", "--dry-run", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["dry_run"] and report["kit"]["status"] == "ok", report["kit"]
    target = report["kit"]["target"]
    assert set(report["kit"]["kit"]) == {kit.canonical(n) for n in kit.DRY_RUN}
    parts = report["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {
        "environment": "ok", "pytest": "ok", "grpo-tiny": "ok", "generation": "ok",
        "grpo-large": "ok", "trl": parts["trl"]["status"]}
    assert parts["trl"]["status"] in ("ok", "skipped")
    modules = parts["environment"]["figures"]["modules"]
    for name in ("toolz", "tblib", "zict"):  # from the fresh folder, not this Python's
        assert modules[name].startswith(target), (name, modules[name])
    assert modules["dask"] and not modules["dask"].startswith(target)
    tests = parts["pytest"]["figures"]
    assert tests["passed"] >= 8 and tests["failed"] == tests["error"] == 0
    for run in ("grpo-tiny", "grpo-large"):
        figures = parts[run]["figures"]
        assert figures["iterations"] == 2 and figures["iteration_s"] > 0
        assert "train_actor" in figures["stage_s"]
        assert (out / "runs" / run / "metrics.jsonl").is_file()
    generation = parts["generation"]["figures"]
    assert generation["greedy_identical"]["plain"] is True
    assert set(generation["verify_cost"]) == {"1", "4"}
    assert (out / "gpu-check.log").stat().st_size > 0
