"""The coordinator's decisions, as a pure state: what a run does next, decided from what
happened, with no Dask, no torch and no file in sight (``docs/design/coordinator.md``).

``Coordinator`` holds the run's progress: the last iteration committed, the last
checkpoint published, the iterations submitted and not yet committed, the checkpoints
due, the restarts counted against ``cluster.max_restarts``, what a stop has decided, and
the models' versions after each iteration. The executor (the driver) feeds it typed
outcomes through ``handle`` and performs the typed actions it returns, through the
``Backend``, the dataflow and the stores. Like dask/distributed's worker state
(``handle_stimulus``), the state changes only there, so every decision is tested by
feeding it sequences of outcomes (``tests/runtime/test_coordinator.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlhfflow.errors import RunError
from rlhfflow.plan.tasks import Task
from rlhfflow.runtime.failures import stage_failure
from rlhfflow.runtime.stopping import StopPlan

# ----------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class LoopStarted:
    """The iteration loop (re)starts at iteration ``first``: nothing is in flight."""

    first: int


@dataclass(frozen=True)
class IterationSubmitted:
    """Every stage of iteration ``k`` was submitted; the models will be at ``versions``
    once it is done; ``checkpoint``: its checkpoint tasks were submitted too;
    ``staleness``: the plan's ``max_staleness`` (how long ``versions`` are kept)."""

    k: int
    versions: Mapping[str, int]
    checkpoint: bool
    staleness: int


@dataclass(frozen=True)
class IterationCommitted:
    """Iteration ``k`` was waited for, its experience committed and its metrics logged;
    ``problem``: the score-error budget it exhausted (``budget.score_error_budget``)."""

    k: int
    problem: str | None = None


@dataclass(frozen=True)
class StopRequested:
    """A stop was asked for, finishing iteration ``done`` (``waiting``: in flight, else
    the last committed); ``submitted_after``: tasks of later iterations are held."""

    done: int
    waiting: bool
    submitted_after: bool


@dataclass(frozen=True)
class StopPlanned:
    """The stop finishing ``done`` was planned (``stopping.plan_stop``) over ``tasks``
    (by id: those the run held) and what it cancels was cancelled."""

    done: int
    waiting: bool
    plan: StopPlan
    tasks: Mapping[str, Task]


@dataclass(frozen=True)
class ScheduleEnded:
    """The schedule has nothing more to submit (its end, or a stop)."""


@dataclass(frozen=True)
class LoopDrained:
    """Every iteration that was to be finished is committed."""


@dataclass(frozen=True)
class LostWorker:
    """A worker holding models left (``message``: the ``WorkerLost`` error's words)."""

    message: str


@dataclass(frozen=True)
class Recovering:
    """The workers are back; ``checkpoint``: the last whole checkpoint's iteration, or
    None when there is none."""

    checkpoint: int | None


@dataclass(frozen=True)
class StageFailed:
    """A task of ``stage`` failed with ``cause`` after ``retries`` retries (Dask's), in
    ``iteration`` (None: a setup stage), on ``workers``."""

    stage: str
    cause: BaseException
    iteration: int | None
    retries: int
    workers: tuple[str, ...] = ()


Outcome = (LoopStarted | IterationSubmitted | IterationCommitted | StopRequested
           | StopPlanned | ScheduleEnded | LoopDrained | LostWorker | Recovering
           | StageFailed)

# ------------------------------------------------------------------------------ actions


@dataclass(frozen=True)
class Commit:
    """Wait for iteration ``k``, commit its experience, log its metrics."""

    k: int


@dataclass(frozen=True)
class PublishCheckpoint:
    """Wait for checkpoint ``k``'s tasks and publish it; with ``expected`` (the models'
    versions after iteration ``k``), a model saved at another version fails the run."""

    k: int
    expected: Mapping[str, int] | None = None


@dataclass(frozen=True)
class SaveCheckpoint:
    """Submit a checkpoint of iteration ``k`` (the last one, not due by ``every``), then
    publish it as ``PublishCheckpoint`` does."""

    k: int
    expected: Mapping[str, int] | None = None


@dataclass(frozen=True)
class PlanStop:
    """Hold the workers' updates after ``done``, plan the stop over the tasks held
    (``unfinished``: the iterations after ``done`` whose every stage was submitted),
    cancel what it cancels; then report ``StopPlanned``."""

    done: int
    waiting: bool
    unfinished: tuple[int, ...]


@dataclass(frozen=True)
class Abandon:
    """The stop cancelled ``iterations``: forget them and their checkpoints under way
    (their directories are cleaned at resume)."""

    iterations: tuple[int, ...]


@dataclass(frozen=True)
class AnnounceStop:
    """Say, once, what the stop still waits for and why (``stopping.stop_line``):
    ``cancelled``, the iterations given up; ``tasks``, those the run held."""

    done: int
    waiting: bool
    plan: StopPlan
    cancelled: tuple[int, ...]
    tasks: Mapping[str, Task]


@dataclass(frozen=True)
class Say:
    """Say ``line``."""

    line: str


@dataclass(frozen=True)
class Retry:
    """Go on after a lost worker, on the workers there are: the loop from its last whole
    checkpoint, the setup stages from their start (restart ``count`` of the run)."""

    count: int


@dataclass(frozen=True)
class CutBack:
    """Cut the run back to checkpoint ``keep`` (-1: to the start) and go on from the
    iteration after it."""

    keep: int

    @property
    def next_iteration(self) -> int:
        return self.keep + 1

    @property
    def where(self) -> str:
        return f"after iteration {self.keep}" if self.keep >= 0 else "from the start"


@dataclass(frozen=True)
class Fail:
    """Stop the run with a one-line ``RunError``, chained to ``cause`` if any."""

    message: str
    cause: BaseException | None = None

    def error(self) -> RunError:
        """The error to raise (as ``raise RunError(message) from cause`` makes it)."""
        error = RunError(self.message)
        error.__cause__ = self.cause
        error.__suppress_context__ = True
        return error


Action = (Commit | PublishCheckpoint | SaveCheckpoint | PlanStop | Abandon | AnnounceStop
          | Say | Retry | CutBack | Fail)


# -------------------------------------------------------------------------------- state


@dataclass
class Coordinator:
    """A run's progress and the decisions taken from it (module docstring).

    Attributes:
        max_restarts: ``cluster.max_restarts``: lost workers survived, setup and loop
            together.
        last_checkpoint: the iteration of the last checkpoint published (-1: none).
        last: the last iteration committed (of this loop: ``first - 1`` at its start).
        restarts: the lost workers counted so far.
        unfinished: the iterations whose every stage was submitted, not committed yet
            (in submission order).
        due: those of them whose checkpoint tasks were submitted (``checkpoint.every``).
        versions_after: the models' versions once iteration k is done, for the last
            few k submitted.
        stop_said: a stop's line was said (once a loop).
        stop_decided: the iteration a stop's plan was made for (None: none yet).
    """

    max_restarts: int
    last_checkpoint: int = -1
    last: int = -1
    restarts: int = 0
    unfinished: dict[int, None] = field(default_factory=dict)
    due: set[int] = field(default_factory=set)
    versions_after: dict[int, dict[str, int]] = field(default_factory=dict)
    stop_said: bool = False
    stop_decided: int | None = None

    def handle(self, outcome: Outcome) -> list[Action]:
        """Take in ``outcome``; the actions the driver performs next, in order."""
        match outcome:
            case LoopStarted(first):
                self.last = first - 1
                self.unfinished, self.due = {}, set()
                self.stop_said, self.stop_decided = False, None
                return []
            case IterationSubmitted(k, versions, checkpoint, staleness):
                self.unfinished[k] = None
                if checkpoint:
                    self.due.add(k)
                self.versions_after[k] = dict(versions)
                self.versions_after.pop(k - 2 - staleness, None)
                return []
            case IterationCommitted(k, problem):
                self.unfinished.pop(k, None)
                self.last = k
                if problem:  # after the record: the iteration is committed, a resume keeps it
                    return [Fail(problem)]
                return self._publish(k) if k in self.due else []
            case StopRequested(done, waiting, submitted_after):
                return self._stop(done, waiting, submitted_after)
            case StopPlanned(done, waiting, plan, tasks):
                return self._stop_planned(done, waiting, plan, tasks)
            case ScheduleEnded():  # stopped: those whose update had begun
                return [Commit(k) for k in self.unfinished]
            case LoopDrained():
                if self.last <= self.last_checkpoint:
                    return []
                # stopped, the models must still be at iteration ``last``'s versions
                return self._publish(self.last, save=True,
                                     expected=self.versions_after.get(self.last))
            case LostWorker(message):
                self.restarts += 1
                if self.restarts > self.max_restarts:
                    return [Fail(f"{message}; gave up after {self.restarts - 1} restart(s); "
                                 f"the run can be resumed from its last checkpoint")]
                return [Retry(self.restarts)]
            case Recovering(checkpoint):
                self.last_checkpoint = checkpoint if checkpoint is not None else -1
                return [CutBack(self.last_checkpoint)]
            case StageFailed(stage, cause, iteration, retries, workers):
                return [Fail(*stage_failure(stage, cause, iteration, retries, workers))]
        raise TypeError(f"not an outcome: {outcome!r}")

    def _publish(self, k: int, save: bool = False,
                 expected: Mapping[str, int] | None = None) -> list[Action]:
        self.due.discard(k)
        self.last_checkpoint = k
        return [SaveCheckpoint(k, expected) if save else PublishCheckpoint(k, expected)]

    def _stop(self, done: int, waiting: bool, submitted_after: bool) -> list[Action]:
        """A stop finishing ``done``: nothing to cancel (say so, once), or a plan to make
        unless one was made for ``done`` already (nothing new since)."""
        if not submitted_after:
            if self.stop_said:
                return []
            self.stop_said = True
            return [Say(f"rlhfflow: stopping: finishing iteration {done} in flight, then "
                        f"saving a checkpoint" if waiting else
                        f"rlhfflow: stopping after iteration {done}, then saving a "
                        f"checkpoint")]
        if self.stop_decided == done:
            return []
        return [PlanStop(done, waiting, tuple(k for k in self.unfinished if k > done))]

    def _stop_planned(self, done: int, waiting: bool, plan: StopPlan,
                      tasks: Mapping[str, Task]) -> list[Action]:
        """The iterations with a task cancelled, less those the stop finishes, are given
        up; the stop's line is said once."""
        self.stop_decided = done
        cancelled = tuple(sorted({tasks[i].iteration for i in plan.cancel} - set(plan.finish)))
        for k in cancelled:
            self.unfinished.pop(k, None)
            self.due.discard(k)
        actions: list[Action] = [Abandon(cancelled)]
        if not self.stop_said:
            self.stop_said = True
            actions.append(AnnounceStop(done, waiting, plan, cancelled, tasks))
        return actions
