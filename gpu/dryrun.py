"""The CPU dry run's stand-in for the GPU machine's Python: a fresh virtual environment
that holds only what that machine has, as far as this one has it.

``make gpu-check GPU=0`` cannot import the kit's CPython 3.12 wheels on this Python, so
it proves the rest: a virtual environment without site packages gets links to this
machine's installed copies of the GPU machine's packages (``gpu/device.txt`` and what
they require), of the fallback's (``gpu/requirements-fallback.txt``: the machine gets
those where it lacks them) and of the kit's packages *outside* the dry run's own few
wheels, which are installed from their wheel files into a fresh folder as on the
machine. A check that imports something neither the machine nor the kit has fails here
as it would there; a kit wheel installed into the wrong place is not found.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from kit import (
    DEVICE,
    DRY_RUN,
    FALLBACK,
    PYTHON_VERSION,
    REQUIREMENTS,
    canonical,
    pins,
    read_list,
    requirements_of,
)

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def _distributions() -> dict[str, importlib.metadata.Distribution]:
    """This interpreter's installed distributions by canonical name."""
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonical(name), dist)
    return out


def closure(names: list[str], installed: dict, python: str = HERE
            ) -> tuple[set[str], set[str]]:
    """``names`` and everything they require (under ``python``, without extras), as far
    as it is installed here: ``(found, missing)``."""
    found, missing, todo = set(), set(), [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in found or name in missing:
            continue
        dist = installed.get(name)
        if dist is None:
            missing.add(name)
            continue
        found.add(name)
        todo += [canonical(r.name) for r in requirements_of(dist.requires or [], python)]
    return found, missing


def top_level_entries(dist: importlib.metadata.Distribution) -> set[Path]:
    """The files and folders a distribution put directly into its site-packages."""
    base = Path(dist.locate_file(""))
    entries = set()
    for file in dist.files or ():
        parts = Path(file).parts
        if parts and parts[0] not in ("..", "__pycache__") and not parts[0].endswith(".pth"):
            entries.add(base / parts[0])
    return {e for e in entries if e.exists()}


def device_view(venv: Path) -> dict:
    """Create the virtual environment ``venv`` (see the module docstring); returns its
    interpreter and what it holds."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)],
                   check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    installed = _distributions()
    stand_ins = [n for n in pins(REQUIREMENTS) if n not in {canonical(d) for d in DRY_RUN}]
    device, device_missing = closure(read_list(DEVICE), installed)
    kit, kit_missing = closure(stand_ins, installed)
    # what the stand-ins require there is the machine's or the kit's (`make gpu-kit`
    # checks it); what they require only on this older Python comes along
    only_here = kit - closure(stand_ins, installed, PYTHON_VERSION)[0]
    # the fallback's wheels go to the machine where its own copy is missing: with them
    # (as far as they are installed here) the kit's requirements are met as there
    fallback = set(pins(FALLBACK)) & set(installed)
    chosen = device | (set(stand_ins) & kit) | only_here | fallback
    chosen -= {canonical(d) for d in DRY_RUN}
    for name in sorted(chosen):
        for entry in top_level_entries(installed[name]):
            link = site / entry.name
            if not link.exists():
                link.symlink_to(entry)
    return {"python": str(venv / "bin" / "python"), "packages": sorted(chosen),
            "device_missing_here": sorted(device_missing),
            "kit_missing_here": sorted(kit_missing & set(stand_ins)),
            "only_on_this_python": sorted(only_here)}
