"""The GPU kit: the wheels a lent GPU machine lacks, gathered here, installed there.

A lent machine has no network and no Dask, zarr, pydantic, DeepSpeed or TRL
(``gpu/device.txt`` says what it has); files reach it only with the command that runs
there, 64 MiB a call. So the wheels travel in a git-ignored folder (``.gpu-kit/``, the
``carry`` of that command):

* ``build`` (``make gpu-kit``, here): downloads ``gpu/requirements-kit.txt`` for CPython
  3.12 on manylinux x86_64 into ``.gpu-kit/wheels``, builds DeepSpeed's wheel here without
  compiled ops (PyPI has only its source), downloads ``gpu/requirements-fallback.txt``
  into ``.gpu-kit/fallback``, then checks that every requirement of every kit wheel is met
  by the kit, the fallback or the machine, that the whole installs for the machine's
  Python and platform into a fresh folder, and that it weighs under ``LIMIT_MIB``.
* ``install TARGET`` (``gpu/check.py`` runs it there): installs every kit wheel into a
  fresh ``TARGET`` (``pip install --no-index --no-deps --target``), and a fallback wheel
  only where the machine's own copy is missing or older than a kit package needs. Prints
  what it did as JSON. ``TARGET`` must have ``site-packages`` in its path: ``dill``
  (datasets' hashing) pickles modules from anywhere else by value, which fails.

``--dry-run`` builds ``.gpu-kit-dry`` instead: ``DRY_RUN``, a few small pure-Python
wheels of the kit, for the CPU dry run (``make gpu-check GPU=0``), which cannot import
the CPython 3.12 wheels on this Python.

Standard library only, and ``packaging`` (pip's own copy where there is no other), so it
runs on the GPU machine before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip always has a copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "gpu"
KIT = ROOT / ".gpu-kit"
DRY_KIT = ROOT / ".gpu-kit-dry"
REQUIREMENTS = GPU / "requirements-kit.txt"
FALLBACK = GPU / "requirements-fallback.txt"
DEVICE = GPU / "device.txt"
#: The GPU machine's interpreter and platform, as pip spells them.
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
#: What a call to the GPU machine carries at most is 64 MiB; the kit stays well under.
LIMIT_MIB = 40
#: On PyPI as source only: built here (``build_wheel``).
BUILT = ("deepspeed",)
#: The dry run's kit: small pure-Python wheels of the kit, importable on any Python 3.
DRY_RUN = ("toolz", "tblib", "locket", "sortedcontainers", "zict", "cloudpickle")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> list[str]:
    """The lines of ``path`` without comments and blanks."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of ``path``: canonical name -> the line."""
    return {canonical(Requirement(line).name): line for line in read_list(path)}


def device_tags() -> list[str]:
    """pip options that pick wheels for the GPU machine's Python and platform."""
    tags = ["--only-binary=:all:", "--implementation", "cp",
            "--python-version", PYTHON_VERSION]
    for platform in PLATFORMS:
        tags += ["--platform", platform]
    return tags


def pip(*args: str) -> None:
    """Run pip of this interpreter; a failure stops with its output."""
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


# --------------------------------------------------------------------------- wheels


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """``(canonical name, version, Requires-Dist lines)`` of a wheel file."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist()
                    if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode("utf-8", "replace")
    headers = text.split("\n\n", 1)[0].splitlines()
    field = {}
    requires = []
    for line in headers:
        key, _, value = line.partition(": ")
        if key == "Requires-Dist":
            requires.append(value.strip())
        else:
            field.setdefault(key, value.strip())
    return canonical(field["Name"]), field["Version"], requires


def wheels(folder: Path) -> dict[str, tuple[Path, str, list[str]]]:
    """The wheels in ``folder``: canonical name -> ``(file, version, Requires-Dist)``."""
    out = {}
    for wheel in sorted(folder.glob("*.whl")) if folder.is_dir() else ():
        name, version, requires = wheel_metadata(wheel)
        out[name] = (wheel, version, requires)
    return out


def requirements_of(requires: list[str], python: str = PYTHON_VERSION) -> list[Requirement]:
    """The requirements of a wheel that apply on Linux under ``python`` (no extras)."""
    env = {**default_environment(), "python_version": python, "python_full_version":
           f"{python}.0", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
    out = []
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(env):
            out.append(requirement)
    return out


def unmet(kit: dict, fallback: dict, device: set[str]) -> list[str]:
    """Requirements of kit wheels that nothing meets: not a kit or fallback wheel of a
    version it accepts, not a package of the machine (whose versions are checked there,
    at install)."""
    problems = []
    for name, (_, _, requires) in sorted(kit.items()):
        for requirement in requirements_of(requires):
            need = canonical(requirement.name)
            have = kit.get(need) or fallback.get(need)
            if have is not None and not requirement.specifier.contains(have[1],
                                                                      prereleases=True):
                problems.append(f"{name} needs {requirement}, the kit has {have[1]}")
            elif have is None and need not in device:
                problems.append(f"{name} needs {requirement}: not in the kit, nor on the "
                                f"machine (gpu/device.txt)")
    return problems


# --------------------------------------------------------------------------- build


def build_wheel(requirement: str, folder: Path) -> None:
    """A wheel of ``requirement`` built here from its source, without compiled ops
    (DeepSpeed compiles an op the first time it is used): pure Python, any platform."""
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(folder), requirement], check=True, env=env)


def build(dry_run: bool = False) -> dict:
    """Gather the kit (see the module docstring); returns its summary."""
    kit_dir = DRY_KIT if dry_run else KIT
    shutil.rmtree(kit_dir, ignore_errors=True)
    folder, spare = kit_dir / "wheels", kit_dir / "fallback"
    required = pins(REQUIREMENTS)
    chosen = [required[canonical(n)] for n in DRY_RUN] if dry_run else \
        [line for name, line in required.items() if name not in BUILT]
    pip("download", "--no-deps", *device_tags(), "--dest", str(folder), *chosen)
    if not dry_run:
        for name in BUILT:
            build_wheel(required[name], folder)
        pip("download", "--no-deps", *device_tags(), "--dest", str(spare),
            *pins(FALLBACK).values())
    kit, fallback = wheels(folder), wheels(spare)
    missing = sorted(set(canonical(Requirement(c).name) for c in chosen) - set(kit))
    problems = [f"{name}: no wheel was gathered" for name in missing]
    if not dry_run:
        problems += unmet(kit, fallback, {canonical(n) for n in read_list(DEVICE)})
    with tempfile.TemporaryDirectory() as tmp:  # installs there, as it is, into a fresh folder
        pip("install", "--no-index", "--no-deps", "--quiet", *device_tags(), "--target",
            str(Path(tmp) / "site-packages"), *(str(w) for w, _, _ in kit.values()),
            *(str(w) for w, _, _ in fallback.values()))
    size = sum(f.stat().st_size for f in kit_dir.rglob("*") if f.is_file())
    if size > LIMIT_MIB * 2 ** 20:
        problems.append(f"the kit weighs {size / 2 ** 20:.1f} MiB, over {LIMIT_MIB} MiB")
    return {"kit": str(kit_dir.relative_to(ROOT)), "wheels": len(kit),
            "fallback": len(fallback), "mib": round(size / 2 ** 20, 2),
            "carry": [str(kit_dir.relative_to(ROOT))], "problems": problems}


# --------------------------------------------------------------------------- install


def installed_version(name: str, exclude: Path) -> str | None:
    """The version of distribution ``name`` this interpreter finds outside ``exclude``
    (the machine's own copy), or None."""
    paths = [p for p in sys.path if p and Path(p).resolve() != exclude.resolve()]
    for dist in importlib.metadata.distributions(path=paths):
        if canonical(dist.metadata["Name"] or "") == name:
            return dist.version
    return None


def install(kit_dir: Path, target: Path, force_tags: bool = False) -> dict:
    """Install the kit in ``kit_dir`` into ``target`` (emptied first); see the module
    docstring. ``force_tags`` installs for the GPU machine's Python and platform whatever
    this interpreter is (the dry run). Returns what was installed and what the machine's
    packages leave unmet, as plain data."""
    if "site-packages" not in target.parts:
        raise SystemExit(f"{target}: the kit's folder must have 'site-packages' in its "
                         f"path (dill pickles modules from elsewhere by value)")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    kit, fallback = wheels(kit_dir / "wheels"), wheels(kit_dir / "fallback")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    needs: dict[str, list[Requirement]] = {}
    for _, _, requires in kit.values():
        for requirement in requirements_of(requires, python):
            needs.setdefault(canonical(requirement.name), []).append(requirement)
    taken, reasons = [], {}
    for name, (wheel, _, _) in fallback.items():
        mine = installed_version(name, target)
        wanted = [r for r in needs.get(name, []) if mine is not None and
                  not r.specifier.contains(mine, prereleases=True)]
        if mine is None or wanted:
            taken.append(wheel)
            reasons[name] = "missing" if mine is None else \
                f"{mine} here, {wanted[0]} needed"
    files = [str(w) for w, _, _ in kit.values()] + [str(w) for w in taken]
    tags = device_tags() if force_tags else []
    if files:
        _install_files(files, target, tags)
    unmet_here = []
    for name, requirements in sorted(needs.items()):
        if name in kit or name in reasons:
            continue
        mine = installed_version(name, target)
        for requirement in requirements:
            if mine is None or not requirement.specifier.contains(mine, prereleases=True):
                unmet_here.append(f"{requirement} ({mine or 'missing'} here)")
    return {"target": str(target), "kit": {n: v for n, (_, v, _) in kit.items()},
            "fallback_taken": reasons, "unmet": sorted(set(unmet_here)),
            "python": python}


def _install_files(files: list[str], target: Path, tags: list[str]) -> None:
    """``pip install --no-index --no-deps --target``; without pip, the wheels unzipped
    (what pip does for pure and platform wheels alike, scripts aside)."""
    if importlib.util.find_spec("pip") is None:
        for wheel in files:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
            for data in target.glob("*.data"):
                for kind in ("purelib", "platlib"):
                    if (data / kind).is_dir():
                        shutil.copytree(data / kind, target, dirs_exist_ok=True)
                shutil.rmtree(data)
        return
    pip("install", "--no-index", "--no-deps", "--quiet", "--disable-pip-version-check",
        "--no-compile", *tags, "--target", str(target), *files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="gather the kit (here, with network)")
    build_cmd.add_argument("--dry-run", action="store_true",
                           help="gather the dry run's few pure-Python wheels only")
    install_cmd = commands.add_parser("install", help="install the kit into a fresh TARGET")
    install_cmd.add_argument("target", type=Path)
    install_cmd.add_argument("--kit", type=Path, default=KIT)
    install_cmd.add_argument("--device-tags", action="store_true",
                             help="install for CPython 3.12 on manylinux whatever runs this")
    args = parser.parse_args()
    if args.command == "build":
        summary = build(args.dry_run)
        print(json.dumps(summary))
        for problem in summary["problems"]:
            print(f"gpu kit: {problem}", file=sys.stderr)
        if summary["problems"]:
            raise SystemExit(1)
        print(f"gpu kit: {summary['wheels']} wheels and {summary['fallback']} fallback "
              f"wheels, {summary['mib']} MiB in {summary['kit']}/; carry "
              f"{json.dumps(summary['carry'])}", file=sys.stderr)
    else:
        print(json.dumps(install(args.kit, args.target.resolve(), args.device_tags)))


if __name__ == "__main__":
    main()
