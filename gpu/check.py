"""The GPU check in one command: install the kit, run the checks, write one JSON of figures.

On a lent GPU machine, from the repository root (``.gpu-kit/`` carried along)::

    python3 gpu/check.py            # or: make gpu-check

installs ``.gpu-kit/`` into a fresh folder (``gpu/kit.py``) and runs, each in its own
process under a time limit so that one failure or hang does not stop the others:

* ``environment``: Python, torch, CUDA, the GPU, where each package is imported from;
* ``pytest``: ``pytest -m gpu tests/test_gpu.py`` (the CPU tests' claims on CUDA);
* ``grpo-tiny``: the GRPO demo (``configs/grpo-tiny.yaml``) with ``cluster.device: cuda``;
* ``generation``: ``benchmarks/generation.py`` on CUDA with a random model of SmolLM2's
  shape, batches 1, 4, 16, 64, and the cost of verifying k drafts against one token;
* ``grpo-large``: ``gpu/grpo-large.yaml`` (~400M parameters, bf16), per-stage times and
  peak GPU memory;
* ``trl``: ``benchmarks/vs_trl.py`` on the same work as grpo-large, TRL's GRPOTrainer
  against rlhfflow.

It writes ``$OUT`` (default ``gpu-out/``): ``gpu-check.json`` (rewritten after each
part, so a run cut short keeps what it had), ``gpu-check.log`` (everything printed),
``pytest-gpu.xml`` and each run's ``metrics.jsonl``. Large outputs (models, checkpoints)
stay in a scratch folder, since ``$OUT`` travels back. The whole stays within
``--budget-s`` (default 480 s); each part gets at most its own limit and what is left.

``--dry-run`` (``make gpu-check GPU=0``) proves all of this on a CPU with tiny sizes: it
installs the dry run's few pure-Python wheels of the kit (``.gpu-kit-dry/``, downloaded
when absent) into a fresh folder for the machine's Python and platform, and runs the
parts on CPU in a virtual environment holding only the GPU machine's packages and the
kit's (``gpu/dryrun.py``); ``pytest`` runs the GPU tests on the CPU
(``RLHFFLOW_GPU_TEST_DEVICE=cpu``), which checks the tests, not the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import kit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpumem import GpuMemory  # noqa: E402


@dataclass(frozen=True)
class Part:
    """One check: its name and its time limits (seconds) on a GPU and in the dry run."""

    name: str
    limit_s: float
    dry_limit_s: float


#: In order: what matters most first, since the budget may run out.
PARTS = (Part("environment", 60, 30), Part("pytest", 180, 60), Part("grpo-tiny", 60, 40),
         Part("generation", 90, 30), Part("grpo-large", 110, 40), Part("trl", 150, 40))
#: Modules whose origin the environment part reports (kit, machine, and the dry run's).
MODULES = ("torch", "transformers", "accelerate", "numpy", "pyarrow", "yaml", "dask",
           "distributed", "zarr", "numcodecs", "pydantic", "deepspeed", "trl", "datasets",
           "pandas", "toolz", "tblib", "locket", "sortedcontainers", "zict", "cloudpickle")


class Skip(Exception):
    """A part that cannot run here (no TRL in the kit, ...): says why."""


class Failed(Exception):
    """A part that ran and failed: its figures so far ride along."""

    def __init__(self, reason: str, figures: dict | None = None) -> None:
        super().__init__(reason)
        self.figures = figures or {}


# --------------------------------------------------------------------------- the parts
# Each runs in a child process (``--part NAME``) and returns its figures.


@dataclass(frozen=True)
class Context:
    """What a part knows: where to write, where big files go, whether this is the dry run."""

    out: Path
    scratch: Path
    dry_run: bool

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


def part_environment(ctx: Context) -> dict:
    """Versions, the GPU, and where each module is imported from (the kit or the machine)."""
    import platform

    import torch

    figures = {"python": platform.python_version(), "platform": platform.platform(),
               "glibc": platform.libc_ver()[1], "torch": torch.__version__,
               "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
               "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(gpus=torch.cuda.device_count(), gpu=props.name,
                       gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                       capability=f"{props.major}.{props.minor}",
                       bf16=torch.cuda.is_bf16_supported())
    tool = shutil.which("nvidia-smi")
    if tool:
        figures["nvidia_smi"] = subprocess.run([tool, "-L"], capture_output=True, text=True,
                                               timeout=30).stdout.strip()
    origins = {}
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        origins[name] = spec.origin if spec is not None else None
    figures["modules"] = origins
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("transformers", "accelerate", "tokenizers", "huggingface-hub", "numpy",
                 "pyarrow", "dask", "distributed", "zarr", "pydantic", "deepspeed", "trl",
                 "datasets", "pytest"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    figures["versions"] = versions
    return figures


def part_pytest(ctx: Context) -> dict:
    """``pytest -m gpu tests/test_gpu.py``, each test's outcome from its JUnit XML."""
    import xml.etree.ElementTree as ET

    xml = ctx.out / "pytest-gpu.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py",
               "-p", "no:cacheprovider", "-q", "-rA", f"--junitxml={xml}"]
    env = dict(os.environ)
    if ctx.dry_run:  # the tests on the CPU; DeepSpeed's are tests/plan/test_placement.py's there
        env["RLHFFLOW_GPU_TEST_DEVICE"] = "cpu"
        command += ["-k", "not deepspeed"]
    done = subprocess.run(command, cwd=ROOT, env=env)
    if not xml.is_file():
        raise Failed(f"pytest exited {done.returncode} without a report")
    tests = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error"}.get(child.tag, "skipped")
                message = (child.get("message") or "").splitlines()[0][:300] if \
                    child.get("message") else None
        tests[f"{case.get('classname')}::{case.get('name')}"] = {
            "outcome": outcome, "seconds": round(float(case.get("time") or 0), 2),
            **({"message": message} if message else {})}
    counts = {k: sum(t["outcome"] == k for t in tests.values())
              for k in ("passed", "failed", "error", "skipped")}
    figures = {**counts, "exit_code": done.returncode, "tests": tests}
    if done.returncode not in (0,) or counts["failed"] or counts["error"]:
        raise Failed(f"{counts['failed']} failed, {counts['error']} errors "
                     f"(pytest exited {done.returncode})", figures)
    return figures


def rlhfflow_run(ctx: Context, name: str, config: Path, iterations: int,
                 sets: dict[str, str]) -> dict:
    """``rlhfflow run CONFIG`` (its output in the scratch folder), its figures from
    ``metrics.jsonl`` (median over the steady iterations: all but the first), the peak
    GPU memory in use while it ran, and its metrics copied to ``$OUT/runs/NAME``."""
    out = ctx.scratch / "runs" / name
    settings = {"cluster.device": ctx.device, "cluster.dashboard_address": "127.0.0.1:0",
                **sets}
    command = [sys.executable, "-m", "rlhfflow.cli.main", "run", str(config),
               "--iterations", str(iterations), "--out", str(out), "--overwrite", "--quiet"]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    with GpuMemory() as memory:
        done = subprocess.run(command, cwd=ROOT)
    wall = time.perf_counter() - start
    kept = ctx.out / "runs" / name
    kept.mkdir(parents=True, exist_ok=True)
    for file in ("metrics.jsonl", "tasks.jsonl", "pipeline.yaml"):
        if (out / file).is_file():
            shutil.copy(out / file, kept / file)
    figures = {"wall_s": round(wall, 2), "gpu_peak_mib": memory.peak_mib,
               **run_figures(out / "metrics.jsonl")}
    if done.returncode != 0:
        raise Failed(f"rlhfflow run exited {done.returncode}", figures)
    return figures


def run_figures(metrics: Path) -> dict:
    """The figures of a run from its ``metrics.jsonl``."""
    if not metrics.is_file():
        return {}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    if not records:
        return {}
    steady = records[1:] or records

    def median(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 4) if values else None

    stages = sorted({s for r in steady for s in (r.get("stage_s") or {})})
    iteration_s = median(r["iteration_s"] for r in steady)
    return {
        "iterations": len(records), "samples": records[-1]["samples"],
        "iteration_s": iteration_s,
        "samples_per_s": round(records[-1]["samples"] / iteration_s, 2) if iteration_s else None,
        "stage_s": {s: median((r.get("stage_s") or {}).get(s) for r in steady) for s in stages},
        "gen_tokens_per_s": median(r.get("gen_tokens_per_s") for r in steady),
        "reward_first": records[0]["reward_mean"], "reward_last": records[-1]["reward_mean"],
        "policy_loss_last": records[-1].get("policy_loss"),
        "iteration_s_all": [r["iteration_s"] for r in records],
    }


def part_grpo_tiny(ctx: Context) -> dict:
    """The GRPO demo, end to end, on the GPU."""
    return rlhfflow_run(ctx, "grpo-tiny", ROOT / "configs" / "grpo-tiny.yaml",
                        2 if ctx.dry_run else 10, {})


#: The dry run's grpo-large: the same file, a tiny model and batch.
DRY_LARGE = {"models.actor.tiny": "{layers: 2, hidden: 64, heads: 4}",
             "data.batch_size": "4", "data.samples_per_prompt": "2",
             "stages.generate.params.max_new_tokens": "8"}


def part_grpo_large(ctx: Context) -> dict:
    """gpu/grpo-large.yaml: ~400M parameters in bf16, per-stage times, GPU memory."""
    return rlhfflow_run(ctx, "grpo-large", ROOT / "gpu" / "grpo-large.yaml",
                        2 if ctx.dry_run else 5, DRY_LARGE if ctx.dry_run else {})


def last_json_line(path: Path) -> dict:
    """The JSON object a benchmark prints as its last line."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise Failed(f"{path.name}: no JSON line")
    return json.loads(lines[-1])


def benchmark(ctx: Context, name: str, args: list[str]) -> dict:
    """``python benchmarks/NAME.py ARGS``, its printed figures (also ``$OUT/NAME.txt``)."""
    printed = ctx.out / f"{name}.txt"
    with printed.open("w") as sink, GpuMemory() as memory:
        # its result line goes with the check's output, not into the repository's history
        env = {**os.environ, "RLHFFLOW_BENCH_RESULTS": str(ctx.out / "results")}
        done = subprocess.run([sys.executable, f"benchmarks/{name}.py", *args], cwd=ROOT,
                              stdout=sink, stderr=subprocess.STDOUT, env=env)
    sys.stdout.write(printed.read_text())
    if done.returncode != 0:
        raise Failed(f"benchmarks/{name}.py exited {done.returncode}")
    return {**last_json_line(printed), "gpu_peak_mib": memory.peak_mib}


def part_generation(ctx: Context) -> dict:
    """Generation throughput per batch size and drafter, greedy identity, verify cost."""
    model = ctx.scratch / "models" / ("random-tiny" if ctx.dry_run else "random-smollm2")
    if ctx.dry_run:
        sizes = ["--random-shape", "num_hidden_layers=2", "vocab_size=4096",
                 "--draft-layers", "1", "--batches", "1", "4", "--tokens", "8",
                 "--verify-k", "1", "2"]
    else:
        sizes = ["--batches", "1", "4", "16", "64", "--tokens", "64",
                 "--verify-k", "1", "2", "4", "8", "--threads", "4"]
    return benchmark(ctx, "generation", ["--device", ctx.device, "--random-model",
                                         "--model", str(model), *sizes])


def part_trl(ctx: Context) -> dict:
    """TRL's GRPOTrainer against rlhfflow on grpo-large's work."""
    missing = [p for p in ("trl", "datasets") if importlib.util.find_spec(p) is None]
    if missing:
        raise Skip(f"{' and '.join(missing)} not importable (not in the kit)")
    work = ctx.scratch / "vs-trl"
    if ctx.dry_run:
        args = ["--configs", "tiny", "--iterations", "2", "--threads", "1"]
    else:
        args = ["--configs", "gpu/grpo-large.yaml", "--iterations", "3", "--threads", "4"]
    return benchmark(ctx, "vs_trl", [*args, "--device", ctx.device, "--workdir", str(work)])


RUNNERS = {"environment": part_environment, "pytest": part_pytest,
           "grpo-tiny": part_grpo_tiny, "generation": part_generation,
           "grpo-large": part_grpo_large, "trl": part_trl}


def child(name: str, ctx: Context, result: Path) -> None:
    """Run part ``name`` in this process; write its status and figures to ``result``."""
    for folder in (ctx.out, ctx.scratch):
        folder.mkdir(parents=True, exist_ok=True)
    try:
        record = {"status": "ok", "figures": RUNNERS[name](ctx)}
    except Skip as skip:
        record = {"status": "skipped", "reason": str(skip)}
    except Failed as failed:
        record = {"status": "failed", "reason": str(failed), "figures": failed.figures}
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the next part runs
        traceback.print_exc()
        record = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    result.write_text(json.dumps(record))


# --------------------------------------------------------------------------- the parent


def run_part(part: Part, python: str, env: dict, ctx: Context, limit: float,
             log) -> dict:
    """Part ``part`` in a child process of its own session (killed whole at ``limit``)."""
    result = ctx.scratch / f"{part.name}.result.json"
    result.unlink(missing_ok=True)
    command = [python, str(Path(__file__).resolve()), "--part", part.name, "--result",
               str(result), "--out", str(ctx.out), "--scratch", str(ctx.scratch)]
    if ctx.dry_run:
        command.append("--dry-run")
    print(f"\n===== {part.name} (limit {limit:.0f} s)", file=log, flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = None
    seconds = round(time.perf_counter() - start, 1)
    if code is None:
        record = {"status": "timeout", "reason": f"still running after {limit:.0f} s"}
    elif result.is_file():
        record = json.loads(result.read_text())
    else:
        record = {"status": "error", "reason": f"the part's process exited {code}"}
    return {**record, "seconds": seconds}


def log_tail(path: Path, lines: int = 25) -> list[str]:
    """The last lines of the log (a failed part's story)."""
    return path.read_text(errors="replace").splitlines()[-lines:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-out"),
                        help="where the JSON, the log and small files go (default: $OUT, "
                             "else gpu-out)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for everything (default 480; dry run 240)")
    parser.add_argument("--dry-run", action="store_true",
                        help="prove the check on a CPU with tiny sizes (make gpu-check GPU=0)")
    parser.add_argument("--only", nargs="+", choices=list(RUNNERS), help="run only these parts")
    parser.add_argument("--kit", type=Path, default=None, help="the kit folder")
    parser.add_argument("--scratch", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out.resolve()
    if args.part:
        child(args.part, Context(out, args.scratch, args.dry_run), args.result)
        return
    started = time.perf_counter()
    budget = args.budget_s or (240.0 if args.dry_run else 480.0)
    out.mkdir(parents=True, exist_ok=True)
    scratch = (args.scratch or Path(tempfile.mkdtemp(prefix="rlhfflow-gpu-check-"))).resolve()
    ctx = Context(out, scratch, args.dry_run)
    report = {"check": "rlhfflow gpu check", "format": 1, "dry_run": args.dry_run,
              "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "budget_s": budget, "out": str(out), "kit": None, "parts": {}}
    json_path, log_path = out / "gpu-check.json", out / "gpu-check.log"

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - started, 1)
        json_path.write_text(json.dumps(report, indent=1) + "\n")

    with log_path.open("w") as log:
        python, report["kit"] = prepare(ctx, args.kit, log)
        save()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [report["kit"].get("target", ""), str(ROOT)]),
               "TOKENIZERS_PARALLELISM": "false", "RLHFFLOW_WARM": "0",
               "PYTHONUNBUFFERED": "1"}
        for part in PARTS:
            if args.only and part.name not in args.only:
                continue
            left = budget - (time.perf_counter() - started)
            limit = min(part.dry_limit_s if args.dry_run else part.limit_s, left)
            if limit < 5:
                report["parts"][part.name] = {"status": "timeout",
                                              "reason": "no time left in the budget"}
                continue
            record = run_part(part, python, env, ctx, limit, log)
            if record["status"] not in ("ok", "skipped"):
                log.flush()
                record["log_tail"] = log_tail(log_path)
            report["parts"][part.name] = record
            print(f"gpu check: {part.name}: {record['status']} ({record['seconds']} s)"
                  + (f": {record['reason']}" if record.get("reason") else ""), flush=True)
            save()
    if args.dry_run and args.scratch is None:
        shutil.rmtree(scratch, ignore_errors=True)
    save()
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    print(f"gpu check: {json.dumps(statuses)}; {json_path}", flush=True)


def prepare(ctx: Context, kit_dir: Path | None, log) -> tuple[str, dict]:
    """Install the kit into a fresh folder (the dry run: its own kit, and the device
    view's interpreter): ``(python to run the parts with, the install report)``."""
    python, view = sys.executable, None
    try:
        if ctx.dry_run:
            import dryrun

            kit_dir = kit_dir or kit.DRY_KIT
            if not (kit_dir / "wheels").is_dir():
                kit.build(dry_run=True)
            view = dryrun.device_view(ctx.scratch / "device-venv")
            python = view["python"]
        kit_dir = kit_dir or kit.KIT
        if not (kit_dir / "wheels").is_dir():
            raise FileNotFoundError(f"{kit_dir}/wheels: no kit here (make gpu-kit, then "
                                    f"carry {kit_dir.name})")
        start = time.perf_counter()
        report = kit.install(kit_dir, ctx.scratch / "kit" / "site-packages",
                             force_tags=ctx.dry_run)
        report["seconds"] = round(time.perf_counter() - start, 1)
        report["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the parts still run and say what is missing
        traceback.print_exc(file=log)
        report = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    if view is not None:
        report["device_view"] = {k: v for k, v in view.items() if k != "packages"}
    print(f"gpu check: kit: {report['status']}"
          + (f" ({report['reason']})" if report.get("reason") else
             f", {len(report['kit'])} wheels, fallback {report['fallback_taken'] or 'none'}"
             f", unmet {report['unmet'] or 'none'}"), flush=True)
    return python, report


if __name__ == "__main__":
    main()
