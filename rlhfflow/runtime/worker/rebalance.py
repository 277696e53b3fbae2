"""Sample reallocation between the workers of a generating stage (RLHFSpec; issue 12).

When one iteration's ``generate`` runs as several tasks on several workers, the worker
whose rows run longest decides when the stage ends while the others idle. Here rows
still decoding move to an idle worker mid-way:

* **Who is idle.** With ``RunSettings.rows_topic`` set (the executor sets it when a
  generating stage with ``params.migrate`` has two or more workers), every worker
  announces on that event topic (``Worker.log_event``, through the scheduler) when it
  starts a task after having been idle (``busy``) and when it ends a task with nothing
  else ready or running (``idle``, with the versions of its models). A worker that runs
  a generate task subscribes once per run (``Client.subscribe_topic``, replaying the
  earlier events with ``get_events``), so reading the board between two decode steps
  is a dict lookup in the task's thread, never a round trip.
* **Handing rows over.** ``RowExchange`` is the ``StageContext.peers`` hook a generate
  task gets. ``speculative.decode`` asks it for a peer between steps (it answers only
  when the predicted saving, the remaining steps times what the moved rows add to a
  step as measured in this call, beats ``params.migrate_min_s``, the handover's round
  trips); half the active rows then travel as a ``Continuation`` (cache slices
  included) in a ``moved-STAGE-K`` task pinned to that worker, and the results are
  gathered at the end, the task seceded from its worker's thread pool meanwhile (two
  workers handing rows to each other cannot deadlock on a thread each).
* **Nothing changes.** A continuation is decoded with the rows' own per-row streams and
  cache, so every token and log-prob equals what the handing task would have computed
  (tested against the inline run). A receiver whose model version moved on (new weights
  installed meanwhile) refuses, and the handing task decodes those rows itself.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

from rlhfflow.engine.speculative import Continuation

#: Under ``placement: auto`` reallocation is on only where the cost model predicts a
#: generate task of at least this many seconds: on shorter ones (the tiny demos) the
#: announcements every task makes cost more (measured ~8% of grpo-tiny's iteration)
#: than a handover of ~0.1 s could save.
MIN_TASK_S = 1.0


class Board:
    """What this process knows of the workers' idleness: address -> ``(timestamp,
    idle, versions)``, the latest announcement of each (events may be replayed late)."""

    def __init__(self) -> None:
        self.status: dict[str, tuple[float, bool, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def update(self, event: tuple[float, dict[str, Any]]) -> None:
        """A subscription handler: ``event`` is ``(scheduler time, message)``."""
        stamp, msg = event
        with self._lock:
            old = self.status.get(msg["worker"])
            if old is None or stamp >= old[0]:
                self.status[msg["worker"]] = (stamp, bool(msg["idle"]),
                                              dict(msg.get("versions") or {}))

    def idle(self, model: str, version: int, exclude: str) -> list[tuple[str, float]]:
        """``(address, stamp)`` of the idle workers holding ``model`` at ``version``."""
        with self._lock:
            return sorted((address, stamp) for address, (stamp, idle, versions)
                          in self.status.items()
                          if idle and address != exclude and versions.get(model) == version)


_BOARDS: dict[str, Board] = {}
_BOARDS_LOCK = threading.Lock()
_IDLE_SAID: dict[str, bool] = {}  # topic -> this worker last announced itself idle


def board(client, topic: str) -> Board:
    """This process's board of ``topic``, subscribed on first use."""
    with _BOARDS_LOCK:
        found = _BOARDS.get(topic)
        if found is None:
            found = _BOARDS[topic] = Board()
            client.subscribe_topic(topic, found.update)
            for event in client.get_events(topic):  # what was said before we listened
                found.update(event)
        return found


def announce(topic: str, idle: bool, versions: dict[str, int]) -> None:
    """Tell the run's workers that this one is idle (or busy again). Non-blocking."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not on a Dask worker: nobody to tell
        return
    if not idle and not _IDLE_SAID.get(topic, False):
        return  # "busy" only after an "idle"
    _IDLE_SAID[topic] = idle
    worker.log_event(topic, {"worker": worker.address, "idle": idle,
                             "versions": versions})


def nothing_else_to_do() -> bool:
    """Whether this worker has no task ready and none executing but the caller's."""
    from distributed import get_worker

    try:
        state = get_worker().state
        return not state.ready and state.executing_count <= 1
    except (ValueError, AttributeError):
        return False


class RowExchange:
    """The ``StageContext.peers`` of one generate task on a Dask worker."""

    def __init__(self, topic: str, stage: str, iteration: int, model: str, version: int,
                 overhead_s: float, continue_task: Callable[..., Any],
                 priority: int = 1_000_000) -> None:
        from distributed import get_client, get_worker

        self.continue_task = continue_task
        self.topic, self.stage, self.iteration = topic, stage, iteration
        self.model, self.version, self.priority = model, version, priority
        self.overhead_s = overhead_s
        self.address = get_worker().address
        self.client = get_client()
        self.board = board(self.client, topic)
        self.sent: dict[str, float] = {}  # peer -> the idle announcement it got rows for

    def peer(self, rows: int, saving_s: float) -> str | None:
        """An idle worker worth handing half of ``rows`` to, or None: only when the
        handover is predicted to save (``saving_s``) more than it costs (an overhead of
        0: whenever a worker is idle)."""
        if rows < 2 or (self.overhead_s > 0 and saving_s <= self.overhead_s):
            return None
        for address, stamp in self.board.idle(self.model, self.version, self.address):
            if self.sent.get(address) != stamp:  # one handover per idle announcement
                self.sent[address] = stamp
                return address
        return None

    def send(self, peer: str, cont: Continuation) -> Any:
        """Start finishing ``cont`` on ``peer``; the handle (a future) for ``gather``."""
        [data] = self.client.scatter([cont], workers=[peer], direct=True, hash=False)
        future = self.client.submit(
            self.continue_task, self.stage, self.iteration, self.model, self.version, data,
            key=f"moved-{self.stage}-{self.iteration}-{uuid.uuid4().hex[:8]}",
            workers=[peer], allow_other_workers=False, pure=False, retries=0,
            priority=self.priority + 1)
        return future

    def gather(self, handles: list[Any]) -> list[Any]:
        """The continuations' results in order (None where the peer refused): waits
        seceded from the worker's thread pool, so its other tasks may run meanwhile."""
        from distributed import rejoin, secede

        secede()
        try:
            return self.client.gather(list(handles))
        finally:
            rejoin()


def exchange_for(host, names: tuple[str, ...], iteration: int,
                 continue_task: Callable[..., Any], priority: int = 1_000_000
                 ) -> RowExchange | None:
    """The hook for a task running ``names`` (fused stages), or None: only the first
    stage of a task may hand rows over, when it generates and the run has a topic.
    ``continue_task`` is the worker's task that finishes handed-over rows on a peer."""
    topic = host.run.settings.rows_topic
    if not topic:
        return None
    stage = host.stage(names[0])
    if not stage.generates or not getattr(stage.params, "migrate", False):
        return None
    try:
        version = host.store.get(stage.model).version
        return RowExchange(topic, names[0], iteration, stage.model, version,
                           stage.params.migrate_min_s, continue_task, priority)
    except ValueError:  # not inside a Dask worker
        return None
