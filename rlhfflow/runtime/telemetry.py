"""What a run measures about itself: per-iteration stage times, worker busy fractions,
overlap, the metrics record of each iteration, the progress line and the summary.

The workers keep the compute interval of every task (with the rows it worked on); the
coordinator pulls them once per iteration. Besides the per-iteration sums that go to
``metrics.jsonl``, every interval is kept in ``OUTPUT/tasks.jsonl`` (one line per
iteration) so that a finished run can refine the planner's profile
(``rlhfflow profile --from-run``) and be drawn as a timeline.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from rlhfflow.plan.flops import StageWork, run_utilisation, utilisation
from rlhfflow.runtime.worker.host import pop_timings
from rlhfflow.runtime.worker.tasks import METRICS
from rlhfflow.sdk import IterationMetric
from rlhfflow.storage import MetricsLog

if TYPE_CHECKING:
    from rlhfflow.plan.auto.planner import PlanChoice

TASKS_FILE = "tasks.jsonl"


class Telemetry:
    """Collects the workers' task intervals and turns one iteration's results into its
    metrics record; ``metrics`` are the figures the pipeline's stages declare
    (``Stage.iteration_metrics``), which the store tasks sum."""

    def __init__(self, backend, output_dir: Path,
                 metrics: Sequence[IterationMetric] = ()) -> None:
        self.backend = backend
        self.metrics = list(metrics)
        self.tasks = MetricsLog(output_dir / TASKS_FILE)
        self.addresses: list[str] = []
        self.layout: dict[str, Any] = {}
        self.timings: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        # busy time per worker: finished compute intervals not yet past a window
        self._busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
        # per worker, the highest resident set its reports gave since the last record
        self._rss: dict[int, int] = {}
        self._window_start = time.time()
        # what the model FLOPs of an iteration are counted from, and the matmul peaks
        # (FLOP/s by dtype name) they are measured against: count_flops
        self.work: list[StageWork] = []
        self.peaks: dict[str, float] = {}

    def count_flops(self, work: list[StageWork], peaks: dict[str, float]) -> None:
        """Count each iteration's useful model FLOPs (``model_flops``) from ``work`` and
        its MFU against ``peaks`` (``rlhfflow.plan.flops``, ``rlhfflow.engine.peak``)."""
        self.work = list(work)
        self.peaks = dict(peaks)

    def restart(self, addresses: Sequence[str], layout: dict[str, Any] | None = None) -> None:
        """Start measuring afresh on ``addresses`` (a new loop, or after a recovery);
        ``layout`` (torch threads per worker, gang size per stage) is kept with the
        intervals so a profile knows what they were measured under."""
        self.addresses = list(addresses)
        self.layout = dict(layout or {})
        self.timings.clear()
        self._busy.clear()
        self._rss.clear()
        self._window_start = time.time()

    def _collect(self, iteration: int, reports: Sequence[dict[str, Any]] = ()
                 ) -> dict[int, list[tuple[float, float]]]:
        """Pull the workers' task intervals: per-iteration stage times, per worker the
        finished intervals (kept for the busy fraction and in tasks.jsonl); returns the
        running ones. ``reports`` came with the result of an iteration that was one task
        (``StageTask.reports``): they are all its timings, and no worker is asked."""
        # timings are diagnostics: a worker that died with its timings loses them
        running: dict[int, list[tuple[float, float]]] = {}
        intervals = []
        reported = {r["address"]: r for r in reports} if reports else \
            self.backend.run_on_workers(pop_timings)
        for address, report in reported.items():
            w = self.addresses.index(address) if address in self.addresses else None
            for task_iteration, stage, start, stop, rows in report["done"]:
                intervals.append([w, stage, task_iteration, round(start, 6), round(stop, 6),
                                  rows])
                if "/" in stage:  # work beside a task (WorkerHost.record_part): shown only
                    continue
                self.timings[task_iteration][stage] += stop - start
                if w is not None:  # busy fractions are of the device workers
                    self._busy[w].append((start, stop))
            if w is None:
                continue
            if report.get("peak_rss") is not None:
                self._rss[w] = max(self._rss.get(w, 0), report["peak_rss"])
            running[w] = [(start, report["now"]) for _, _, start in report["running"]]
        if intervals:
            self.tasks.append({"iteration": iteration, "layout": self.layout,
                               "tasks": intervals})
        return running

    def _busy_fractions(self, running: dict[int, list[tuple[float, float]]], start: float,
                        stop: float) -> list[float]:
        """Per worker, the fraction of ``[start, stop]`` it spent computing."""
        fractions = []
        for w in range(len(self.addresses)):
            spans = sorted((max(a, start), min(b, stop))
                           for a, b in self._busy[w] + running.get(w, []))
            busy, reach = 0.0, start
            for a, b in spans:
                a = max(a, reach)
                if b > a:
                    busy += b - a
                    reach = b
            fractions.append(round(busy / max(stop - start, 1e-9), 4))
            self._busy[w] = [(a, b) for a, b in self._busy[w] if b > stop]
        return fractions

    def record(self, iteration: int, partials: list[dict[str, float]],
               train: dict[str, dict[str, Any]], moved: list[dict[str, float]],
               task_retries: int = 0, reported: dict[str, dict[str, Any]] | None = None,
               timings: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """The metrics record of ``iteration`` from its store tasks' partial sums, its
        trainers' statistics, its weight transfers, the retries its tasks took and the
        metrics of its reporting stages (``Stage.reports``, e.g. ``eval/...``, kept under
        their own names) and, for an iteration that was one task, the worker's task
        timings its result brought (``timings``); the window of its wall time ends now."""
        running = self._collect(iteration, timings)
        now = time.time()
        iteration_s = now - self._window_start
        busy = self._busy_fractions(running, self._window_start, now)
        self._window_start = now
        total: dict[str, float] = defaultdict(float)
        declared: dict[str, list[float]] = {}
        for p in partials:
            for key, value in p.items():
                if key != METRICS:
                    total[key] += value
            for name, sums in p.get(METRICS, {}).items():
                declared[name] = [a + b for a, b in zip(declared.get(name, (0.0,) * 3),
                                                        sums, strict=True)]
        figures = declared_figures(self.metrics, declared)
        n = total["rows"]
        scored = total.get("scored", 0.0)
        mean = total["score_sum"] / scored if scored else None
        std = math.sqrt(max(0.0, total["score_sq"] / scored - mean ** 2)) if mean is not None \
            else None
        stats = {k: v for s in train.values() for k, v in s.items()}
        # per token where a stage wrote the KL (the advantages' kl_mean), else the
        # trainer's: whatever the loss aggregation (kl_loss is the aggregated term)
        kl_mean = figures.pop("kl_mean", None)
        if kl_mean is None:
            kl_mean = stats.get("kl_mean", stats.get("kl_loss"))
        stage_s = {k: round(v, 4) for k, v in self.timings.pop(iteration, {}).items()}
        return {
            "iteration": iteration, "samples": int(n),
            "samples_skipped": int(total.get("skipped", 0)),
            "reward_mean": mean, "reward_std": std, "kl_mean": kl_mean,
            "policy_loss": stats.get("policy_loss"), "value_loss": stats.get("value_loss"),
            "clip_frac": stats.get("clip_frac"), "approx_kl": stats.get("approx_kl"),
            "clip_frac_lower": stats.get("clip_frac_lower"), "lr": stats.get("lr"),
            "response_length_mean": total["length_sum"] / n if n else None,
            "tokens_generated": int(total["tokens"]),
            "staleness_mean": stats.get("staleness_mean"),
            "staleness_max": stats.get("staleness_max"),
            "iteration_s": round(iteration_s, 4),
            "stage_s": stage_s,
            "overlap": round(sum(stage_s.values()) / max(iteration_s, 1e-9), 4),
            "busy_frac": busy,
            **self._memory_peaks(),
            "realloc_bytes": int(sum(m["nbytes"] for m in moved)),
            "realloc_s": round(max((m["seconds"] for m in moved), default=0.0), 4),
            "score_errors": int(total.get("score_errors", 0)),
            "score_retries": int(total.get("score_retries", 0)),
            "task_retries": task_retries,
            **self._model_flops(total, iteration_s),
            **figures,
            "train": train,
            **{k: v for stats in (reported or {}).values() for k, v in stats.items()},
        }


    def _memory_peaks(self) -> dict[str, Any]:
        """``memory_peak_mib``: per device worker, the peak of its resident set (MiB)
        over the tasks it reported since the last record (None where it reported none or
        its kernel does not say); nothing where no worker said."""
        if not self._rss:
            return {}
        peaks = [self._rss.pop(w, None) for w in range(len(self.addresses))]
        return {"memory_peak_mib": [None if p is None else round(p / 2**20)
                                    for p in peaks]}

    def _model_flops(self, total: dict[str, float], seconds: float) -> dict[str, Any]:
        """An iteration's useful model FLOPs, by stage and in all, their rate and MFU
        (None without a peak); nothing where no stage's FLOPs are counted."""
        if not self.work or "prompt_tokens" not in total:
            return {}
        tokens = total["prompt_tokens"] + total["tokens"]
        flops = {w.stage: w.flops(tokens, total["attention_pairs"]) for w in self.work}
        mfu = utilisation(flops, self.work, self.peaks, seconds)
        return {"model_flops": round(sum(flops.values())),
                "model_flops_per_s": round(sum(flops.values()) / max(seconds, 1e-9)),
                "mfu": round(mfu, 4) if mfu is not None else None,
                "stage_flops": {stage: round(f) for stage, f in flops.items()},
                "matmul_peak_flops_per_s": {k: round(v) for k, v in self.peaks.items()}}


def declared_figures(metrics: Sequence[IterationMetric],
                     sums: dict[str, Sequence[float]]) -> dict[str, Any]:
    """The figures ``metrics`` declare from their sums over an iteration's stores
    (``(numerator, denominator, requires)`` by name: ``host.declared_sums``), in
    declaration order; a figure no store summed is left out."""
    out: dict[str, Any] = {}
    for m in metrics:
        if m.name not in sums:
            continue
        num, den, required = sums[m.name]
        value = num if m.reduce == "sum" else num / den if den else None
        if not required:
            value = None
        if value is not None and m.digits is not None:
            value = round(value) if m.digits == 0 else round(value, m.digits)
        out[m.name] = value
    return out


def summarise(records: list[dict[str, Any]]) -> tuple[dict[str, Any], str] | None:
    """The overlap and the MFU a run achieved over its steady iterations (not the first, which loads the models, nor the
    last, which has nothing left to overlap with): the summary and its one line, or None
    without any iteration."""
    steady = steady_records(records)
    if not steady:
        return None

    def mean(xs):
        return sum(xs) / len(xs)

    busy = [mean([r["busy_frac"][w] for r in steady])
            for w in range(len(steady[0]["busy_frac"]))]
    stale = [r["staleness_max"] for r in records if r.get("staleness_max") is not None]
    summary = {
        "iterations": len(steady),
        "iteration_s": round(mean([r["iteration_s"] for r in steady]), 4),
        "overlap": round(mean([r["overlap"] for r in steady]), 4),
        "busy_frac": [round(b, 4) for b in busy],
        "staleness_max": max(stale) if stale else None,
    }
    workers = ", ".join(f"w{w} {b:.2f}" for w, b in enumerate(busy))
    stale_text = f"; staleness max {max(stale)}" if stale else ""
    summary.update(run_utilisation(steady))
    memory = memory_peaks(records)
    if memory:
        summary["memory_peak_mib"] = memory
    line = (f"rlhfflow: overlap {summary['overlap']:.2f} (sum of stage times / iteration "
            f"wall time, mean over {len(steady)} iteration(s)); busy: {workers}{stale_text}"
            f"{mfu_text(summary)}{memory_text(memory)}")
    return summary, line


def memory_peaks(records: list[dict[str, Any]]) -> list[int | None]:
    """Per device worker, the highest ``memory_peak_mib`` of ``records`` (every
    iteration: the first loads the models), or [] where none was measured."""
    rows = [r["memory_peak_mib"] for r in records if r.get("memory_peak_mib")]
    if not rows:
        return []
    return [max((row[w] for row in rows if w < len(row) and row[w] is not None),
                default=None) for w in range(max(len(row) for row in rows))]


def memory_text(peaks: list[int | None]) -> str:
    """The memory part of the closing line: ``; memory peak: w0 2413, w1 2193 MiB``."""
    if not peaks:
        return ""
    return "; memory peak: " + ", ".join(
        f"w{w} {'-' if p is None else p}" for w, p in enumerate(peaks)) + " MiB"


def mfu_text(summary: dict[str, Any]) -> str:
    """The MFU part of the closing line: ``; MFU 0.43 (model FLOPs 1.2 GFLOP/s; matmul
    peak float32 2.8, bfloat16 5.1 GFLOP/s)``, or "" where nothing was counted."""
    if "model_flops_per_s" not in summary:
        return ""
    mfu = f"{summary['mfu']:.3f}" if summary.get("mfu") is not None else "-"
    peaks = ", ".join(f"{dtype} {_giga(v)}" for dtype, v in
                      summary.get("matmul_peak_flops_per_s", {}).items())
    return (f"; MFU {mfu} (model FLOPs {_giga(summary['model_flops_per_s'])} GFLOP/s; "
            f"matmul peak {peaks or '-'} GFLOP/s)")


def _giga(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e9:.3g}"


def steady_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The iterations that show the steady state: all but the first and the last."""
    return records[1:-1] if len(records) > 2 else records


def machine_peaks(pipeline, layout: dict[str, Any], dtypes: tuple[str, ...] = ()
                  ) -> dict[str, float]:
    """The matmul peaks (FLOP/s by dtype name: float32, bfloat16 and ``dtypes``) of the
    machine the run computes on: its GPUs' (one measured, times the workers) or its CPU's
    at the torch threads of all its workers (at most its cores). Measured here, in the
    coordinator: on an external cluster they are this machine's."""
    import torch

    from rlhfflow.engine.peak import PEAK_DTYPES, matmul_peaks

    cluster = pipeline.spec.cluster
    dtypes = tuple(dict.fromkeys((*PEAK_DTYPES, *dtypes)))
    workers = max(1, int(layout.get("workers") or 1))
    if cluster.device == "cuda" or (cluster.device == "auto" and torch.cuda.is_available()):
        return {k: v * workers for k, v in matmul_peaks(dtypes, device="cuda").items()}
    cores = os.cpu_count() or 1
    threads = layout.get("threads")
    return matmul_peaks(dtypes, min(cores, threads * workers) if threads else cores)


def progress_line(r: dict[str, Any], total: int) -> str:
    """The one line printed per iteration."""
    done = r["iteration"] + 1
    width = 20
    bar = "#" * (done * width // total) + "-" * (width - done * width // total)
    reward = f"{r['reward_mean']:.3f}" if r["reward_mean"] is not None else "-"
    kl = f"{r['kl_mean']:.4f}" if r["kl_mean"] is not None else "-"
    skipped = f"  skipped {r['samples_skipped']}" if r["samples_skipped"] else ""
    return (f"[{bar}] {done:>4}/{total}  reward {reward}  kl {kl}  "
            f"len {r['response_length_mean']:.1f}  {r['iteration_s']:.2f}s{skipped}")


class StartupClock:
    """Where the time from the command to the first iteration goes: named phases, each
    the wall time since the previous mark; the first runs from the process's start
    (imports, reading and validating the file)."""

    def __init__(self, start: float | None = None) -> None:
        self.start = process_start() if start is None else start
        self.last = self.start
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases.append((phase, now - self.last))
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start

    def line(self, first_iteration_s: float | None = None) -> str:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases
                          if seconds >= 0.05)
        first = (f"; first iteration {first_iteration_s:.1f} s"
                 if first_iteration_s is not None else "")
        return f"rlhfflow: start-up {self.total:.1f} s to the first task ({parts}){first}"


def process_start() -> float:
    """When this process started (wall clock), for the start-up time of a run; in a run
    forked from a warm server, when its ``rlhfflow run`` command started."""
    from rlhfflow.launch.warm import STARTED_AT_VAR

    try:
        return float(os.environ[STARTED_AT_VAR])
    except (KeyError, ValueError):
        pass
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no psutil, or a platform without it: from now
        return time.time()


def prediction_line(choice: PlanChoice, measured: float, source: Path, out: Path) -> str:
    """The line that compares the iteration time ``placement: auto`` predicted for its
    choice with the ``measured`` one; far off (over 15%) with a stage the analytic model
    costed, how to profile this machine from the run at ``out`` of the pipeline file
    ``source``."""
    predicted = choice.best.predicted_s
    error = measured / predicted - 1
    hint = ""
    cost = choice.cost
    if abs(error) > 0.15 and cost.unmeasured():
        # the analytic model's constants are another machine's (and have no profile of
        # some stage types, e.g. a multi-turn rollout's environment)
        which = "chosen with the analytic cost model" if not cost.profiled \
            else f"{', '.join(cost.unmeasured())} costed by the analytic model"
        hint = (f"; {which}: `rlhfflow profile {shown_path(source)} --from-run "
                f"{shown_path(out)}` makes a profile of this machine from this run")
    return (f"rlhfflow: iteration time: predicted {predicted:.3f} s, measured "
            f"{measured:.3f} s ({error:+.0%}){hint}")


def shown_path(path: Path) -> str:
    """``path`` as a user would type it here: relative to the working directory when
    inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def dashboard_moved(wanted: str, link: str) -> str:
    """The note for an embedded cluster's dashboard that Dask served on another port than
    ``cluster.dashboard_address`` asked for (it was taken), or ""."""
    port = wanted.rpartition(":")[2]
    served = urlsplit(link).port
    if port in ("", "0") or served is None or port == str(served):
        return ""
    return f" (port {port} is in use, another run?)"
