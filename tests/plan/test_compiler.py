"""The dependency rules of a run, tested on compiled task specs (no Dask, milliseconds):
what each task waits for under streaming, fusion, gangs, shadows, staleness and
checkpoints, and that every plan compiles to a well-formed task graph."""

from __future__ import annotations

import itertools

import pytest

from rlhfflow.config.loader import load_pipeline
from rlhfflow.plan.auto.planner import resolve_plan
from rlhfflow.plan.compiler import (
    CHECKPOINT,
    INSTALL,
    SOURCE_KIND,
    STAGE,
    STORE,
    TaskCompiler,
    by_id,
    compile_run,
    loop_steps,
)
from rlhfflow.plan.explain import ExplainError, explain
from rlhfflow.plan.tasks import (
    AHEAD_RELEASE,
    CHECKPOINT_LEVEL,
    RULES,
    STORE_LEVEL,
    TRANSFER_LEVEL,
    CheckpointTask,
    StageTask,
    Storage,
    StoreTask,
    priority,
)
from tests.conftest import CONFIGS

PPO = CONFIGS / "ppo-tiny.yaml"
GRPO = CONFIGS / "grpo-tiny.yaml"


def _compile(config=PPO, overrides=None, workers=2, iterations=3):
    pipeline = load_pipeline(config, overrides or {})
    plan = resolve_plan(pipeline, workers, {m: 1000 for m in pipeline.spec.models})
    versions = {m: 0 for m in pipeline.spec.models}
    specs, _ = compile_run(pipeline, plan, versions, iterations)
    return specs, plan


def _tasks(specs, stage, k):
    """The tasks of iteration ``k`` that run ``stage``."""
    return [s for s in specs if s.iteration == k and isinstance(s, StageTask) and stage in s.stages]


def _closure(specs):
    """Per task id, every id it transitively waits for."""
    ids = by_id(specs)
    memo: dict[str, set[str]] = {}

    def up(i):
        if i not in memo:
            memo[i] = set()
            for r in ids[i].needs():
                memo[i] |= {r} | up(r)
        return memo[i]

    return {i: up(i) for i in ids}


def _waits_for(closure, task, others) -> bool:
    """Whether ``task`` runs after each of ``others``: it waits for it, or runs it
    itself earlier in its fused group (``advantages + train_actor``)."""
    return all(o.id in closure[task.id] or o.id == task.id for o in others)


STRATEGIES = [
    {"placement.strategy": s} for s in ("colocated", "interleaved", "disaggregated")
] + [
    {"placement.strategy": "disaggregated", "overlap.max_staleness": 1},
    {"placement.strategy": "disaggregated", "overlap.max_staleness": 2},
    {"placement.strategy": "colocated", "overlap.max_staleness": 1},
    {"overlap.sequential": True},
    {"overlap.fuse": False, "stages.reward.micro_batches": 4},
]


@pytest.mark.parametrize("config", [PPO, GRPO])
@pytest.mark.parametrize("overrides", STRATEGIES)
def test_every_plan_compiles_to_a_task_graph_in_submission_order(config, overrides):
    specs, _ = _compile(config, overrides)
    seen: set[str] = set()
    for s in specs:
        missing = [r for r in s.needs() if r not in seen]
        assert not missing, f"{s.id} refers to {missing} before they are compiled"
        seen.add(s.id)
    by_id(specs)  # ids are unique
    for k in range(3):  # every loop stage of every iteration has tasks
        assert {n for s in specs if s.iteration == k for n in s.label.split("+")} >= {
            "generate", "reward", "advantages", "train_actor", "store"}


def test_the_trainer_waits_for_every_other_user_of_its_model_and_the_next_rollout_for_it():
    # interleaved: the critic's values are not fused into the actor's rollout tasks
    specs, _ = _compile(PPO, {"placement.strategy": "interleaved"})
    closure = _closure(specs)
    for k in range(3):
        for train in _tasks(specs, "train_actor", k):
            assert _waits_for(closure, train, _tasks(specs, "generate", k))
            assert _waits_for(closure, train, _tasks(specs, "old_logprob", k))
            assert _waits_for(closure, train, _tasks(specs, "advantages", k))
        if k:
            for gen in _tasks(specs, "generate", k):
                assert _waits_for(closure, gen, _tasks(specs, "train_actor", k - 1))
                # ...but not for the critic's update, which it does not use
                assert not any(t.id in closure[gen.id]
                               for t in _tasks(specs, "train_critic", k - 1))


BEST_OF_N = CONFIGS / "best-of-n-tiny.yaml"


@pytest.mark.parametrize("overrides", STRATEGIES[:4])
def test_a_user_of_the_model_declared_after_its_trainer_is_compiled_first(overrides):
    """best-of-n-tiny declares its evaluate stage (a user of the actor, with no `after`)
    after train_sft: the trainer must still wait for it, so it is compiled before."""
    overrides = {k: v for k, v in overrides.items() if not k.startswith("stages.")}
    specs, _ = _compile(BEST_OF_N, overrides)
    closure = _closure(specs)
    seen: set[str] = set()
    for s in specs:
        assert all(r in seen for r in s.needs()), s.id
        seen.add(s.id)
    for k in range(3):
        for train in _tasks(specs, "train_sft", k):
            assert _waits_for(closure, train, _tasks(specs, "evaluate", k))
        if k:
            for evaluate in _tasks(specs, "evaluate", k):
                assert _waits_for(closure, evaluate, _tasks(specs, "train_sft", k - 1))


def test_a_micro_batch_streams_on_as_soon_as_its_own_rows_exist():
    specs, _ = _compile(PPO, {"placement.strategy": "interleaved", "overlap.fuse": False})
    gen = _tasks(specs, "generate", 0)
    reward = _tasks(specs, "reward", 0)
    assert len(gen) == len(reward) == 2
    for j in range(2):
        assert reward[j].rows == gen[j].rows
        assert set(reward[j].needs()) & {g.id for g in gen} == {gen[j].id}


def test_other_micro_batches_take_the_rows_they_need_across_producers():
    specs, _ = _compile(PPO, {"overlap.fuse": False, "stages.values.micro_batches": 4})
    gen = _tasks(specs, "generate", 0)  # 2 micro-batches of 16 rows
    values = _tasks(specs, "values", 0)  # 4 of 8
    assert [v.rows for v in values] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert values[1].parts[0].refs == (gen[0].id,) and values[1].parts[0].rows == (8, 16)
    assert values[2].parts[0].refs == (gen[1].id,) and values[2].parts[0].rows == (0, 8)


def test_stages_on_the_same_workers_run_as_one_task_per_micro_batch():
    specs, plan = _compile(PPO, {"placement.strategy": "colocated"})
    fused = _tasks(specs, "reward", 0)
    assert [t.stages for t in fused] == [plan.group("reward")] * 2
    assert fused[0].stages == ("generate", "reward", "ref_logprob", "old_logprob", "values")
    assert fused[0].id == "generate+reward+ref_logprob+old_logprob+values-0-0"


def test_colocated_training_runs_as_gangs_that_take_turns_on_the_same_workers():
    specs, _ = _compile(PPO, {"placement.strategy": "colocated"})
    actor = _tasks(specs, "train_actor", 0)
    critic = _tasks(specs, "train_critic", 0)
    assert [(t.rank, t.workers, t.gang) for t in actor] == [(0, (0,), (0, 1)), (1, (1,), (0, 1))]
    assert all(t.retries == 0 for t in actor + critic)
    # the critic's gang follows the actor's, so the two never hold each other's workers
    for t in critic:
        assert {a.id for a in actor} <= set(t.wait_ids())


def test_disaggregated_syncs_the_new_weights_to_the_rollout_shadow():
    specs, plan = _compile(PPO, {"placement.strategy": "disaggregated"})
    closure = _closure(specs)
    installs = [s for s in specs if s.kind == INSTALL and s.iteration == 0]
    assert [(s.model, s.workers, s.version) for s in installs] == [("actor", (0,), 1)]
    gen1 = _tasks(specs, "generate", 1)
    assert all(installs[0].id in closure[g.id] for g in gen1)
    assert all(g.versions == {"actor": 1} for g in gen1)
    assert all(g.workers == plan.groups["rollout"] for g in gen1)


def test_with_staleness_the_rollout_runs_ahead_and_only_the_install_waits_for_it():
    specs, _ = _compile(PPO, {"placement.strategy": "disaggregated",
                              "overlap.max_staleness": 1}, iterations=4)
    closure = _closure(specs)
    position = {s.id: i for i, s in enumerate(specs)}
    train0 = _tasks(specs, "train_actor", 0)
    gen1 = _tasks(specs, "generate", 1)
    # iteration 1's rollout is compiled before iteration 0's update...
    assert max(position[g.id] for g in gen1) < min(position[t.id] for t in train0)
    # ...runs on the weights from before it (version 0), and the update does not wait
    assert all(g.versions == {"actor": 0} for g in gen1)
    assert not any(g.id in closure[t.id] for t in train0 for g in gen1)
    # the install of update 0 on the shadow waits for the rollout still using it
    install0 = next(s for s in specs if s.kind == INSTALL and s.iteration == 0)
    assert all(g.id in closure[install0.id] for g in gen1)
    # and iteration 2's rollout uses update 0's weights: one update old
    assert all(g.versions == {"actor": 1} for g in _tasks(specs, "generate", 2))
    assert all(install0.id in closure[g.id] for g in _tasks(specs, "generate", 2))


@pytest.mark.parametrize("strategy", ["interleaved", "colocated"])
def test_with_staleness_at_home_the_update_waits_for_the_rollout_ahead_of_it(strategy):
    # a rollout that runs ahead on the trained copy itself (no shadow) uses the weights
    # the next update overwrites: that update waits for it. generate is upstream of
    # train_actor within an iteration, never across: once, the edge was left out and
    # the worker ran them in either order (StaleWeights, found by a one-step off-policy
    # run whose finished waits were dropped)
    specs, plan = _compile(PPO, {"placement.strategy": strategy,
                                 "overlap.max_staleness": 1}, iterations=4)
    assert set(plan.stages["generate"].workers) & set(plan.homes["actor"])
    for k in range(3):
        ahead = _tasks(specs, "generate", k + 1)
        for train in _tasks(specs, "train_actor", k):  # colocated: one per gang rank
            waited = {w.task: w.rule for w in train.waits}
            assert all(waited.get(g.id) is AHEAD_RELEASE for g in ahead), (k, waited)
        assert all(g.versions == {"actor": k} for g in ahead)


def test_stores_take_every_written_column_of_their_rows():
    specs, _ = _compile(PPO, {"placement.strategy": "interleaved"})
    closure = _closure(specs)
    stores = [s for s in specs if s.kind == STORE and s.iteration == 0]
    assert [s.rows for s in stores] == [(0, 16), (16, 32)]
    for store in stores:
        for stage in ("generate", "reward", "advantages", "values"):
            assert any(t.id in closure[store.id] for t in _tasks(specs, stage, 0))


def test_a_checkpoint_saves_after_the_update_and_the_next_update_waits_for_it():
    specs, _ = _compile(PPO, {"checkpoint.every": 2}, iterations=4)
    closure = _closure(specs)
    saves = [s for s in specs if s.kind == CHECKPOINT]
    assert sorted({s.iteration for s in saves}) == [1, 3]
    assert {s.model for s in saves} == {"actor", "critic"}
    save1 = next(s for s in saves if s.iteration == 1 and s.model == "actor")
    assert all(t.id in closure[save1.id] for t in _tasks(specs, "train_actor", 1))
    assert all(save1.id in closure[t.id] for t in _tasks(specs, "train_actor", 2))


def test_older_iterations_and_longer_paths_go_first():
    specs, _ = _compile(PPO, {"placement.strategy": "colocated"})
    gen = {k: _tasks(specs, "generate", k)[0].priority for k in range(3)}
    assert gen[0] > gen[1] > gen[2]
    assert _tasks(specs, "train_actor", 0)[0].priority > \
        _tasks(specs, "train_critic", 0)[0].priority


def test_sequential_puts_each_stage_after_the_whole_previous_one():
    specs, _ = _compile(PPO, {"overlap.sequential": True})
    closure = _closure(specs)
    gen1 = _tasks(specs, "generate", 1)
    everything0 = [s for s in specs if s.iteration == 0 and s.kind in (STAGE, STORE)]
    assert all(_waits_for(closure, g, everything0) for g in gen1)


def test_the_loop_compiles_the_next_iteration_before_finishing_this_one():
    steps = [(s.kind, s.iteration) for s in loop_steps(0, 3, lag=0) if s.kind != "start"]
    assert steps == [("ahead", 0), ("main", 0), ("ahead", 1), ("main", 1), ("finish", 0),
                     ("ahead", 2), ("main", 2), ("finish", 1), ("finish", 2)]
    lagged = [(s.kind, s.iteration) for s in loop_steps(0, 3, lag=1) if s.kind != "start"]
    assert lagged[:4] == [("ahead", 0), ("ahead", 1), ("main", 0), ("ahead", 2)]
    inline = [(s.kind, s.iteration) for s in loop_steps(0, 2, lag=0, pipelined=False)
              if s.kind != "start"]
    assert inline == [("ahead", 0), ("main", 0), ("finish", 0), ("ahead", 1), ("main", 1),
                      ("finish", 1)]


def _without_evaluate(tmp_path):
    """best-of-n-tiny without its evaluate stage (the plan the review found)."""
    import yaml

    data = yaml.safe_load((CONFIGS / "best-of-n-tiny.yaml").read_text())
    del data["stages"]["evaluate"]
    data["data"]["prompts"] = str(CONFIGS / data["data"]["prompts"])
    path = tmp_path / "best-of-n-no-eval.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _every_row_is_stored_once(specs, plan, graph, case) -> None:
    """Each source micro-batch's rows are written once per iteration: by a store task,
    or by the one stage task that wrote all of them (its group holds every stage that
    writes columns), which is no gang and runs in its iteration's main turn."""
    writers = {n for n in graph.loop_stages if graph.nodes[n].writes}
    for k in {s.iteration for s in specs if s.iteration >= 0}:
        stored = sorted(s.rows for s in specs if s.iteration == k
                        and (isinstance(s, StoreTask) or isinstance(s, StageTask) and s.stores))
        sources = sorted(s.rows for s in specs if s.iteration == k and s.kind == SOURCE_KIND)
        assert stored == sources, (case, k, stored, sources)
        for s in specs:
            if s.iteration == k and isinstance(s, StageTask) and s.stores:
                assert s.kind == STAGE and writers <= set(s.stages), (case, s.id)
                assert not s.gang and all(plan.stages[n].lag == 0 for n in s.stages), case


def test_the_whole_iterations_task_stores_its_rows_and_returns_no_columns():
    """grpo-tiny on one worker, one micro-batch: the iteration is one task, which writes
    the buffer itself (no store task) and returns only its statistics, since no other
    task reads its columns; with a stage outside it reading them, it keeps them."""
    one = {"placement.strategy": "colocated", "data.micro_batches": 1}
    specs, _ = _compile(GRPO, one, workers=1)
    assert not [s for s in specs if s.kind == STORE]
    whole = _tasks(specs, "generate", 0)
    assert len(whole) == 1 and whole[0].storage is Storage.STAGE_TASK_NO_COLUMNS
    assert whole[0].stages == ("generate", "reward", "ref_logprob", "advantages",
                               "train_actor")
    # the iteration's only task: its worker's timings come back with its result
    assert whole[0].reports
    specs, _ = _compile(GRPO, {**one, "stages.train_actor.fuse": False}, workers=1)
    first = _tasks(specs, "generate", 0)[0]
    assert first.storage is Storage.STAGE_TASK  # train_actor reads its columns
    assert not any(isinstance(s, StageTask) and s.reports for s in specs)  # two tasks: asked
    assert _tasks(specs, "train_actor", 0)[0].id != first.id


@pytest.mark.parametrize("name", ["ppo-tiny", "grpo-tiny", "remax-tiny", "online-dpo-tiny",
                                  "best-of-n"])
def test_every_fusion_compiles_and_keeps_each_stage_on_its_workers(tmp_path, name):
    """Over strategies, one or two micro-batches, staleness 0 or 1 and each stage kept
    out of fusion in turn: every plan compiles (a fused task waits only for tasks
    compiled before it), and a task runs where each of its stages with a placement may
    run (a trainer fused behind stages without a model keeps its workers)."""
    config = _without_evaluate(tmp_path) if name == "best-of-n" else CONFIGS / f"{name}.yaml"
    graph = load_pipeline(config).graph
    loop = graph.loop_stages
    for strategy in ("colocated", "interleaved", "disaggregated"):
        for micro in (1, 2):
            for staleness in (0, 1):
                for alone in (None, *loop):
                    overrides = {"placement.strategy": strategy, "data.micro_batches": micro,
                                 "overlap.max_staleness": staleness}
                    if alone:
                        overrides[f"stages.{alone}.fuse"] = False
                    specs, plan = _compile(config, overrides)
                    case = (strategy, micro, staleness, alone)
                    _every_row_is_stored_once(specs, plan, graph, case)
                    for s in specs:
                        if s.kind != STAGE:
                            continue
                        for stage in s.stages:
                            allowed = plan.stages[stage].workers
                            if allowed and not plan.stages[stage].gang:
                                assert s.workers and set(s.workers) <= set(allowed), \
                                    (case, s.id, s.workers, stage, allowed)


# --------------------------------------------------------------------------- rules


@pytest.mark.parametrize("config", sorted(p.stem for p in CONFIGS.glob("*-tiny.yaml")))
def test_every_wait_carries_a_named_rule(tmp_path, config):
    """No anonymous wait: each one names its rule, and a rule about a model names it."""
    for overrides in ({"placement.strategy": "colocated", "overlap.sequential": True},
                      {"placement.strategy": "disaggregated", "overlap.max_staleness": 1,
                       "checkpoint.every": 1}):
        pipeline = load_pipeline(CONFIGS / f"{config}.yaml", overrides)
        plan = resolve_plan(pipeline, 2)
        specs = TaskCompiler(pipeline, plan, {m: 0 for m in pipeline.spec.models}).setup()
        if pipeline.spec.data is not None:
            specs += compile_run(pipeline, plan, {m: 0 for m in pipeline.spec.models}, 3)[0]
        ids = {s.id for s in specs}
        for s in specs:
            for wait in s.waits:
                assert wait.rule in RULES and wait.task in ids, (config, s.id, wait)
                if "{model}" in wait.rule.why:
                    assert wait.model, (config, s.id, wait)


def test_priorities_come_from_one_function():
    """Within an iteration: transfers, stages by upward rank, checkpoints, stores; a later
    iteration's stages after all of them."""
    specs, _ = _compile(PPO, {"placement.strategy": "disaggregated", "checkpoint.every": 1})
    by_kind = {}
    for s in specs:
        if s.iteration == 1:
            by_kind.setdefault(type(s).__name__, set()).add(s.priority)
    assert by_kind["ExportTask"] == by_kind["InstallTask"] == {priority(1, TRANSFER_LEVEL)}
    assert by_kind["CheckpointTask"] == {priority(1, CHECKPOINT_LEVEL)}
    assert by_kind["StoreTask"] == {priority(1, STORE_LEVEL)}
    assert all(priority(1, STORE_LEVEL) < p < priority(1, TRANSFER_LEVEL)
               for p in by_kind["StageTask"])
    # a later iteration's stages and checkpoints after every task of an earlier one
    assert max(s.priority for s in specs if s.iteration == 2
               and isinstance(s, StageTask | CheckpointTask)) < min(by_kind["StoreTask"])


def test_explain_names_the_rule_of_every_wait():
    pipeline = load_pipeline(PPO, {"placement.strategy": "disaggregated",
                                   "checkpoint.every": 1})
    lines = explain(pipeline, resolve_plan(pipeline, 2), "train_actor")
    text = "\n".join(lines)
    assert lines[0] == "train_actor: 1 task(s) in iteration 1"
    for rule in ("reads", "updated", "installed", "saved"):
        assert f"    {rule}: " in text, text
    assert "installed: install (iteration 0): they install the previous iteration's " \
           "weights of actor on the shadow copy it uses" in text
    sequential = load_pipeline(PPO, {"placement.strategy": "colocated",
                                     "overlap.sequential": True})
    text = "\n".join(explain(sequential, resolve_plan(sequential, 2), "train_critic"))
    assert "rank 1 of a gang of 2" in text and "    gang: train_actor (iteration 1) x2" in text
    assert "    sequential: train_actor (iteration 1) x2: overlap.sequential" in text


def test_explain_of_an_unknown_stage_is_one_line():
    pipeline = load_pipeline(PPO)
    with pytest.raises(ExplainError, match="no stage 'train_actr' in .*did you mean "
                                           "'train_actor'"):
        explain(pipeline, resolve_plan(pipeline, 2), "train_actr")


def test_collectives_on_a_gang_s_workers_take_turns_sharded_checkpoints_included():
    """Two models sharded on the same workers (PPO's actor and critic, backend: fsdp): a
    checkpoint of a sharded model gathers its weights in collectives on every rank, so
    it takes its turn among the gangs there, as the gangs do among themselves; a gang of
    the other model running meanwhile interleaved its collectives with the gather's
    (gloo: "Received data size doesn't match expected size", a worker lost)."""
    specs, plan = _compile(PPO, {
        "placement.strategy": "disaggregated",
        "placement.groups": {"rollout": [0], "train": [1, 2]},
        "placement.stages.values": "rollout", "placement.stages.old_logprob": "rollout",
        "stages.train_actor.backend": "fsdp", "stages.train_critic.backend": "fsdp",
        "checkpoint.every": 1}, workers=3, iterations=3)
    assert plan.homes["actor"] == plan.homes["critic"] == (1, 2)
    # the tasks that run collectives on workers 1 and 2, in the order compiled
    groups: list[list[str]] = []
    for spec in specs:
        collective = (isinstance(spec, StageTask) and spec.gang) or \
            (isinstance(spec, CheckpointTask) and spec.rank is not None and
             spec.workers[0] in (1, 2))
        if not collective:
            continue
        key = spec.id.rsplit("-r", 1)[0]
        if groups and groups[-1][0].rsplit("-r", 1)[0] == key:
            groups[-1].append(spec.id)
        else:
            groups.append([spec.id])
    assert any(g[0].startswith("checkpoint-") for g in groups)
    closure = _closure(specs)
    for before, after in itertools.pairwise(groups):
        for task in after:  # every rank of a group waits for the whole group before it
            assert set(before) <= closure[task], (task, before)
