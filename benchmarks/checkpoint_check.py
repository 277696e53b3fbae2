"""What checking a checkpoint costs on resume: the sizes ``state.json`` lists, compared by
one ``stat`` per file (``CheckpointStore.damage``, what a resume does), against hashing
every file (sha256), the check it does not do. The checkpoint holds a real model's
weights (SmolLM2-135M: 538 MB), published as a run publishes one (sizes listed by
``CheckpointStore.publish``).

Each check runs ``--rounds`` times, alternating; the figures are medians. Hashing reads
the files from the page cache after the first round: its best case.

    python benchmarks/checkpoint_check.py --model models/smollm2-135m [--rounds 5]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shared import emit_result

ROOT = Path(__file__).resolve().parents[1]


def sha256_all(folder: Path) -> dict[str, str]:
    """The sha256 of every file under ``folder``."""
    hashes = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        hashes[str(path.relative_to(folder))] = digest.hexdigest()
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from rlhfflow.storage import CheckpointStore

    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        store = CheckpointStore(Path(tmp) / "checkpoints")
        staging = store.begin(0)
        into = staging / "models" / "actor"
        into.mkdir()
        for source in args.model.iterdir():
            try:  # a hard link: the weights need not be written again
                os.link(source, into / source.name)
            except OSError:
                shutil.copy2(source, into / source.name)
        start = time.perf_counter()
        checkpoint = store.publish(staging, 0, {"versions": {"actor": 1}})
        publish_s = time.perf_counter() - start
        weights = sum(p.stat().st_size for p in checkpoint.path.rglob("*") if p.is_file())
        sizes, hashes = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            found, damaged = store.latest_whole()
            sizes.append(time.perf_counter() - start)
            assert found is not None and not damaged
            start = time.perf_counter()
            sha256_all(checkpoint.path)
            hashes.append(time.perf_counter() - start)
    size_s, hash_s = statistics.median(sizes), statistics.median(hashes)
    print(f"checkpoint: {len(checkpoint.state['files'])} files, {weights / 1e6:.0f} MB "
          f"({args.model.name})")
    print(f"{'check':<28}{'median s':>12}")
    print(f"{'publish (list sizes)':<28}{publish_s:>12.5f}")
    print(f"{'resume: sizes (stat)':<28}{size_s:>12.5f}")
    print(f"{'sha256 of every file':<28}{hash_s:>12.5f}")
    emit_result({"files": len(checkpoint.state["files"]), "checkpoint_mb": round(weights / 1e6),
                 "publish_s": round(publish_s, 5), "sizes_check_s": round(size_s, 5),
                 "sha256_s": round(hash_s, 4), "sha256_over_sizes": round(hash_s / size_s)},
                __file__)


if __name__ == "__main__":
    main()
