"""The run loop's order of compiling and finishing iterations (``loop_steps``): shared by
the executor (``rlhfflow.runtime.executor``), the compiler's ``compile_run`` and the
simulator (``rlhfflow.plan.auto.simulate``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopStep:
    """One step of the run loop: begin the turn of ``iteration`` (``start``: where a run
    may stop), compile its source and the stages that run ahead (``ahead``), compile the
    rest (``main``, after ``previous``, before ``later``'s ahead stages train), or wait
    for it and log it (``finish``)."""

    kind: str
    iteration: int
    previous: int | None = None
    later: int | None = None


def loop_steps(first: int, iterations: int, lag: int, pipelined: bool = True
               ) -> Iterator[LoopStep]:
    """The run loop's order of compiling and finishing iterations ``first..iterations-1``.

    Iteration k+1 is compiled before k is finished, so the scheduler starts it the moment
    its inputs exist (an inline backend runs tasks as they are submitted: no overlap);
    the stages that run ahead (``lag`` = max_staleness) are compiled ``lag`` iterations
    earlier. The caller may stop at a ``start`` step."""
    live: set[int] = set()
    previous: int | None = None
    for k in range(first, iterations):
        yield LoopStep("start", k)
        for i in range(k, min(k + lag, iterations - 1) + 1):
            if i not in live:
                live.add(i)
                yield LoopStep("ahead", i, previous)
        live.discard(k)
        later = k + lag if k + lag in live else None
        yield LoopStep("main", k, previous, later)
        if previous is not None:
            yield LoopStep("finish", previous)
        previous = k
        if not pipelined:
            yield LoopStep("finish", k)
            previous = None
    if previous is not None:
        yield LoopStep("finish", previous)
