"""Watching a run: the rlhfflow page of the Dask dashboard (``dashboard``), the HTML
report of a finished run (``report``), copies of the metrics in TensorBoard, MLflow,
W&B and Trackio (``sinks``), and completions tables (``completions``).

``RunMonitor`` is what the executor calls: once when the run starts, once per iteration
with the record it wrote to ``metrics.jsonl`` (the iteration is committed to the buffer
by then, where the completions are read from), once at the end.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rlhfflow.monitor.completions import (
    append_rows,
    completion_rows,
    conversation_lines,
    reward_columns,
)
from rlhfflow.monitor.sinks import WANDB_RUN_FILE
from rlhfflow.storage import ExperienceBuffer

logger = logging.getLogger(__name__)

# what the dashboard page draws, with the figures the stages declare (under "metrics"):
# the rest of a record stays in metrics.jsonl
PUBLISHED = ("iteration", "reward_mean", "kl_mean", "response_length_mean", "iteration_s",
             "stage_s", "busy_frac", "staleness_mean", "staleness_max")


class RunMonitor:
    """Publishes a run's iterations to the dashboard page and the ``logging:`` sinks.

    Nothing here may stop a run: a sink or a scheduler that fails is reported once on
    the log and then left alone.
    """

    def __init__(self, pipeline, backend, output_dir: Path,
                 say: Callable[[str], None] = lambda line: None,
                 resumed: bool = False, first: int = 0) -> None:
        self.name = pipeline.name
        self.iterations = pipeline.spec.iterations
        self.client = backend.client
        self.run = uuid.uuid4().hex[:12]
        self.output_dir = output_dir
        self.completions_every = pipeline.spec.logging.completions_every
        # the figures the stages declare (Stage.iteration_metrics) that the page has no
        # fixed plot for: one plot each
        self.declared = [m.name for node in pipeline.graph.nodes.values()
                         for m in node.metrics if m.name not in PUBLISHED]
        self.rewards = reward_columns(pipeline) if self.completions_every else []
        self.sinks = []
        for where, make in _sinks(pipeline, output_dir, resumed, first):
            try:
                self.sinks.append(make())
                if getattr(self.sinks[-1], "line", None):
                    say(self.sinks[-1].line)
            except Exception as exc:  # noqa: BLE001 - e.g. an unreachable tracking server
                say(f"rlhfflow: warning: {where}: cannot log there, going on without it: "
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
        link = backend.dashboard_link
        if self.client is not None and link:
            say(page_line(self.client, link))

    def iteration(self, record: dict[str, Any]) -> None:
        """Publish one iteration's metrics record (as written to metrics.jsonl)."""
        if self.client is not None:
            message = {k: record.get(k) for k in PUBLISHED}
            message["metrics"] = {k: record[k] for k in self.declared if k in record}
            message.update(run=self.run, pipeline=self.name, iterations=self.iterations)
            try:
                self.client.log_event("rlhfflow", message)
            except Exception as exc:  # noqa: BLE001 - the page is a view, not the record
                logger.warning("rlhfflow: cannot publish to the scheduler: %s", exc)
                self.client = None
        rows = self._completions(record["iteration"])
        for sink in list(self.sinks):
            try:
                sink.log(record)
                if rows and hasattr(sink, "completions"):
                    sink.completions(record["iteration"], rows)
            except Exception as exc:  # noqa: BLE001 - metrics.jsonl has it all the same
                logger.warning("rlhfflow: logging to %s stopped: %s", type(sink).__name__, exc)
                self.sinks.remove(sink)

    def _completions(self, iteration: int) -> list[dict[str, Any]]:
        """Every ``completions_every``-th iteration's samples, appended to
        ``OUTPUT/completions.jsonl``; [] for the other iterations."""
        if not self.completions_every or iteration % self.completions_every:
            return []
        try:
            buffer = ExperienceBuffer(self.output_dir / "buffer.zarr", create=False)
            rows = completion_rows(buffer, iteration, self.rewards)
            append_rows(self.output_dir / "completions.jsonl", iteration, rows)
        except Exception as exc:  # noqa: BLE001 - a view of the run, never its end
            logger.warning("rlhfflow: no completions table of iteration %d: %s", iteration, exc)
            return []
        # a table cell holds text: an episode's turns as its conversation
        return [{**row, "turns": "\n".join(conversation_lines(row["turns"]))}
                if "turns" in row else row for row in rows]

    def close(self, failed: bool = False) -> None:
        """Close the sinks (an MLflow run is marked finished, or failed)."""
        for sink in self.sinks:
            try:
                sink.close(failed)
            except Exception as exc:  # noqa: BLE001 - on the way out
                logger.warning("rlhfflow: closing %s: %s", type(sink).__name__, exc)
        self.sinks = []


def page_line(client, dashboard_link: str) -> str:
    """The line that gives the rlhfflow page's URL, or says how to get the page."""
    url = dashboard_link.rsplit("/", 1)[0] + "/rlhfflow"
    try:
        served = client.run_on_scheduler(
            lambda dask_scheduler: "rlhfflow-dashboard" in dask_scheduler.plugins)
    except Exception:  # noqa: BLE001 - e.g. a scheduler that cannot unpickle the check
        served = False
    if served:
        return f"rlhfflow: rlhfflow page: {url}"
    return ("rlhfflow: no rlhfflow page on this scheduler (start it with "
            "`dask scheduler --preload rlhfflow.monitor.dashboard` to get one)")


def _sinks(pipeline, output_dir: Path, resumed: bool,
           first: int = 0) -> list[tuple[str, Callable[[], Any]]]:
    """The sinks the ``logging:`` section asks for: (key, constructor) pairs. ``resumed``:
    the run goes on from an earlier one at iteration ``first`` (the trackers' runs then
    go on too)."""
    from rlhfflow.monitor.sinks import MlflowSink, TensorBoardSink, TrackioSink, WandbSink

    spec = pipeline.spec.logging
    sinks: list[tuple[str, Callable[[], Any]]] = []
    # partial, not lambda: each constructor keeps its own arguments (a lambda reads a
    # name shared with the later sinks when it is called, after they rebound it)
    if spec.tensorboard is not False:
        directory = output_dir / "tensorboard" if spec.tensorboard is True \
            else pipeline.resolve(spec.tensorboard)
        sinks.append(("logging.tensorboard", partial(
            TensorBoardSink, directory, purge_step=first if resumed else None)))
    if spec.mlflow is not None:
        m = spec.mlflow
        params = {"pipeline": pipeline.name, "algorithm": pipeline.spec.algorithm.name,
                  "iterations": pipeline.spec.iterations, "output": str(output_dir)}
        sinks.append(("logging.mlflow", partial(
            MlflowSink, m.tracking_uri, m.experiment, m.run_name or pipeline.name, params)))
    # the run's description in the trackers that keep one (W&B, Trackio)
    config = {"pipeline": pipeline.name, "algorithm": pipeline.spec.algorithm.name,
              "iterations": pipeline.spec.iterations, "seed": pipeline.spec.seed,
              "output": str(output_dir)}
    if spec.wandb is not None:
        w = spec.wandb
        sinks.append(("logging.wandb", partial(
            WandbSink, w.project, w.mode, pipeline.resolve(w.dir) if w.dir else output_dir,
            w.run_name or pipeline.name, w.entity, w.tags, config,
            run_file=output_dir / WANDB_RUN_FILE, resume=resumed)))
    if spec.trackio is not None:
        t = spec.trackio
        sinks.append(("logging.trackio", partial(
            TrackioSink, t.project, t.run_name or pipeline.name, t.group, t.space_id, config,
            resumed)))
    return sinks
