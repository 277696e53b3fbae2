"""The coordinator's decisions, fed sequences of outcomes: no Dask, no worker, no file
(the tasks are compiled specs, the stop planned by ``stopping.plan_stop``)."""

from __future__ import annotations

from rlhfflow.config.loader import load_pipeline
from rlhfflow.plan.auto.planner import resolve_plan
from rlhfflow.plan.compiler import compile_run
from rlhfflow.plan.tasks import Task
from rlhfflow.runtime.coordinator import (
    Abandon,
    AnnounceStop,
    Commit,
    Coordinator,
    CutBack,
    Fail,
    IterationCommitted,
    IterationSubmitted,
    LoopDrained,
    LoopStarted,
    LostWorker,
    PlanStop,
    PublishCheckpoint,
    Recovering,
    Retry,
    SaveCheckpoint,
    Say,
    ScheduleEnded,
    StageFailed,
    StopPlanned,
    StopRequested,
)
from rlhfflow.runtime.stopping import plan_stop
from tests.conftest import CONFIGS

LOST = "worker tcp://127.0.0.1:4001 holding actor left the cluster"


def _compiled(iterations: int, **overrides) -> tuple[list[Task], object]:
    pipeline = load_pipeline(CONFIGS / "ppo-tiny.yaml", overrides)
    plan = resolve_plan(pipeline, 2, {m: 1000 for m in pipeline.spec.models})
    specs, _ = compile_run(pipeline, plan, {m: 0 for m in pipeline.spec.models}, iterations)
    return specs, pipeline


def _versions(k: int) -> dict[str, int]:
    return {"actor": k + 1, "critic": k + 1, "ref": 0}


def _submit(state: Coordinator, k: int, checkpoint: bool = False, staleness: int = 0) -> None:
    assert state.handle(IterationSubmitted(k, _versions(k), checkpoint, staleness)) == []


def test_iterations_committed_publish_the_checkpoints_compiled_every_n_then_the_last():
    specs, _ = _compiled(5, **{"checkpoint.every": 2})
    due = {s.iteration for s in specs if s.kind == "checkpoint"}
    assert due == {1, 3}
    state = Coordinator(max_restarts=0)
    assert state.handle(LoopStarted(0)) == []
    actions = []
    for k in range(5):
        _submit(state, k, checkpoint=k in due)
        actions += state.handle(IterationCommitted(k))
    assert actions == [PublishCheckpoint(1), PublishCheckpoint(3)]
    assert state.last == 4 and state.last_checkpoint == 3
    assert state.handle(ScheduleEnded()) == []
    # the last iteration is not one ``every`` saves: a checkpoint of it, at its versions
    assert state.handle(LoopDrained()) == [SaveCheckpoint(4, _versions(4))]
    assert state.last_checkpoint == 4
    assert state.handle(LoopDrained()) == []  # published: nothing more


def test_a_stop_while_iteration_5_is_in_flight_finishes_5_and_checkpoints_5():
    specs, pipeline = _compiled(8, **{"placement.strategy": "disaggregated",
                                      "overlap.max_staleness": 1, "checkpoint.every": 2})
    state = Coordinator(max_restarts=0)
    state.handle(LoopStarted(0))
    for k in range(5):
        _submit(state, k, checkpoint=k % 2 == 1, staleness=1)
        state.handle(IterationCommitted(k))
    _submit(state, 5, checkpoint=True, staleness=1)
    _submit(state, 6, staleness=1)  # submitted ahead of 5's finish
    [plan_action] = state.handle(StopRequested(5, waiting=True, submitted_after=True))
    assert plan_action == PlanStop(5, True, (6,))  # 5 is the one finished
    # the tasks the run holds: iteration 5 in flight, 6 and 7's ahead stages submitted;
    # none of them started
    tasks = {s.id: s for s in specs if s.iteration >= 5 and s.iteration <= 7}
    states = {i: "waiting" for i, t in tasks.items() if t.iteration > 5}
    graph = pipeline.graph
    stop = plan_stop(5, plan_action.unfinished, tasks, states,
                     lambda task: any(graph.nodes[n].trains for n in getattr(task, "stages", ())))
    actions = state.handle(StopPlanned(5, True, stop, tasks))
    assert actions == [Abandon((6, 7)), AnnounceStop(5, True, stop, (6, 7), tasks)]
    # the tick asks again while 5 is still in flight: decided already, said already
    assert state.handle(StopRequested(5, waiting=True, submitted_after=True)) == []
    assert state.handle(IterationCommitted(5)) == [PublishCheckpoint(5)]
    assert state.handle(ScheduleEnded()) == []  # 6 was given up: nothing to finish
    assert state.handle(LoopDrained()) == []  # 5's checkpoint is the last


def test_a_stop_whose_next_update_began_finishes_that_iteration_too():
    state = Coordinator(max_restarts=0)
    state.handle(LoopStarted(3))
    _submit(state, 3)
    _submit(state, 4)
    state.handle(IterationCommitted(3))
    # at the next iteration's start, with 4 submitted whole, the stop cancels nothing of
    # it: its update had begun
    assert state.handle(StopRequested(3, waiting=False, submitted_after=False)) == [
        Say("rlhfflow: stopping after iteration 3, then saving a checkpoint")]
    assert state.handle(StopRequested(3, waiting=False, submitted_after=False)) == []
    assert state.handle(ScheduleEnded()) == [Commit(4)]
    assert state.handle(IterationCommitted(4)) == []
    # the checkpoint of 4 must hold 4's weights: its versions are expected
    assert state.handle(LoopDrained()) == [SaveCheckpoint(4, _versions(4))]


def test_a_worker_lost_twice_past_max_restarts_fails_in_one_line():
    state = Coordinator(max_restarts=1)
    assert state.handle(LostWorker(LOST)) == [Retry(1)]
    [fail] = state.handle(LostWorker(LOST))
    assert fail == Fail(f"{LOST}; gave up after 1 restart(s); the run can be resumed from "
                        f"its last checkpoint")
    error = fail.error()
    assert str(error) == fail.message and error.__cause__ is None


def test_recovery_goes_back_to_the_last_whole_checkpoint_and_restarts_the_loop_there():
    state = Coordinator(max_restarts=3, last_checkpoint=5)
    state.handle(LoopStarted(0))
    for k in range(6):
        _submit(state, k, checkpoint=k % 2 == 1)
        state.handle(IterationCommitted(k))
    _submit(state, 6)
    assert state.handle(LostWorker(LOST)) == [Retry(1)]
    # checkpoint 5 was damaged: the store's last whole one is 3
    [cut] = state.handle(Recovering(3))
    assert cut == CutBack(3) and cut.next_iteration == 4 and cut.where == "after iteration 3"
    assert state.last_checkpoint == 3
    assert state.handle(LoopStarted(cut.next_iteration)) == []
    assert state.last == 3 and state.unfinished == {} and state.restarts == 1
    # none left: from the start
    [cut] = state.handle(Recovering(None))
    assert cut == CutBack(-1) and cut.next_iteration == 0 and cut.where == "from the start"


def test_an_exhausted_score_error_budget_fails_after_the_commit_without_a_checkpoint():
    state = Coordinator(max_restarts=0)
    state.handle(LoopStarted(0))
    _submit(state, 0, checkpoint=True)
    problem = "reward: 3 of 4 rows failed in iteration 0 (data.max_score_errors: 0.5)"
    assert state.handle(IterationCommitted(0, problem)) == [Fail(problem)]
    assert state.last == 0 and state.last_checkpoint == -1


def test_a_failed_stage_task_becomes_one_run_error_chained_to_its_cause():
    state = Coordinator(max_restarts=0)
    cause = ValueError("bad reward")
    [fail] = state.handle(StageFailed("reward+advantages", cause, 3, retries=2))
    assert fail == Fail("stage 'reward+advantages' failed in iteration 3 after 3 attempts: "
                        "ValueError: bad reward", cause)
    assert fail.error().__cause__ is cause
    oom = MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    [fail] = state.handle(StageFailed("train_actor", oom, None, 0, ("tcp://w1",)))
    assert fail.cause is None and fail.message.startswith(
        "out of memory: stage 'train_actor' on worker tcp://w1 (setup) could not allocate")


def test_only_the_versions_of_iterations_still_in_reach_are_kept():
    state = Coordinator(max_restarts=0)
    state.handle(LoopStarted(0))
    for k in range(6):
        _submit(state, k, staleness=1)
    assert sorted(state.versions_after) == [3, 4, 5]
