"""What a stop request cancels, on compiled task specs (no Dask): the iterations submitted
ahead of the one in flight, unless a model's update of theirs started."""

from __future__ import annotations

from rlhfflow.config.loader import load_pipeline
from rlhfflow.plan.auto.planner import resolve_plan
from rlhfflow.plan.compiler import compile_run
from rlhfflow.plan.tasks import InstallTask, StageTask
from rlhfflow.runtime.stopping import plan_stop
from tests.conftest import CONFIGS

PPO = CONFIGS / "ppo-tiny.yaml"


def _submitted(overrides: dict, iterations: int = 4):
    """The specs of a run (those of iteration 1, in flight, and of the iterations after
    it) and the rule that says whether a task updates a model."""
    pipeline = load_pipeline(PPO, overrides)
    plan = resolve_plan(pipeline, 2, {m: 1000 for m in pipeline.spec.models})
    specs, _ = compile_run(pipeline, plan, {m: 0 for m in pipeline.spec.models}, iterations)
    tasks = {s.id: s for s in specs if s.iteration >= 1}
    graph = pipeline.graph

    def trains(task) -> bool:
        return any(graph.nodes[n].trains for n in getattr(task, "stages", ()))

    return tasks, trains


def _stage(tasks, name: str, k: int) -> list[str]:
    return [i for i, t in tasks.items()
            if t.iteration == k and isinstance(t, StageTask) and name in t.stages]


def test_a_stop_cancels_the_iterations_submitted_ahead_while_no_update_of_theirs_started():
    tasks, trains = _submitted({"placement.strategy": "disaggregated",
                                "overlap.max_staleness": 1})
    # iteration 1 in flight; 2 submitted whole, 3 its generation (ahead); 2's generation
    # ran ahead already, 3's is running
    states = {i: "waiting" for i, t in tasks.items() if t.iteration >= 2}
    states.update(dict.fromkeys(_stage(tasks, "generate", 2), "memory"))
    states.update(dict.fromkeys(_stage(tasks, "generate", 3), "processing"))
    stop = plan_stop(1, [2], tasks, states, trains)
    assert stop.finish == ()
    # all but iteration 2's generation (and its prompts), which iteration 1's training
    # waits for: it read the weights before that update (Dask would cancel the training
    # with it)
    kept = {i for i, t in tasks.items() if t.iteration >= 2} - set(stop.cancel)
    assert kept == set(_stage(tasks, "generate", 2)) | {
        i for i, t in tasks.items() if t.iteration == 2 and t.kind == "source"}
    assert set(stop.running) == set(_stage(tasks, "generate", 3))


def test_an_iteration_whose_update_started_is_finished_with_what_it_waits_for():
    tasks, trains = _submitted({"placement.strategy": "disaggregated",
                                "overlap.max_staleness": 1})
    states = {i: "waiting" for i, t in tasks.items() if t.iteration >= 2}
    [train] = _stage(tasks, "train_actor", 2)
    states[train] = "processing"
    stop = plan_stop(1, [2], tasks, states, trains)
    assert stop.finish == (2,)
    assert not [i for i in stop.cancel if tasks[i].iteration == 2]
    # iteration 2's training waits for iteration 3's generation (it reads the weights
    # before the update): cancelling that would cancel the training with it
    assert _stage(tasks, "generate", 3) and not set(_stage(tasks, "generate", 3)) & set(
        stop.cancel)
    # a weight install started binds its iteration as an update does
    states[train] = "waiting"
    installs = [i for i, t in tasks.items() if isinstance(t, InstallTask) and t.iteration == 2]
    assert installs
    states[installs[0]] = "memory"
    assert plan_stop(1, [2], tasks, states, trains).finish == (2,)


def test_a_gang_with_a_started_rank_is_never_cut_in_half():
    tasks, trains = _submitted({"placement.strategy": "colocated"})
    gang = _stage(tasks, "train_actor", 2)
    assert len(gang) == 2 and all(tasks[i].gang for i in gang)
    states = {i: "waiting" for i, t in tasks.items() if t.iteration >= 2}
    states[gang[0]] = "processing"
    # a started rank binds its iteration even where its stage updates nothing
    for rule in (trains, lambda task: False):
        stop = plan_stop(1, [2], tasks, states, rule)
        assert stop.finish == (2,) and not set(gang) & set(stop.cancel)


def test_an_update_the_workers_report_begun_is_finished_though_the_scheduler_shows_it_waiting():
    """The scheduler's state lags: a trainer it still shows as waiting may have begun its
    update on the worker. The workers' report (``UpdateGate.hold``) decides."""
    tasks, trains = _submitted({})
    plain = plan_stop(1, {2}, tasks, {}, trains)
    assert plain.finish == () and _stage(tasks, "train_actor", 2)[0] in plain.cancel
    reported = plan_stop(1, {2}, tasks, {}, trains, begun={2})
    assert reported.finish == (2,)
    assert not set(_stage(tasks, "train_actor", 2)) & set(reported.cancel)


def test_the_update_gate_holds_updates_after_the_iteration_in_flight_then_lets_through_or_refuses():
    import threading

    import pytest

    from rlhfflow.runtime.worker.host import UpdateGate, UpdateRefused

    gate = UpdateGate()
    gate.enter(3)  # no stop: nothing waits
    assert gate.hold(2) == [3]  # iteration 3's update began before the stop
    gate.enter(2)  # the iteration in flight goes on
    outcomes: dict[int, str] = {}

    def update(k: int) -> None:
        try:
            gate.enter(k)
            outcomes[k] = "made"
        except UpdateRefused:
            outcomes[k] = "refused"

    waiting = [threading.Thread(target=update, args=(k,)) for k in (3, 4)]
    for t in waiting:
        t.start()
    for t in waiting:
        t.join(0.2)
    assert outcomes == {} and all(t.is_alive() for t in waiting)  # held, not decided
    gate.settle(3)  # the stop finishes iteration 3 (its update had begun)
    for t in waiting:
        t.join(5)
    assert outcomes == {3: "made", 4: "refused"}
    with pytest.raises(UpdateRefused, match="stopped after iteration 3"):
        gate.enter(5)
