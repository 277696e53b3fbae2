"""Streaming episodes: one decode loop per rollout worker that lives across iterations.

A plain rollout task plays its batch's episodes and returns when the slowest one ends: as
episodes finish, the decode batch empties and the worker waits on a long tail (an
episode with many turns, a slow tool). An :class:`EpisodeStream` is the multi-turn
episode loop (:class:`rlhfflow.engine.episodes.EpisodeLoop`: rows leave the batch for the
environment and rejoin with their KV cache) kept in the worker between tasks, so the
episodes of the *next* iterations can run in that tail:

- A task hands the stream its own episodes (started at once, or found already under way)
  and the next iterations' (``ahead``: admitted while fewer than ``target`` episodes are
  in flight, nearest iteration first), and plays until its own are done. What is still
  under way stays in the stream, its environment steps going on, for the task that owns
  it.
- **Partial rollouts**: an episode goes on across weight updates. Each model token records
  the version of the weights that sampled it (``Episode.versions``). When a task finds
  newer weights than the stream decoded with, every episode in flight rebuilds its KV
  cache under them (what AReaL calls recomputing after an interruption): the tokens it
  sampled stay, the next ones are the new policy's.
- **Staleness by admission**: the stream is only given the iterations it may run ahead
  (the run's ``max_staleness``), so no token is older than that many versions when it is
  trained on; nothing is thrown away to keep the bound. An episode the stream holds that
  no task will claim (the run went back to a checkpoint, the rows went to another
  worker) is dropped and counted (``TaskStats.dropped``).

The same episode (prompt, seed, weights) gives the same tokens as the plain loop up to
float rounding of batched products: its uniforms are its row's stream
(``sampling.sample_uniforms``), whatever else decodes beside it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfflow.engine.batch import pad_prompts
from rlhfflow.engine.environments import Episode, TurnFormat
from rlhfflow.engine.episodes import EpisodeLoop, EpisodeParams, Timeline
from rlhfflow.errors import RunError
from rlhfflow.types import Batch

log = logging.getLogger(__name__)

#: an episode's identity across tasks: (iteration, prompt_index, sample_index)
Key = tuple[int, int, int]

#: the streams of this process that decode between tasks (``EpisodeStream.between``)
_BETWEEN: weakref.WeakSet[EpisodeStream] = weakref.WeakSet()
#: per thread, the streams each ``paused`` block it is in holds (innermost last)
_PAUSES = threading.local()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Hold every stream of this process that decodes between tasks at its next step
    boundary for the block: a task that writes a model's weights (a training step, an
    install) or plays a stream itself runs alone. A stream that starts decoding between
    tasks inside the block is held by it too."""
    held: list[EpisodeStream] = []
    stack = _PAUSES.__dict__.setdefault("stack", [])
    stack.append(held)
    try:
        for stream in list(_BETWEEN):
            stream.hold()
            held.append(stream)
        yield
    finally:
        stack.pop()
        for stream in held:
            stream.lock.release()


@dataclass
class Admission:
    """What an episode needs to start: its key, its ``Episode`` (the environment reset,
    its opening messages added), its prompt's token ids, whether the prompt was rendered
    with the chat template, and its uniforms (float64, one per response token); its
    ``group`` (the source's ``group_ids``: the samples of one prompt, taken together in
    finish order) and its row's ``source`` columns (what a task that returns it writes)."""

    key: Key
    episode: Episode
    prompt: list[int]
    templated: bool
    uniforms: torch.Tensor
    group: int = -1
    source: dict[str, Any] = field(default_factory=dict)


@dataclass
class TaskStats:
    """What the stream did since its last harvest (a task, and the time between tasks
    before it): decode ``steps``, the rows decoding summed over them (``decoding``), the
    episodes in flight summed over them (``live``), the episodes of later iterations it
    started (``started_ahead``) and those it dropped."""

    target: int
    steps: int = 0
    decoding: int = 0
    live: int = 0
    started_ahead: int = 0
    dropped: int = 0
    #: finish order: seconds the task played on because a group owed from an earlier
    #: iteration was unfinished (the staleness bound), and because fewer finished
    #: groups than its rows were ready
    owed_s: float = 0.0
    short_s: float = 0.0

    @property
    def occupancy(self) -> float:
        """The decode batch's mean share of ``target`` rows over the task's steps."""
        return self.decoding / (self.steps * self.target) if self.steps else 0.0

    @property
    def in_flight(self) -> float:
        """The mean number of episodes in flight (decoding, in the environment, or
        waiting to rejoin) over the task's decode steps."""
        return self.live / self.steps if self.steps else 0.0


class EpisodeStream(EpisodeLoop):
    """The episode loop kept across tasks (see the module's docstring). Rows are numbered
    as episodes arrive and forgotten when a task takes them; ``target`` is how many
    episodes the stream keeps in flight when it has later iterations' episodes waiting."""

    def __init__(self, params: EpisodeParams, module: torch.nn.Module, tok, fmt: TurnFormat,
                 pad_id: int, target: int, stops: Sequence[str] | None = None,
                 recompute: bool = True, held: bool = False) -> None:
        super().__init__(params, module, tok, fmt, [], [], torch.empty(0, 0), pad_id, stops)
        self.module = module
        self.target = target
        self.recompute = recompute
        # finish order counts the finished episodes no task took yet against ``target``,
        # and holds no more than the tasks until an episode started now is owed can take
        # (``room``), so no task owes more than its rows
        self.held = held
        self.per_task = 0   # finish order: a task's rows
        self.staleness = 0  # finish order: the bound, in versions
        # finish order: rows asked per iteration (the tasks of several micro-batches on
        # one worker share its stream)
        self.asked: dict[int, int] = {}
        self.episodes: dict[int, Episode] = {}  # type: ignore[assignment]
        self.prompts: dict[int, list[int]] = {}  # type: ignore[assignment]
        self.templated: dict[int, bool] = {}  # type: ignore[assignment]
        self.uniforms: dict[int, torch.Tensor] = {}  # type: ignore[assignment]
        self.keys: dict[int, Key] = {}
        self.rows: dict[Key, int] = {}
        self.waiting: deque[int] = deque()  # admitted ahead, not started (no room yet)
        self.midturn: set[int] = set()      # parked by a weight update in the middle of a turn
        # row -> the versions of the tokens its turn sampled before the last weight update
        self.turn_versions: dict[int, list[int]] = {}
        self.started_in: dict[int, int] = {}  # row -> the task that started it
        self.started_on: dict[int, int] = {}  # row -> the weights' version it started on
        # finish order: row -> its group, the order in which rows were seen done, and
        # the episodes taken (key -> the iteration that took it and the version it took
        # it on) a task may meet again
        self.group: dict[int, int] = {}
        self.source: dict[int, dict[str, Any]] = {}
        self.finished: dict[int, int] = {}
        self.seen = 0  # episodes numbered in finished so far
        self.taken: dict[Key, tuple[int, int]] = {}
        self.pool: concurrent.futures.Executor | None = None
        self.ships = False
        self.tasks = 0
        self.numbered = 0  # rows numbered so far
        self.stats = TaskStats(target)
        # decoding between tasks (``between``): the lock a step holds, ``paused`` takes
        self.lock = threading.RLock()  # a task's own thread may take it again
        # tasks waiting for ``lock`` (``hold``): the thread lets them in first
        self.wanted = 0
        self.handoff = threading.Condition()
        self.thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.closed = False
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None

    # ----------------------------------------------------------------- a task
    def knows(self, key: Key) -> bool:
        """Whether the episode ``key`` is in the stream (started or waiting) or was taken
        by a task it may meet again (finish order)."""
        return key in self.rows or key in self.taken

    def recall_taken(self, iteration: int, behind: int, taken: Sequence[Key] = ()) -> None:
        """Finish order, before the task of ``iteration`` makes its arrivals: keep as
        taken what an earlier iteration took of the iterations from ``behind`` before
        this one on (a task of this iteration or later that took one was undone: the run
        went back), and ``taken``, what the iterations before a resume took."""
        self.taken = {key: took for key, took in self.taken.items()
                      if took[0] < iteration and key[0] >= iteration - behind}
        self.taken.update((key, (iteration - 1, -1)) for key in taken)

    def begin_task(self, iteration: int, version: int, own: Sequence[Key],
                   arrivals: Sequence[Admission], pool: concurrent.futures.Executor | None,
                   ships: bool = False, behind: int = 0) -> list[int]:
        """Open the task of ``iteration`` on weights ``version``: drop what no task will
        claim (an episode of an iteration more than ``behind`` before this one: 0 in
        iteration order, the staleness bound in finish order; this iteration's other rows
        may be another task's on this worker), take the new episodes ``arrivals`` (each
        key once: ``knows``), start ``own`` at once and queue the later ones. Returns the
        rows of ``own`` the stream holds, in order."""
        if self.failure is not None:  # what went wrong between tasks fails this one
            failure, self.failure = self.failure, None
            raise failure
        self.tasks += 1
        self.pool, self.ships = pool, ships
        self.timeline = Timeline()
        self.ready = dict.fromkeys(self.ready, 0)  # step numbers restart with the timeline
        if version != self.version:
            self.reweigh(version)
        for row, key in list(self.keys.items()):
            if key[0] < iteration - behind:
                self.drop(row)
        for arrival in arrivals:
            self.add(arrival)
        rows = [self.rows[key] for key in own if key in self.rows]
        fresh = [row for row in rows if row not in self.started_in]
        for row in fresh:
            self.waiting.remove(row)
        self.start(fresh)
        return rows

    def play(self, rows: Sequence[int]) -> None:
        """Decode until every episode of ``rows`` is done, starting waiting episodes of
        later iterations as room frees."""
        self.admit()
        while not all(self.episodes[row].done for row in rows):
            if not (self.batch.rows or self.ready or self.in_flight):
                raise RuntimeError("episode stream: episodes unfinished but none in flight")
            if not self.round():  # nothing to decode: wait for the environment's answers
                self.collect(wait=True)

    def play_finished(self, count: int, staleness: int, iteration: int = 0) -> list[int]:
        """Decode until ``count`` episodes are done, taken in whole groups (a prompt's
        samples): every group with an episode started on weights ``staleness`` versions
        behind the stream's or more (owed: trained later, its tokens would be further
        behind than the bound), then the groups whose last episode finished first.
        Returns their rows, in order of admission (``iteration``: the task's)."""
        self.per_task, self.staleness = count, staleness
        self.asked[iteration] = self.asked.get(iteration, 0) + count
        for old in [k for k in self.asked if k < iteration - 2]:
            del self.asked[old]
        self.admit()
        while True:
            start = time.perf_counter()
            rows, why = self.finished_rows(count, staleness)
            if rows is not None:
                return rows
            if not (self.batch.rows or self.ready or self.in_flight):
                raise RuntimeError(f"episode stream: {count} episodes wanted, fewer in "
                                   f"flight")
            if not self.round():
                self.collect(wait=True)
            spent = time.perf_counter() - start
            if why == "owed":
                self.stats.owed_s += spent
            else:
                self.stats.short_s += spent

    def finished_rows(self, count: int, staleness: int) -> tuple[list[int] | None, str]:
        """``play_finished``'s rows if they are done, else None and why not: ``owed``
        (an owed group is unfinished) or ``short`` (fewer finished groups than ``count``
        rows)."""
        self.see_finished()
        members: dict[int, list[int]] = {}
        for row in self.keys:
            members.setdefault(self.group[row], []).append(row)
        owed = {g for g, rows in members.items()
                if any(self.started_on.get(r, self.version) <= self.version - staleness
                       for r in rows)}
        if any(not self.episodes[r].done for g in owed for r in members[g]):
            return None, "owed"
        chosen = [r for g in owed for r in members[g]]
        ready = sorted((max(self.finished[r] for r in rows), g)
                       for g, rows in members.items()
                       if g not in owed and all(r in self.finished for r in rows))
        for _, g in ready:
            if len(chosen) + len(members[g]) <= count:
                chosen += members[g]
        if len(chosen) > count:
            raise RuntimeError(f"episode stream: {len(chosen)} episodes owed, more than "
                               f"the task's {count} rows")
        return (sorted(chosen), "") if len(chosen) == count else (None, "short")

    def see_finished(self) -> None:
        """Number the episodes seen done since the last look, in that order."""
        for row in self.keys:
            if row not in self.finished and row in self.started_in and \
                    self.episodes[row].done:
                self.finished[row] = self.seen
                self.seen += 1

    def take(self, rows: Sequence[int], iteration: int | None = None
             ) -> tuple[list[Episode], list[bool]]:
        """The finished episodes of ``rows`` (forgotten by the stream), and for each
        whether an earlier task started it; with ``iteration``, their keys are kept as
        taken by it (finish order: a later task may be given them again)."""
        episodes, ahead = [], []
        for row in rows:
            episodes.append(self.episodes[row])
            ahead.append(self.started_in[row] < self.tasks)
            if iteration is not None:
                self.taken[self.keys[row]] = (iteration, self.version)
            self.forget(row)
        return episodes, ahead

    def threads(self, workers: int) -> concurrent.futures.Executor | None:
        """``workers`` threads for the environment's steps, kept with the stream (they
        go on between tasks); None for 0: steps run in the loop."""
        if workers and self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(workers, "rollout-env")
        return self._threads if workers else None

    def harvest(self) -> TaskStats:
        """What the stream did since the last harvest (a task and the time before it)."""
        stats, self.stats = self.stats, TaskStats(self.target)
        return stats

    # ----------------------------------------------------------------- between tasks
    def between(self, version: Callable[[], int],
                generating: Callable[[], contextlib.AbstractContextManager]) -> None:
        """Go on decoding when no task runs (on a thread of the stream's own, started
        once): the episodes in flight and the waiting ones play on, new weights
        (``version()`` moved) are taken up between two steps, and ``paused`` holds the
        thread for any task that runs meanwhile."""
        stack = _PAUSES.__dict__.get("stack")
        if stack and self not in stack[-1]:  # started by a task: held until it ends
            self.hold()
            stack[-1].append(self)
        _BETWEEN.add(self)
        if self.thread is None:
            self.thread = threading.Thread(target=self._between, args=(version, generating),
                                           name="episode-stream", daemon=True)
            self.thread.start()

    def hold(self) -> None:
        """Take ``lock`` for a task, ahead of the thread that decodes between tasks: a
        lock is not fair, and the thread, taking it again right after each step, could
        keep a waiting task out for any number of steps. The task waits for the step
        under way at most."""
        with self.handoff:
            self.wanted += 1
        try:
            self.lock.acquire()
        finally:
            with self.handoff:
                self.wanted -= 1
                self.handoff.notify_all()

    def _between(self, version: Callable[[], int],
                 generating: Callable[[], contextlib.AbstractContextManager]) -> None:
        while not self.closed:
            with self.handoff:  # a task waiting for the lock goes first
                self.handoff.wait_for(lambda: not self.wanted or self.closed)
            with self.lock:
                if self.closed or self.failure is not None:
                    return
                try:
                    if version() != self.version:
                        self.reweigh(version())
                    with generating():
                        moved = self.round()
                except BaseException as exc:  # noqa: BLE001  (the next task raises it)
                    self.failure = exc
                    return
            if not moved:
                waiting = list(self.in_flight)
                if waiting:
                    concurrent.futures.wait(waiting, timeout=0.02,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
                else:
                    time.sleep(0.005)

    def round(self) -> bool:
        """One pass of the loop without waiting: start waiting episodes where there is
        room, take the environment's answers, join, one decode step. Whether anything
        decoded or joined."""
        self.admit()
        self.collect(wait=False)
        joined = bool(self.ready) and self.joins_now()
        if joined:
            self.join()
        stepped = bool(self.batch.rows)
        if stepped:
            self.step()
        if self.held:  # finish order: the order episodes end in
            self.see_finished()
        return stepped or joined

    def close(self) -> int:
        """Drop every episode in the stream (the run ends, the model was replaced) and
        stop decoding between tasks; returns how many were dropped."""
        self.closed = True
        with self.handoff:
            self.handoff.notify_all()
        _BETWEEN.discard(self)
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        rows = list(self.keys)
        for row in rows:
            self.drop(row)
        return len(rows)

    # ----------------------------------------------------------------- episodes
    def add(self, arrival: Admission) -> None:
        """Take a new episode, not started yet."""
        if arrival.key in self.rows:
            raise ValueError(f"episode {arrival.key} is already in the stream")
        row, self.numbered = self.numbered, self.numbered + 1
        self.keys[row], self.rows[arrival.key] = arrival.key, row
        self.episodes[row], self.prompts[row] = arrival.episode, arrival.prompt
        self.templated[row], self.uniforms[row] = arrival.templated, arrival.uniforms
        self.group[row], self.source[row] = arrival.group, arrival.source
        self.waiting.append(row)

    def start(self, rows: Sequence[int]) -> None:
        """Start ``rows``: each joins the batch with its prompt and opening (an episode
        its opening already ended is done at once)."""
        for row in rows:
            self.started_in[row] = self.tasks
            self.started_on[row] = self.version
            if not self.episodes[row].done:
                self.parked[row] = None
                self.ready[row] = len(self.timeline.steps)

    def admit(self) -> None:
        """Start waiting episodes while fewer than ``target`` are in flight (with
        ``held``: started and not taken, finished ones too: finish order)."""
        room = self.room()
        while self.waiting and (len(self.started_in) if self.held else self.live()) < room:
            self.start([self.waiting.popleft()])
            self.stats.started_ahead += 1

    def room(self) -> int:
        """How many episodes the stream may hold. Finish order: an episode started now
        is owed by the tasks ``staleness`` versions on; the tasks until then (of this
        version, less what they took already, and of the next ``staleness``) take
        ``staleness + 1`` times an iteration's rows on this worker, and the stream holds
        no more than they can take (nor more than ``target`` per task). And of the
        episodes started on this version it holds no more than the one task
        ``staleness`` versions on can take: an iteration's rows, and those this version's
        tasks have yet to take beyond the older episodes (they can take nothing else);
        the tasks between may take later episodes that finished first. (Without it the
        first task started every iteration it may run ahead on the first weights, and a
        later task owed more than its rows.)"""
        if not self.held:
            return self.target
        rows = max(self.asked.values(), default=0)
        tasks = rows / self.per_task if self.per_task else 1
        took = sum(1 for _, version in self.taken.values() if version == self.version)
        now = sum(1 for version in self.started_on.values() if version == self.version)
        older = len(self.started_in) - now
        on_this_version = rows + max(0, rows - took - older)
        return min(int(self.target * tasks), (self.staleness + 1) * rows - took,
                   len(self.started_in) + on_this_version - now)

    def live(self) -> int:
        """Episodes started and not done: decoding, in the environment, or waiting to
        rejoin."""
        return len(self.batch.rows) + len(self.in_flight) + len(self.ready)

    def drop(self, row: int) -> None:
        """Forget an episode wherever it is (its environment step, if one is running,
        finishes unheard)."""
        if row in self.batch.rows:
            self.batch.park([self.batch.rows.index(row)], keep_cache=False)
        for future in [f for f, r in self.in_flight.items() if r == row]:
            del self.in_flight[future]
        if row in self.waiting:
            self.waiting.remove(row)
        self.stats.dropped += 1
        self.forget(row)

    def forget(self, row: int) -> None:
        key = self.keys.pop(row)
        del self.rows[key], self.episodes[row], self.prompts[row], self.templated[row]
        del self.uniforms[row]
        for state in (self.ready, self.parked, self.turn, self.last, self.started_in,
                      self.started_on, self.turn_versions, self.group, self.source,
                      self.finished):
            state.pop(row, None)
        self.midturn.discard(row)

    # ----------------------------------------------------------------- weights
    def reweigh(self, version: int) -> None:
        """New weights: every episode in flight rebuilds its cache under them when it next
        joins (those decoding leave the batch in the middle of their turn); with
        ``recompute`` off the caches of the old weights are kept (cheaper: no prefill of
        what is in flight, but the next tokens attend to the old weights' keys and
        values)."""
        if not self.recompute:
            self.version = version
            return
        decoding = list(self.batch.rows)
        if decoding:
            self.batch.park(list(range(len(decoding))), keep_cache=False)
        for row in decoding:
            self.midturn.add(row)
            self.ready[row] = 0
            done = self.turn_versions.setdefault(row, [])
            done += [self.version] * (len(self.turn[row][0]) - len(done))
        for row in [*self.parked, *decoding]:
            self.parked[row] = None
        log.debug("episode stream: weights %d -> %d, %d episodes recompute", self.version,
                  version, len(self.parked))
        self.version = version

    # ----------------------------------------------------------------- the loop's hooks
    def draws(self, rows: list[int], drawn: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.uniforms[row][d] for row, d in zip(rows, drawn.tolist(),
                                                                   strict=True)])

    def versions_of(self, row: int, n: int) -> int | list[int]:
        before = self.turn_versions.pop(row, [])
        return before + [self.version] * (n - len(before)) if before else self.version

    def begin(self, rows: list[int]) -> None:
        # a row parked in the middle of its turn goes on with it
        super().begin([row for row in rows if row not in self.midturn])
        self.midturn.difference_update(rows)

    def block(self, row: int, cache) -> list[int]:
        if row in self.midturn:  # the turn so far, its last token not fed yet
            sequence = self.prompts[row] + self.episodes[row].tokens + self.turn[row][0]
            return sequence[cache.length if cache is not None else 0:]
        return super().block(row, cache)

    def step(self) -> None:
        self.stats.steps += 1
        self.stats.decoding += len(self.batch.rows)
        self.stats.live += self.live()
        super().step()


def stream_columns(episodes: list[Episode], early: list[bool], stats: TaskStats,
                   version: int, width: int) -> Batch:
    """The columns a streamed task adds (``rlhfflow.stages.rollout.STREAM_COLUMNS``) for
    its finished ``episodes`` (``early``: started by an earlier task), from the task's
    ``stats`` on weights ``version``; a row's ``policy_version`` is then its oldest
    token's (what staleness is counted from)."""
    rows = len(episodes)
    versions = torch.full((rows, width), -1, dtype=torch.long)
    for row, episode in enumerate(episodes):
        versions[row, :len(episode.versions)] = torch.tensor(episode.versions,
                                                             dtype=torch.long)
    sampled = versions >= 0
    lag = torch.where(sampled, version - versions, 0).float()
    oldest = torch.where(sampled, versions, version).amin(-1) if width else \
        torch.full((rows,), version)
    newest = torch.where(sampled, versions, -1).amax(-1) if width else oldest
    dropped = torch.zeros(rows, dtype=torch.long)
    if rows:
        dropped[0] = stats.dropped
    return {"token_versions": versions, "token_lag": lag,
            "version_spread": torch.where(newest >= 0, newest - oldest, 0),
            "policy_version": oldest,
            "started_ahead": torch.tensor(early, dtype=torch.int8),
            "decode_occupancy": torch.full((rows,), stats.occupancy),
            "episodes_in_flight": torch.full((rows,), stats.in_flight),
            "episodes_dropped": dropped}


def whole_groups(batch: Batch, stage: str) -> None:
    """Finish order takes a prompt's samples together: every group of a task's rows
    whole, all of one size."""
    sizes = set(torch.unique(batch["group_ids"], return_counts=True)[1].tolist())
    if len(sizes) > 1:
        raise RunError(f"stage {stage!r}: stream_order: finish takes a prompt's samples "
                       f"together, and this task's rows split a prompt's samples (groups of "
                       f"{sorted(sizes)} rows): give the stage micro-batches whose rows are "
                       f"a multiple of data.samples_per_prompt")


def finish_columns(sources: list[dict[str, Any]], iteration: int, stats: TaskStats,
                   pad_id: int) -> Batch:
    """The source columns of the rows a task returned in finish order (each row's own
    prompt, left-padded to the longest), and ``FINISH_COLUMNS``."""
    ids, mask = pad_prompts([s["prompt"] for s in sources], pad_id) if sources else \
        (torch.empty(0, 0, dtype=torch.long), torch.empty(0, 0, dtype=torch.int8))
    rows = len(sources)
    labels = torch.tensor([s["source_iteration"] for s in sources], dtype=torch.long)
    waits = [torch.zeros(rows) for _ in range(2)]
    if rows:
        waits[0][0], waits[1][0] = stats.owed_s, stats.short_s
    return {"prompt_ids": ids, "prompt_mask": mask,
            "prompt_index": torch.tensor([s["key"][1] for s in sources], dtype=torch.long),
            "sample_index": torch.tensor([s["key"][2] for s in sources], dtype=torch.long),
            "group_ids": torch.tensor([s["group_ids"] for s in sources], dtype=torch.long),
            "prompt_text": [s["prompt_text"] for s in sources],
            "prompt_fields": [s["prompt_fields"] for s in sources],
            "source_iteration": labels, "deferred": (labels < iteration).to(torch.int8),
            "stream_wait_owed_s": waits[0], "stream_wait_groups_s": waits[1]}
