"""Full fine-tuning against LoRA adapters on ``examples/arithmetic/grpo.yaml``.

Each variant runs the example (SmolLM2-135M-Instruct, GRPO on two-digit additions, CPU) as
its own ``rlhfflow run`` process, alternating full and LoRA for ``--rounds`` rounds:

* **seconds per iteration**: the median ``iteration_s`` of the iterations after the first
  (which loads the model), and the median over rounds of the per-round LoRA / full ratio;
* **peak worker RSS**: the most resident memory of the run's device worker processes,
  sampled every 0.2 s from outside;
* **checkpoint size**: the bytes of the last iteration's checkpoint, optimizer state
  included (``checkpoint: {every: ITERATIONS, optimizer: true}``): full weights and two
  AdamW moments, against the adapters and theirs;
* **the reference copy**: in a fresh process, the RSS a frozen ``ref: {from: actor}``
  adds once the actor is resident (a second copy of the weights under full fine-tuning, a
  view of the resident base under LoRA);
* **held-out accuracy** (``--eval N``): ``examples/arithmetic/evaluate.py`` on each run's
  ``final`` model (LoRA's is the merged export) over N questions, and on the base model.

The example's own settings are kept (one worker with both cores, ``kl_coef: 0``); LoRA
adds ``models.actor.lora: {r: --rank}`` (``alpha`` 2r, every Linear layer) and its own
``--lora-lr``: adapters starting at zero want a larger step than the full weights.

    python benchmarks/lora.py [--iterations 16] [--rounds 1] [--rank 16] [--lora-lr 2e-4]
                              [--eval 100] [--workdir DIR]
    python benchmarks/lora.py --steps N [--rounds R] [--rank 16]

``--steps N`` is for a machine too busy (or too small) for whole runs: each variant, in a
fresh process, holds the actor and its reference and takes N training steps of 8 x 48
tokens, each after a reference forward; it reports the median step after the first, the
process's peak RSS (``ru_maxrss``), the bytes of a checkpoint (weights or adapters, with
the optimizer state) and the reference copy.

Needs the model (``rlhfflow models import-gguf --smollm2 models/smollm2-135m``) and the data
(``python examples/arithmetic/make_data.py``). Prints a table, then one JSON object with
the figures as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from shared import emit_result

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic"


def variant_file(workdir: Path, name: str, iterations: int, lora: dict | None,
                 lr: float | None) -> Path:
    """The example's pipeline with absolute paths, a checkpoint of the last iteration with
    its optimizer state, and LoRA (``lora``, ``lr``) for that variant."""
    data = yaml.safe_load((EXAMPLE / "grpo.yaml").read_text())
    data["name"] = f"arithmetic-{name}"
    data["iterations"] = iterations
    data["checkpoint"] = {"every": iterations, "optimizer": True, "keep": 1}
    data["data"]["prompts"] = str(EXAMPLE / data["data"]["prompts"])
    actor = data["models"]["actor"]
    actor["path"] = str((EXAMPLE / actor["path"]).resolve())
    data["stages"]["reward"]["params"]["function"] = str(EXAMPLE / "reward.py") + \
        ":exact_match"
    if lora is not None:
        actor["lora"] = lora
        actor["optimizer"]["lr"] = lr
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_variant(config: Path, out: Path) -> dict[str, Any]:
    """Run ``config`` into ``out`` in its own process; its figures."""
    import psutil

    from rlhfflow.runtime.cluster import embedded_worker_processes

    env = {**os.environ, "RLHFFLOW_WARM": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run", str(config),
                             "--out", str(out), "--overwrite", "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        me = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                rss = sum(p.memory_info().rss for p in embedded_worker_processes(me))
            except psutil.Error:
                rss = 0
            peak[0] = max(peak[0], rss)
            time.sleep(0.2)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    started = time.perf_counter()
    output, _ = proc.communicate()
    done.set()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"{config.name} failed:\n{output[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [checkpoint] = sorted((out / "checkpoints").glob("iter_*"))
    return {"iteration_s": statistics.median(r["iteration_s"] for r in records[1:]),
            "wall_s": time.perf_counter() - started,
            "peak_worker_rss": peak[0],
            "checkpoint_bytes": _bytes(checkpoint),
            "reward_first": records[0]["reward_mean"],
            "reward_last4": statistics.mean(r["reward_mean"] for r in records[-4:])}


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


REFERENCE_PROBE = """
import json, sys, psutil, torch
from rlhfflow.engine.resident import ModelConfig, ModelStore
path, lora = sys.argv[1], json.loads(sys.argv[2])
store = ModelStore({"actor": ModelConfig("actor", "lm", path, trainable=True, lora=lora),
                    "ref": ModelConfig("ref", "lm", path, base_of="actor" if lora else None)})
me = psutil.Process()
store.get("actor")
before = me.memory_info().rss
store.get("ref")
print(json.dumps({"ref_bytes": me.memory_info().rss - before}))
"""


STEP_PROBE = """
import json, resource, statistics, sys, tempfile, time, torch
from pathlib import Path
from rlhfflow.engine.resident import ModelConfig, ModelStore
path, lora, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
store = ModelStore({"actor": ModelConfig("actor", "lm", path, trainable=True,
                                         optimizer={"lr": 1e-5}, lora=lora),
                    "ref": ModelConfig("ref", "lm", path, base_of="actor" if lora else None)})
actor, ref = store.get("actor"), store.get("ref")
gen = torch.Generator().manual_seed(0)
ids = torch.randint(100, 20000, (8, 48), generator=gen)
mask = torch.ones_like(ids)
seconds = []
for _ in range(steps):
    start = time.perf_counter()
    with torch.no_grad():
        ref.module(input_ids=ids, attention_mask=mask)
    actor.module.train(True)
    logits = actor.module(input_ids=ids, attention_mask=mask).logits
    actor.step(-logits.log_softmax(-1).gather(-1, ids[..., None]).mean())
    actor.module.train(False)
    seconds.append(time.perf_counter() - start)
out = Path(tempfile.mkdtemp())
actor.save(out / "model")
actor.save_optimizer(out / "optimizer.pt")
size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
print(json.dumps({"step_s": statistics.median(seconds[1:]), "steps": seconds,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "checkpoint_bytes": size}))
"""


def train_steps(model: Path, lora: dict | None, steps: int) -> dict[str, Any]:
    """``--steps`` mode, for a machine too busy for whole runs: in a fresh process, a
    reference forward and one actor training step (8 x 48 tokens) ``steps`` times; the
    median step after the first, the process's peak RSS, and the bytes of a checkpoint
    (weights or adapters, with the optimizer state)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", STEP_PROBE, str(model), json.dumps(lora),
                          str(steps)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def reference_bytes(model: Path, lora: dict | None) -> int:
    """The RSS a frozen reference ``from:`` the actor adds to a process holding the actor."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", REFERENCE_PROBE, str(model),
                          json.dumps(lora)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["ref_bytes"])


def accuracy(model_dir: Path, limit: int) -> float:
    """Held-out greedy accuracy (``evaluate.py``) of ``model_dir`` on ``limit`` questions."""
    out = subprocess.run([sys.executable, str(EXAMPLE / "evaluate.py"), str(model_dir),
                          "--limit", str(limit)], capture_output=True, text=True,
                         check=True).stdout
    return float(re.search(r"accuracy ([0-9.]+)", out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=2e-4)
    parser.add_argument("--eval", type=int, default=0, metavar="N",
                        help="held-out questions to score each final model on (0: none)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=0, metavar="N",
                        help="instead of runs: N training steps per variant in one process")
    args = parser.parse_args()
    if args.steps:
        return steps_only(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rlhfflow-lora-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = (EXAMPLE / "../../models/smollm2-135m").resolve()
    lora = {"r": args.rank}
    files = {"full": variant_file(workdir, "full", args.iterations, None, None),
             "lora": variant_file(workdir, "lora", args.iterations, lora, args.lora_lr)}
    ref_bytes = {"full": reference_bytes(model, None), "lora": reference_bytes(model, lora)}
    print(f"reference copy: {json.dumps(ref_bytes)}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
    for r in range(args.rounds):
        for name, config in files.items():
            runs[name].append(run_variant(config, workdir / f"{name}-{r}"))
            print(f"round {r} {name}: {json.dumps(runs[name][-1])}", flush=True)
    ratios = [lo["iteration_s"] / fu["iteration_s"]
              for fu, lo in zip(runs["full"], runs["lora"], strict=True)]
    figures: dict[str, Any] = {
        "iterations": args.iterations, "rounds": args.rounds, "rank": args.rank,
        "lora_lr": args.lora_lr, "full_lr": 2e-5,
        "lora_over_full_iteration_s": statistics.median(ratios),
        "ratios": ratios,
        "ref_bytes": ref_bytes}
    for name, results in runs.items():
        for key in ("iteration_s", "peak_worker_rss", "checkpoint_bytes", "reward_first",
                    "reward_last4"):
            figures.setdefault(key, {})[name] = statistics.median(x[key] for x in results)
    if args.eval:
        figures["accuracy"] = {"base": accuracy(model, args.eval)}
        for name in runs:
            final = workdir / f"{name}-{args.rounds - 1}" / "models" / "actor" / "final"
            figures["accuracy"][name] = accuracy(final, args.eval)
    mb = 1 / 2**20
    print(f"{'':22}{'full':>12}{'lora':>12}")
    print(f"{'seconds / iteration':22}{figures['iteration_s']['full']:12.2f}"
          f"{figures['iteration_s']['lora']:12.2f}")
    for key, label in (("peak_worker_rss", "peak worker RSS MiB"),
                       ("checkpoint_bytes", "checkpoint MiB"), ("ref_bytes", "reference MiB")):
        print(f"{label:22}{figures[key]['full'] * mb:12.1f}{figures[key]['lora'] * mb:12.1f}")
    for key in ("reward_first", "reward_last4"):
        print(f"{key:22}{figures[key]['full']:12.3f}{figures[key]['lora']:12.3f}")
    if "accuracy" in figures:
        acc = figures["accuracy"]
        print(f"{'held-out accuracy':22}{acc['full']:12.3f}{acc['lora']:12.3f}"
              f"   (base {acc['base']:.3f})")
    emit_result(figures, __file__)


def steps_only(args) -> None:
    """``--steps``: the training step, peak memory and checkpoint of each variant, in
    fresh processes alternating over ``--rounds`` rounds, and the reference copy."""
    model = (EXAMPLE / "../../models/smollm2-135m").resolve()
    lora = {"r": args.rank}
    ref_bytes = {"full": reference_bytes(model, None), "lora": reference_bytes(model, lora)}
    print(f"reference copy: {json.dumps(ref_bytes)}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
    for r in range(args.rounds):
        for name, spec in (("full", None), ("lora", lora)):
            runs[name].append(train_steps(model, spec, args.steps))
            print(f"round {r} {name}: {json.dumps(runs[name][-1])}", flush=True)
    ratios = [lo["step_s"] / fu["step_s"] for fu, lo in zip(runs["full"], runs["lora"],
                                                            strict=True)]
    figures: dict[str, Any] = {"mode": "steps", "steps": args.steps, "rounds": args.rounds,
                               "rank": args.rank, "ref_bytes": ref_bytes,
                               "lora_over_full_step_s": statistics.median(ratios),
                               "ratios": ratios}
    for key in ("step_s", "peak_rss", "checkpoint_bytes"):
        figures[key] = {name: statistics.median(x[key] for x in results)
                        for name, results in runs.items()}
    mb = 1 / 2**20
    print(f"{'':22}{'full':>12}{'lora':>12}")
    print(f"{'seconds / train step':22}{figures['step_s']['full']:12.2f}"
          f"{figures['step_s']['lora']:12.2f}")
    for key, label in (("peak_rss", "peak RSS MiB"), ("checkpoint_bytes", "checkpoint MiB"),
                       ("ref_bytes", "reference MiB")):
        print(f"{label:22}{figures[key]['full'] * mb:12.1f}{figures[key]['lora'] * mb:12.1f}")
    emit_result(figures, __file__)


if __name__ == "__main__":
    main()
