"""The environment time of a multi-turn rollout task, which no FLOP count sees.

An episode of up to ``turns`` model turns spends, after each turn, one environment step
(or tool call) of ``step_s`` seconds on average; the planner knows the most turns
(``max_turns``), not how they vary, and assumes an episode's turns spread
evenly from 1 to the most (a mean of ``(1 + turns) / 2``). The steps of a task's episodes
run ``slots`` at a time: on ``env_workers`` threads while the model decodes the other
rows, or one at a time in turn with decoding (``env_workers: 0``).

- A **synchronous** task returns when its slowest episode ends: the most turns' steps one
  after another (the long tail), unless the threads are too few for all the rows' steps,
  which then take their total over the threads.
- A **streaming** task (``stream: true``) starts the next iterations' episodes in its
  tail, so in steady state a task's rows cost the mean episode's steps per slot
  (``stream_in_flight`` slots, default the task's rows). Nothing is taken off for the
  steps that go on between tasks (on a colocated plan the episodes then wait for the
  worker's training to end): the measured time does not show them. Taking one step off
  predicted ``benchmarks/longtail.py``'s streaming iteration 22% short, leaving it 10%
  (2026-11-28, 2 Xeon cores).
- In **finish order** (``stream_order: finish``) a task returns the groups that finished
  first: its rows' mean steps over its slots (twice its rows held by default), but no
  less than the slowest episode's steps over the ``max_staleness + 1`` tasks it may span,
  since the bound makes a task wait for an episode started that many versions back.
"""

from __future__ import annotations


def mean_turns(turns: int) -> float:
    """An episode's mean model turns when they spread evenly from 1 to ``turns``."""
    return (1 + max(1, turns)) / 2


def slots(rows: int, env_workers: int, in_flight: int | None = None) -> int:
    """How many of a task's episodes step at once: its episodes in flight (``in_flight``,
    else its ``rows``) up to the ``env_workers`` threads; 1 without threads."""
    if env_workers <= 0:
        return 1
    return max(1, min(in_flight or rows, env_workers))


def sync_seconds(step_s: float, rows: int, turns: int, env_workers: int) -> float:
    """Environment seconds of a synchronous task of ``rows`` episodes: its slowest
    episode's ``turns`` steps, or all its steps through too few slots."""
    if step_s <= 0 or rows <= 0:
        return 0.0
    return step_s * max(turns, rows * mean_turns(turns) / slots(rows, env_workers))


def stream_seconds(step_s: float, rows: int, turns: int, env_workers: int,
                   in_flight: int | None = None) -> float:
    """Environment seconds per task of a streaming rollout in steady state: its rows'
    mean steps per slot."""
    if step_s <= 0 or rows <= 0:
        return 0.0
    return step_s * rows * mean_turns(turns) / slots(rows, env_workers, in_flight)


def finish_seconds(step_s: float, rows: int, turns: int, env_workers: int,
                   in_flight: int | None, staleness: int) -> float:
    """Environment seconds per task of a streaming rollout in finish order: its rows'
    mean steps over its slots (twice its rows held by default), but no less than the
    slowest episode's steps spread over the ``staleness + 1`` tasks it may span (the
    bound makes a task wait for an episode started that many versions back)."""
    if step_s <= 0 or rows <= 0:
        return 0.0
    return max(stream_seconds(step_s, rows, turns, env_workers, in_flight or 2 * rows),
               step_s * turns / (staleness + 1))


def step_from(env_s: float, rows: int, turns: int, env_workers: int) -> float:
    """The mean step time a synchronous task's measured environment seconds imply (the
    inverse of :func:`sync_seconds`)."""
    return env_s / max(turns, rows * mean_turns(turns) / slots(rows, env_workers))
