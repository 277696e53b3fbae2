"""Per-iteration metrics to TensorBoard, MLflow, W&B and Trackio (the ``logging:`` section), under
the names TRL and veRL users know.

``metrics.jsonl`` stays the record of a run; these are copies for the tools people
already watch runs in. Each sink is a small class with ``log(record)`` and ``close()``;
one that shows tables also has ``completions(iteration, rows)`` (``completions.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path
from typing import Any

WANDB_RUN_FILE = "wandb-run.json"
"""The output directory's record of its W&B run (``{"id": ..., "project": ...}``)."""

# rlhfflow's metrics.jsonl key -> the name TRL's GRPOTrainer/PPOTrainer (or, where TRL has
# none, veRL) logs the same figure under
METRIC_NAMES = {
    "reward_mean": "reward",
    "reward_std": "reward_std",
    "kl_mean": "kl",
    "response_length_mean": "completions/mean_length",
    "policy_loss": "loss/policy",
    "value_loss": "loss/value",
    "clip_frac": "clip_ratio",
    "clip_frac_lower": "clip_ratio/low",
    "approx_kl": "approx_kl",
    "lr": "learning_rate",
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "iteration_s": "timing/step",
    "overlap": "perf/overlap",
    "tokens_generated": "perf/tokens_generated",
    "gen_tokens_per_s": "perf/gen_tokens_per_s",
    "mfu": "perf/mfu",  # veRL: perf/mfu/actor (the actor's update only)
    "model_flops_per_s": "perf/model_flops_per_s",
    "samples_skipped": "samples_skipped",
}


#: record keys that are no metric of their own: the step, and those ``flat_metrics``
#: renames (``METRIC_NAMES``, ``stage_s``, ``busy_frac``, ``memory_peak_mib``,
#: ``reward_mean_NAME``)
_NAMED = frozenset({"iteration", "stage_s", "busy_frac", "memory_peak_mib", *METRIC_NAMES})


def flat_metrics(record: dict[str, Any]) -> dict[str, float]:
    """One metrics.jsonl record as ``{name: value}``: under TRL/veRL names the table
    above, ``timing/STAGE`` per stage (seconds of compute), ``perf/busy_wN`` and
    ``perf/memory_peak_mib_wN`` per worker,
    ``rewards/FN/mean`` per reward function; every other number of the record under its
    own key (``turns_mean``, ``info_KEY_mean``), nested ones under their path
    (``train/train_actor/grad_norm``). Missing and non-finite values are left out."""
    out: dict[str, Any] = {}
    for key, name in METRIC_NAMES.items():
        out[name] = record.get(key)
    for stage, seconds in (record.get("stage_s") or {}).items():
        out[f"timing/{stage}"] = seconds
    for w, fraction in enumerate(record.get("busy_frac") or []):
        out[f"perf/busy_w{w}"] = fraction
    for w, mib in enumerate(record.get("memory_peak_mib") or []):
        out[f"perf/memory_peak_mib_w{w}"] = mib
    for key, value in record.items():
        if key.startswith("reward_mean_"):
            out[f"rewards/{key[len('reward_mean_'):]}/mean"] = value
        elif key not in _NAMED:
            out.update(_paths(key, value))
    return {k: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _paths(key: str, value: Any) -> dict[str, Any]:
    """``value`` under ``key``; a dict's or list's items under ``key/ITEM``, at any depth."""
    if isinstance(value, dict):
        return {path: v for item, inner in value.items()
                for path, v in _paths(f"{key}/{item}", inner).items()}
    if isinstance(value, list):
        return {path: v for i, inner in enumerate(value)
                for path, v in _paths(f"{key}/{i}", inner).items()}
    return {key: value}


class TensorBoardSink:
    """Scalars into an event file under ``directory``, step = iteration.

    A resumed run goes on in the same directory, which is one run to TensorBoard: an event
    file cannot be appended to, so the resume writes a second one beside the first, and
    ``purge_step`` (the first iteration it computes) has TensorBoard drop what the first
    file holds from that step on (the iterations redone after the last checkpoint)."""

    def __init__(self, directory: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        """Write one iteration's scalars and flush them (a crash keeps what was logged)."""
        for name, value in flat_metrics(record).items():
            self.writer.add_scalar(name, value, global_step=record["iteration"])
        self.writer.flush()

    def completions(self, iteration: int, rows: list[dict[str, Any]]) -> None:
        """The samples as a Markdown table under the TEXT tab (``completions``)."""
        self.writer.add_text("completions", markdown_table(rows), global_step=iteration)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        """Close the event file."""
        self.writer.close()


class MlflowSink:
    """One MLflow run per rlhfflow run, through ``MlflowClient`` (not the fluent API, whose
    process-global active run would leak between runs in one process)."""

    def __init__(self, tracking_uri: str | None, experiment: str, run_name: str,
                 params: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)

    def log(self, record: dict[str, Any]) -> None:
        """Log one iteration's metrics in one request, step = iteration."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = record["iteration"]
        metrics = [Metric(name, value, now, step) for name, value in flat_metrics(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool = False) -> None:
        """Mark the MLflow run finished (or failed)."""
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbSink:
    """One W&B run per rlhfflow run (``mode: offline`` by default: a local run directory
    that ``wandb sync`` uploads later). ``reinit="create_new"`` keeps runs in one process
    apart instead of reusing wandb's process-global run.

    The W&B run's id is kept in ``run_file`` (in the run's output directory): a resumed
    rlhfflow run (``resume=True``) goes on in that W&B run (offline: a second run
    directory with the same id, which ``wandb sync`` uploads into the same run)."""

    def __init__(self, project: str, mode: str, directory: Path, run_name: str,
                 entity: str | None, tags: list[str], config: dict[str, Any],
                 run_file: Path | None = None, resume: bool = False) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        run_id = _saved_run_id(run_file) if resume else None
        self.run = wandb.init(project=project, mode=mode, dir=str(directory), name=run_name,
                              entity=entity, tags=list(tags) or None, config=config,
                              id=run_id,
                              resume="allow" if run_id else "never", reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        if run_file is not None and run_id is None:
            run_file.write_text(json.dumps({"id": self.run.id, "project": project}) + "\n")

    def log(self, record: dict[str, Any]) -> None:
        """Log one iteration's metrics, step = iteration."""
        self.run.log(flat_metrics(record), step=record["iteration"])

    def completions(self, iteration: int, rows: list[dict[str, Any]]) -> None:
        """The samples as a ``wandb.Table`` named ``completions``."""
        import wandb

        self.run.log({"completions": wandb.Table(**table_data(rows))}, step=iteration)

    def close(self, failed: bool = False) -> None:
        """Finish the run (exit code 1 when the rlhfflow run failed)."""
        self.run.finish(exit_code=1 if failed else 0)


def _saved_run_id(run_file: Path | None) -> str | None:
    """The W&B run id an earlier run of the output directory kept, or None."""
    try:
        return str(json.loads(run_file.read_text())["id"])
    except (AttributeError, OSError, ValueError, KeyError, TypeError):
        return None


class TrackioSink:
    """One Trackio run per rlhfflow run, in Trackio's local database (``TRACKIO_DIR``) or,
    with ``space_id``, a Hugging Face Space. A resumed rlhfflow run (``resume=True``)
    goes on in the newest Trackio run of that name instead of starting another.

    Trackio keeps its current run in a context variable and finishes it at exit; the
    sink clears it on close, so nothing is finished twice. A local run's start and end
    banners are kept off the run's output (``line`` says where the run went instead);
    with a Space, Trackio's own lines about it (its URL, uploads) stay."""

    def __init__(self, project: str, run_name: str, group: str | None,
                 space_id: str | None, config: dict[str, Any], resume: bool) -> None:
        import trackio
        from trackio import context_vars, utils

        self._local = space_id is None
        with self._banners_off():
            self.run = trackio.init(project=project, name=run_name, group=group,
                                    space_id=space_id, config=config,
                                    resume="allow" if resume else "never")
        self._context = context_vars.current_run
        where = f"Space {space_id}" if space_id else str(utils.TRACKIO_DIR)
        self.line = (f"rlhfflow: trackio: run {run_name!r} of project {project!r} in "
                     f"{where} (view it with `trackio show --project {project}`)")

    def _banners_off(self) -> contextlib.AbstractContextManager:
        """Trackio's prints kept off the output, for a local run: ``redirect_stdout``
        holds for the whole process, so only around its local, instant calls."""
        return contextlib.redirect_stdout(io.StringIO()) if self._local \
            else contextlib.nullcontext()

    def log(self, record: dict[str, Any]) -> None:
        """Log one iteration's metrics, step = iteration."""
        self.run.log(flat_metrics(record), step=record["iteration"])

    def completions(self, iteration: int, rows: list[dict[str, Any]]) -> None:
        """The samples as a ``trackio.Table`` named ``completions``."""
        import trackio

        self.run.log({"completions": trackio.Table(**table_data(rows))}, step=iteration)

    def close(self, failed: bool = False) -> None:
        """Write what is queued and finish the run (with an error alert when the
        rlhfflow run failed)."""
        try:
            with self._banners_off():
                if failed:
                    import trackio

                    self.run.alert("rlhfflow run failed", text="see the run's output and "
                                   "logs/ for the error", level=trackio.AlertLevel.ERROR)
                self.run.finish()
        finally:
            if self._context.get() is self.run:
                self._context.set(None)


def table_data(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Rows as a tracker's table takes them (W&B's and Trackio's ``Table``): ``columns``
    (the first row's keys) and ``data`` (a list of values per row)."""
    columns = list(rows[0])
    return {"columns": columns, "data": [[row.get(c) for c in columns] for row in rows]}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a Markdown table (TensorBoard renders it); cells on one line, ``|``
    escaped, numbers to 4 decimals."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4f}"
        return str(value).replace("|", "\\|").replace("\n", " ")

    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
