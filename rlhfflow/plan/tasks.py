"""The tasks a plan compiles to: one type per kind of work, and every wait with its rule.

A task is plain data: an id, its iteration, its inputs as references to other tasks
(``parts``), what else it waits for (``waits``), the workers it may run on, its priority
and retries. Each kind of work is its own type (``SourceTask``, ``StageTask``,
``StoreTask``, ``ExportTask``, ``InstallTask``, ``CheckpointTask``); the runtime's
dataflow and the planner's simulator dispatch on the type. A wait is not an anonymous id:
it carries the :class:`Rule` that made it, so ``rlhfflow plan --explain STAGE`` can say
why each task waits, for what (as Airflow's dependency rules give their reasons).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """Why one task waits for another. ``why`` completes the sentence "it waits for
    these tasks because ...", with ``{model}`` standing for the model the wait is about."""

    name: str
    why: str

    def reason(self, model: str | None = None) -> str:
        return self.why.format(model=model or "the model")


#: a task takes its input rows from these tasks (the columns they write)
READS = Rule("reads", "it reads the columns they write")
#: a stage lists another in ``after`` without reading what it writes
AFTER = Rule("after", "the pipeline orders it after them (`after:`) without reading "
                      "their columns")
#: a trainer waits for the other users of its model in the same iteration
RELEASE = Rule("release", "it updates {model}, which they still use with the weights "
                          "before this update")
#: a trainer waits for the stages that run ahead on its model's home workers
AHEAD_RELEASE = Rule("ahead-release", "it updates {model}, which they use on its home "
                                      "workers while running ahead (max_staleness)")
#: a stage waits for the previous iteration's update of the model it uses
UPDATED = Rule("updated", "they train {model} in the previous iteration and it uses the "
                          "updated weights")
#: a stage on a shadow copy waits for the new weights to be installed on it
INSTALLED = Rule("installed", "they install the previous iteration's weights of {model} "
                              "on the shadow copy it uses")
#: a trainer waits for the previous checkpoint to save its model
SAVED = Rule("saved", "they save {model} into the previous iteration's checkpoint, "
                      "before this update changes it")
#: overlap.sequential: everything in order
SEQUENTIAL = Rule("sequential", "overlap.sequential runs every stage after the one "
                                "before it, and each iteration after the last")
#: a gang waits for the previous gang on the same workers
GANG = Rule("gang", "they are the previous gang on the same workers: two gangs must not "
                    "wait for each other in their collectives")
#: an install on a shadow copy waits for the stages still using the copy's weights
AHEAD_USERS = Rule("ahead-users", "they run ahead on the shadow copy of {model} with the "
                                  "weights it is about to replace")
#: a checkpoint saves a model once the iteration's update of it is done
TRAINED = Rule("trained", "they are the update of {model} the checkpoint saves")

RULES = (READS, AFTER, RELEASE, AHEAD_RELEASE, UPDATED, INSTALLED, SAVED, SEQUENTIAL, GANG,
         AHEAD_USERS, TRAINED)


@dataclass(frozen=True)
class Wait:
    """One task waited for, and the rule that made the wait (about ``model``)."""

    task: str
    rule: Rule
    model: str | None = None


# --------------------------------------------------------------------------- priority

#: priorities of one iteration span this many levels
ITERATION_SPAN = 1000
#: levels within an iteration: weight transfers before every stage (a stage's level is
#: its upward rank, 1..998), checkpoints below the stages, stores last
TRANSFER_LEVEL, CHECKPOINT_LEVEL, STORE_LEVEL = 999, 0, -1


def priority(iteration: int, level: int) -> int:
    """Dask's priority (higher first) of a task at ``level`` of ``iteration``: an earlier
    iteration's tasks before a later one's stages and checkpoints (the later one's weight
    transfers tie with the earlier one's stores), then by level."""
    return -iteration * ITERATION_SPAN + level


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Part:
    """One input of a task: the results of ``refs`` (one per micro-batch of a producer,
    concatenated row-wise) and, for a micro-batch task, the rows ``[a, b)`` to take of
    that concatenation (None: all of it)."""

    refs: tuple[str, ...]
    rows: tuple[int, int] | None = None


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task of a run, as data.

    Attributes:
        id: unique within a run (the Dask key is the id plus a random token; its first
            word names the stage, so the dashboard groups tasks by stage). Never parsed:
            the runtime maps keys back to tasks.
        iteration: the iteration (-1 for setup stages).
        parts: the data inputs, in the order the task takes them.
        waits: the other tasks it must run after (no data from them), with their rules.
        workers: the workers it may run on (empty: any).
        priority: higher runs first among ready tasks (Dask's convention; ``priority``).
        retries: how often a failed attempt is retried.
        rows: the rows ``[a, b)`` of the iteration's batch it works on.
    """

    kind: ClassVar[str] = "task"

    id: str
    iteration: int
    parts: tuple[Part, ...] = ()
    waits: tuple[Wait, ...] = ()
    workers: tuple[int, ...] = ()
    priority: int = 0
    retries: int = 0
    rows: tuple[int, int] = (0, 0)

    @property
    def label(self) -> str:
        """What the task is shown as (a stage task: its stages joined by ``+``)."""
        return self.kind

    def wait_ids(self) -> list[str]:
        """The ids of ``waits``, once each, in order."""
        return list(dict.fromkeys(w.task for w in self.waits))

    def needs(self) -> list[str]:
        """Every id the task waits for: its inputs' and its other waits, once each."""
        return list(dict.fromkeys([r for p in self.parts for r in p.refs]
                                  + [w.task for w in self.waits]))


@dataclass(frozen=True, kw_only=True)
class SourceTask(Task):
    """The prompts of one micro-batch, placed next to the first stage's tasks."""

    kind: ClassVar[str] = "source"


class Storage(Enum):
    """Who writes an iteration's rows (one source micro-batch's) to the buffer."""

    #: a store task, after the stage tasks that wrote the rows
    STORE_TASK = "store task"
    #: the stage task itself (its group writes every column), which still returns its
    #: columns: a task outside its group reads them
    STAGE_TASK = "stage task"
    #: the stage task itself, returning none of its columns: no other task reads them
    STAGE_TASK_NO_COLUMNS = "stage task, no columns returned"


@dataclass(frozen=True, kw_only=True)
class StageTask(Task):
    """A group of fused stages on a micro-batch, the whole batch, or one rank of a gang.

    Attributes:
        stages: the stages it runs, in order (several when fused).
        versions: the model versions it expects on its worker.
        gang: for one rank of a data-parallel gang, the gang's workers (rank = index).
        rank: its rank in the gang.
        storage: who writes its rows to the buffer: a store task, or the task itself in
            place of one (``Storage.STAGE_TASK``: its group holds every stage that
            writes columns, and its rows are one source micro-batch's), returning its
            columns only where another task reads them.
        reports: a storing task that is its iteration's only task, on a one-worker plan,
            returns its worker's task timings with its result (the coordinator then asks
            no worker for them).
        ahead: for a group with a stage that streams, how many later iterations' rows
            (its own rows of them) go with the task (``StageContext.ahead``).
        behind: for a group with a stage that reorders rows, how many earlier
            iterations' rows go with the task (``StageContext.behind``): the run's
            ``max_staleness``, as many as an episode may wait past its own.
    """

    kind: ClassVar[str] = "stage"

    stages: tuple[str, ...] = ()
    versions: Mapping[str, int] = field(default_factory=dict)
    gang: tuple[int, ...] = ()
    rank: int = 0
    storage: Storage = Storage.STORE_TASK
    reports: bool = False
    ahead: int = 0
    behind: int = 0

    @property
    def stores(self) -> bool:
        """Whether the task writes its own rows to the buffer (no store task does)."""
        return self.storage is not Storage.STORE_TASK

    @property
    def label(self) -> str:
        return "+".join(self.stages)


@dataclass(frozen=True, kw_only=True)
class StoreTask(Task):
    """Writes one source micro-batch's rows (chunk-aligned) to the buffer."""

    kind: ClassVar[str] = "store"


@dataclass(frozen=True, kw_only=True)
class ExportTask(Task):
    """Exports ``model``'s new weights at its home, for its shadow copies."""

    kind: ClassVar[str] = "export"

    model: str


@dataclass(frozen=True, kw_only=True)
class InstallTask(Task):
    """Installs exported weights of ``model`` as ``version`` on one shadow copy."""

    kind: ClassVar[str] = "install"

    model: str
    version: int


@dataclass(frozen=True, kw_only=True)
class CheckpointTask(Task):
    """Saves ``model`` (rank 0 of its gang; with DeepSpeed every rank its shard) into the
    checkpoint of its iteration."""

    kind: ClassVar[str] = "checkpoint"

    model: str
    rank: int = 0
