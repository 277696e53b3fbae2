"""Why a stage's tasks wait (``rlhfflow plan FILE --explain STAGE``).

The compiled tasks carry every wait with the rule that made it (``rlhfflow.plan.tasks``);
this module reads them back for one stage of one iteration: what each task reads, what
else it waits for, and why.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlhfflow.errors import UserError, did_you_mean
from rlhfflow.plan.compiler import TaskCompiler, batch_rows, by_id, compile_run
from rlhfflow.plan.placement import ExecutionPlan
from rlhfflow.plan.tasks import READS, Rule, SourceTask, StageTask, Task

if TYPE_CHECKING:
    from rlhfflow.config.pipeline import Pipeline


class ExplainError(UserError, ValueError):
    """``--explain`` named no stage of the pipeline."""


def explain(pipeline: Pipeline, plan: ExecutionPlan, stage: str, iteration: int = 1) -> list[str]:
    """Lines saying, for each task of ``stage`` in ``iteration`` (a setup stage: its one
    task), what it reads and what else it waits for, each with its rule's reason.
    Iteration 1 is the first that waits for an earlier one, as every later one does."""
    graph = pipeline.graph
    if stage not in graph.nodes:
        hint = did_you_mean(stage, list(graph.nodes)) or \
            f"; stages: {', '.join(graph.nodes)}"
        raise ExplainError(f"--explain: no stage {stage!r} in {pipeline.source}{hint}")
    versions = {m: 0 for m in pipeline.spec.models}
    specs: Sequence[Task]
    if stage in graph.setup_stages:
        specs = TaskCompiler(pipeline, plan, versions).setup()
        iteration = -1
    else:
        iteration = min(iteration, max(0, pipeline.spec.iterations - 1))
        # the iterations that may wait for it or run ahead of it are compiled too
        last = iteration + plan.max_staleness + 2
        specs, _ = compile_run(pipeline, plan, versions, last, rows=batch_rows(pipeline))
    tasks = by_id(specs)
    mine = [t for t in specs if isinstance(t, StageTask) and t.iteration == iteration
            and stage in t.stages]
    where = "setup, before the loop" if iteration < 0 else f"iteration {iteration}"
    lines = [f"{stage}: {len(mine)} task(s) in {where}"]
    group = mine[0].stages if mine else (stage,)
    if len(group) > 1:
        lines.append(f"  fused into one task with {', '.join(n for n in group if n != stage)}"
                     f" (they run in it in the order {' -> '.join(group)})")
    for task in mine:
        lines.append(f"  {task.id}: {_what(task)}")
        reads = [r for p in task.parts for r in p.refs]
        if reads:
            lines.append(_line(READS, None, reads, tasks))
        if task.behind:
            lines += _finish_order(task, plan.max_staleness)
        elif task.ahead:
            later = range(task.iteration + 1, task.iteration + 1 + task.ahead)
            lines.append(f"    streams: it also gets its rows of iteration(s) "
                         f"{', '.join(map(str, later))} and starts their episodes as its own "
                         f"finish (no further: max_staleness {task.ahead}); what is unfinished "
                         f"plays on between tasks, and it waits only for its own episodes")
        by_rule: dict[tuple[Rule, str | None], list[str]] = defaultdict(list)
        for wait in task.waits:
            by_rule[(wait.rule, wait.model)].append(wait.task)
        for (rule, model), ids in by_rule.items():
            lines.append(_line(rule, model, ids, tasks))
        if not reads and not task.waits:
            lines.append("    waits for nothing: it starts as soon as a worker is free")
    return lines


def _finish_order(task: StageTask, staleness: int) -> list[str]:
    """What a task of a stage that reorders rows (``stream_order: finish``) takes, and
    why it waits."""
    k, rows = task.iteration, task.rows[1] - task.rows[0]
    later = ", ".join(map(str, range(k + 1, k + 1 + task.ahead)))
    return [f"    streams, finish order: it gets its rows of iteration {k} and of "
            f"iteration(s) {later} (and of the {task.behind} before, to play again after a "
            f"resume), starts episodes as room frees (twice its rows held by default), and "
            f"returns {rows} episodes in whole groups: first every group started on weights "
            f"{staleness} version(s) behind its own (the staleness bound), then the groups "
            f"that finished first",
            "    it waits while such an owed group is unfinished, or while fewer finished "
            "groups than its rows are ready (stream_wait_owed_s, stream_wait_groups_s)"]


def _what(task: StageTask) -> str:
    a, b = task.rows
    rows = f"rows {a}-{b - 1}" if b > a else "no rows"
    where = "any worker" if not task.workers else \
        f"worker {task.workers[0]}" if len(task.workers) == 1 else \
        f"workers {', '.join(map(str, task.workers))}"
    gang = f", rank {task.rank} of a gang of {len(task.gang)}" if task.gang else ""
    return f"{rows}, on {where}{gang}, priority {task.priority}"


def _line(rule: Rule, model: str | None, ids: list[str], tasks: dict[str, Task]) -> str:
    """``rule``'s line: the tasks waited for, by what they run, and why."""
    counts: dict[str, int] = defaultdict(int)
    for i in dict.fromkeys(ids):
        t = tasks.get(i)
        label = "the prompts" if isinstance(t, SourceTask) else t.label if t else i
        name = label if t is None else f"{label} ({_when(t)})"
        counts[name] += 1
    waited = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())
    return f"    {rule.name}: {waited}: {rule.reason(model)}"


def _when(task: Task) -> str:
    return "setup" if task.iteration < 0 else f"iteration {task.iteration}"
