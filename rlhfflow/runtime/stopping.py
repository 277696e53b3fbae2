"""What a stop request (Ctrl-C, SIGTERM) cancels: the rule on task specs, without Dask.

A run submits ahead of the iteration it waits for: the next iteration's tasks (so the
scheduler starts them the moment their inputs exist) and, with ``overlap.max_staleness``,
the stages that run ahead. A stop finishes the iteration in flight and cancels the rest,
except what cannot be undone: a task that updates a model (a training stage, a weight
install), once started, has moved the model past the iteration in flight, so its
iteration is finished too (the checkpoint then holds that iteration's weights); a gang
with a started rank runs whole (its peers would wait in their collective forever).
``stop_line`` says so, once, in words.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhfflow.plan.tasks import InstallTask, StageTask, Task

#: Scheduler states of a task that has been sent to a worker (and may be running there)
#: or has run.
STARTED = frozenset({"processing", "memory", "erred"})


@dataclass(frozen=True)
class StopPlan:
    """What a stop does with the tasks submitted after the iteration in flight.

    Attributes:
        finish: the iterations after it that are finished too (an update of theirs
            started), in order.
        cancel: the ids of the tasks cancelled.
        running: the ids among ``cancel`` already sent to a worker: each runs to its end
            there (a running task cannot be interrupted), its result dropped.
    """

    finish: tuple[int, ...]
    cancel: tuple[str, ...]
    running: tuple[str, ...]


def plan_stop(done: int, unfinished: Collection[int], tasks: Mapping[str, Task],
              states: Mapping[str, str], trains: Callable[[Task], bool],
              begun: Collection[int] = ()) -> StopPlan:
    """The stop of a run that finishes iteration ``done`` (the one in flight). ``tasks``
    (by id) are those it still holds, ``states`` the scheduler state of those after
    ``done``; ``unfinished`` the iterations after ``done`` whose every stage was
    submitted (the others only their stages that run ahead); ``trains``: whether a stage
    task updates a model; ``begun``: the iterations after ``done`` whose model update the
    workers report begun (``UpdateGate.hold``: the scheduler's state of a task that was
    about to start can lag behind it)."""
    def binding(task: Task) -> bool:  # started, it cannot be undone or left half-done
        return isinstance(task, InstallTask) or (
            isinstance(task, StageTask) and (bool(task.gang) or trains(task)))

    started = {i for i, task in tasks.items()
               if task.iteration > done and states.get(i) in STARTED}
    through = max([tasks[i].iteration for i in started
                   if binding(tasks[i]) and tasks[i].iteration in unfinished]
                  + [k for k in begun if k in unfinished], default=done)
    keep = {i for i, task in tasks.items() if task.iteration <= through}
    # a gang with a started rank runs whole (in an iteration of ahead stages only, the
    # rest of that iteration is cancelled)
    gangs = {(tasks[i].iteration, tasks[i].stages) for i in started
             if isinstance(tasks[i], StageTask) and tasks[i].gang}
    keep |= {i for i, task in tasks.items()
             if isinstance(task, StageTask) and (task.iteration, task.stages) in gangs}
    # what a kept task waits for stays (Dask cancels a cancelled task's dependents):
    # a trainer waits for the ahead stages of the next iteration, which read the
    # weights before its update
    pending = list(keep)
    while pending:
        for need in tasks[pending.pop()].needs():
            if need in tasks and need not in keep:
                keep.add(need)
                pending.append(need)
    cancel = tuple(i for i, task in tasks.items() if task.iteration > done and i not in keep)
    return StopPlan(finish=tuple(sorted(k for k in unfinished if done < k <= through)),
                    cancel=cancel,
                    running=tuple(i for i in cancel if states.get(i) == "processing"))


def stop_line(done: int, waiting: bool, stop: StopPlan, cancelled: Sequence[int],
              tasks: Mapping[str, Task],
              estimate: Callable[[Sequence[int], Sequence[str]], str]) -> str:
    """The one line a stop says: what the run still waits for after it, and why.
    ``done``, ``waiting``: the iteration the stop finishes, and whether it is in flight
    (else finished); ``cancelled``: the iterations after it cancelled; ``tasks``: those
    the run held as it stopped; ``estimate(iterations, stages)``: how long those take
    (``wait_estimate``)."""
    finishing = [done] * waiting + list(stop.finish)
    line = f"rlhfflow: stopping: finishing {_iterations(finishing)} in flight" \
        if finishing else f"rlhfflow: stopping after iteration {done}"
    if waiting and stop.finish:  # the next one's update started as the stop came
        line += (f" ({_iterations(stop.finish)}: its model update had already begun, "
                 f"which cannot be undone{estimate(stop.finish, ())})")
    if cancelled:
        line += f"; cancelled {_iterations(cancelled)}, submitted ahead"
    running = sorted({(tasks[i].iteration, getattr(tasks[i], "label", tasks[i].id))
                      for i in stop.running if isinstance(tasks[i], StageTask)})
    if running:
        line += ("; " + ", ".join(f"{label} of iteration {k}" for k, label in running)
                 + " had started: the checkpoint waits for it (a running task cannot "
                 "be interrupted" + estimate([], [label for _, label in running])
                 + ")")
    return line + "; then saving a checkpoint"


def wait_estimate(records: Sequence[Mapping[str, Any]], iterations: Sequence[int],
                  stages: Sequence[str] = ()) -> str:
    """``", about N s"``: how long ``iterations`` (or ``stages``, by their compute in the
    last iteration of ``records``, the run's metrics log) take, as the last iteration
    logged took; "" before one was."""
    if not records:
        return ""
    last = records[-1]
    if stages:
        compute = last.get("stage_s") or {}
        seconds = max(sum(compute.get(n, 0.0) for n in label.split("+"))
                      for label in stages)
    else:
        seconds = len(iterations) * (last.get("iteration_s") or 0.0)
    return f", about {seconds:.0f} s as in iteration {last['iteration']}" \
        if seconds >= 1 else ""


def _iterations(ks: Sequence[int]) -> str:
    """``iteration 4`` or ``iterations 4-6`` (``ks`` consecutive, in order)."""
    return f"iteration {ks[0]}" if len(ks) == 1 else f"iterations {ks[0]}-{ks[-1]}"
