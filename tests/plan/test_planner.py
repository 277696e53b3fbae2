"""The planner: the cost model (analytic, fitted from measured tasks), profiles, the
simulator walking compiled task specs, the plan search behind ``placement: auto``, and
the ``plan`` and ``profile`` commands."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.plan.auto.costmodel import (
    CostModel,
    Observation,
    Profile,
    ProfileError,
    model_shapes,
)
from rlhfflow.plan.auto.memory import (
    ACTIVATIONS,
    LOGITS,
    activation_bytes,
    layer_params,
    train_task_bytes,
    trainer_state,
)
from rlhfflow.plan.auto.planner import (
    RANK_TASK_S,
    choose_plan,
    describe_choice,
    resolve_plan,
    tasks_per_iteration,
)
from rlhfflow.plan.auto.simulate import simulate
from rlhfflow.plan.describe import plan_text
from rlhfflow.plan.placement import STRATEGIES, PlanError, make_plan
from rlhfflow.runtime.profiler import observations_from_run, profile_pipeline
from rlhfflow.runtime.run import run_pipeline
from tests.conftest import CONFIGS, small_pipeline

PPO = CONFIGS / "ppo-tiny.yaml"
GRPO = CONFIGS / "grpo-tiny.yaml"
SMALL = CONFIGS / "grpo-small.yaml"  # sets no data.micro_batches: the planner splits


def _profile(pipeline, observations) -> Profile:
    shapes = {m: s.__dict__ for m, s in model_shapes(pipeline).items()}
    return Profile(pipeline.name, {"cpu": "test", "cores": 2}, shapes,
                   observations=observations)


# --------------------------------------------------------------------------- cost model


def test_measured_stages_are_fitted_as_a_line_in_rows():
    pipeline = load_pipeline(GRPO)
    obs = [Observation("generate", rows, 1, 1, 0.05 + 0.01 * rows) for rows in (4, 8, 16)]
    cost = CostModel(pipeline, _profile(pipeline, obs))
    assert cost.profiled and cost.warning is None
    assert cost.stage_seconds("generate", 32, threads=1) == pytest.approx(0.05 + 0.32)
    # another thread count: the analytic shape, scaled to the measured level
    analytic = CostModel(pipeline).stage_seconds("generate", 32, threads=2)
    ratio = (0.05 + 0.01 * 8) / CostModel(pipeline).analytic("generate", 8, 1)
    assert cost.stage_seconds("generate", 32, threads=2) == pytest.approx(analytic * ratio)


def test_a_layout_that_leaves_no_core_to_the_coordinator_is_costed_slower():
    """Workers whose threads fill every core share them with the coordinator (Dask's
    scheduler and client): their tasks take ``contention`` longer. A profile keeps the
    two apart, and scales one to the other where only one was measured."""
    pipeline = load_pipeline(GRPO)
    cost = CostModel(pipeline, cores=2)
    assert cost.contended(2, 1) and cost.contended(1, 2) and not cost.contended(1, 1)
    slower = 1 + cost.device["contention"]
    assert cost.stage_seconds("generate", 16, 1, contended=True) == \
        pytest.approx(cost.stage_seconds("generate", 16, 1) * slower)
    alone = [Observation("generate", r, 1, 1, 0.01 * r, workers=1) for r in (4, 8)]
    shared = [Observation("generate", r, 1, 1, 0.03 * r, workers=2) for r in (4, 8)]
    both = CostModel(pipeline, _profile(pipeline, alone + shared))
    assert both.stage_seconds("generate", 16, 1) == pytest.approx(0.16)
    assert both.stage_seconds("generate", 16, 1, contended=True) == pytest.approx(0.48)
    one = CostModel(pipeline, _profile(pipeline, alone))
    assert one.stage_seconds("generate", 16, 1, contended=True) == \
        pytest.approx(0.16 * slower)
    # a profile made before the worker count was recorded: its fit serves both
    legacy = CostModel(pipeline, _profile(pipeline, [
        Observation("generate", r, 1, 1, 0.01 * r) for r in (4, 8)]))
    assert legacy.stage_seconds("generate", 16, 1, contended=True) == pytest.approx(0.16)
    assert legacy.stage_seconds("generate", 16, 1) == pytest.approx(0.16)


def test_a_profile_records_each_iterations_response_length(tmp_path):
    layout = {"workers": 1, "threads": 1, "gangs": {}}
    (tmp_path / "tasks.jsonl").write_text(
        json.dumps({"iteration": 1, "layout": layout,
                    "tasks": [[0, "generate", 1, 1.0, 2.0, 8]]}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"iteration": 1, "response_length_mean": 12.5}) + "\n{torn")
    [observed] = observations_from_run(tmp_path, skip_first=False)
    assert observed.tokens == 12.5


def test_the_analytic_model_grows_with_rows_tokens_layers_and_gangs():
    small = CostModel(load_pipeline(GRPO))
    big = CostModel(load_pipeline(GRPO, {"models.actor.tiny.layers": 8,
                                         "stages.generate.params.max_new_tokens": 32}))
    for stage in ("generate", "ref_logprob", "train_actor"):
        assert small.stage_seconds(stage, 16, 1) < small.stage_seconds(stage, 32, 1)
        assert small.stage_seconds(stage, 16, 1) < big.stage_seconds(stage, 16, 1)
        assert small.stage_seconds(stage, 32, 2) < small.stage_seconds(stage, 32, 1)
    # a gang of two computes on half the rows each, plus an all-reduce per step (at 32
    # rows of this tiny model, whose prompts run once per group, the all-reduce wins)
    alone = small.stage_seconds("train_actor", 64, 1)
    assert small.stage_seconds("train_actor", 64, 1, gang=2) < alone


def test_gradient_checkpointing_charges_a_training_step_one_more_forward_of_the_layers():
    plain = CostModel(load_pipeline(GRPO))
    recompute = CostModel(load_pipeline(GRPO, {"models.actor.gradient_checkpointing": True}))
    # the decoder layers' matrix weights: q, k, v, o and gate, up, down in 2 layers; the
    # LM head is not recomputed
    layers = 2 * (4 * 64 * 64 + 3 * 64 * 256)
    assert recompute.recomputed_weights("actor") == layers
    assert plain.recomputed_weights("actor") == 0

    def per_row(cost, stage):  # fixed costs (task, optimizer steps) cancel out
        return (cost.analytic(stage, 64, 1) - cost.analytic(stage, 32, 1)) / 32

    # train_factor forwards' worth per token, and one forward of the layers more:
    # a forward's share of the step's work, on each row
    factor, params = plain.device["train_factor"], plain.shapes["actor"].params
    assert per_row(recompute, "train_actor") / per_row(plain, "train_actor") == \
        pytest.approx(1 + layers / params / factor)
    assert 1.4 < 1 + layers / params / factor < 1.5
    assert recompute.stage_seconds("train_actor", 32, 1) > \
        plain.stage_seconds("train_actor", 32, 1)
    # inference never builds a graph: nothing is recomputed
    for stage in ("generate", "ref_logprob"):
        assert recompute.analytic(stage, 32, 1) == plain.analytic(stage, 32, 1)


def test_a_stage_that_decodes_greedily_is_costed_as_decoding():
    # ReMax's baseline decodes max_new_tokens steps: costed like one forward pass it was
    # predicted at a sixth of its measured time
    cost = CostModel(load_pipeline(CONFIGS / "remax-tiny.yaml"))
    forward = cost.analytic("ref_logprob", 16, 1)
    assert cost.analytic("baseline", 16, 1) > 4 * forward
    longer = CostModel(load_pipeline(CONFIGS / "remax-tiny.yaml",
                                     {"stages.baseline.params.max_new_tokens": 32}))
    assert longer.analytic("baseline", 16, 1) > cost.analytic("baseline", 16, 1)


def test_a_profile_of_other_model_shapes_falls_back_to_the_analytic_model():
    pipeline = load_pipeline(GRPO)
    profile = _profile(pipeline, [Observation("generate", 8, 1, 1, 99.0)])
    profile.shapes["actor"]["layers"] = 12
    cost = CostModel(pipeline, profile)
    assert not cost.profiled and "actor.layers 12 vs 2" in cost.warning
    assert cost.stage_seconds("generate", 8, 1) == CostModel(pipeline).stage_seconds(
        "generate", 8, 1)


def test_the_prediction_says_which_stages_no_profile_measured():
    """A profile that measured some stage types and not others (a rollout's environment,
    a stage added since) predicts those from the analytic model, and says so."""
    pipeline = load_pipeline(GRPO)
    assert CostModel(pipeline).source() == "analytic cost model, no profile of this machine"
    assert CostModel(pipeline).unmeasured() == ["generate", "ref_logprob", "train_actor"]
    obs = [Observation(stage, rows, 1, 1, 0.01 * rows) for rows in (4, 8)
           for stage in ("generate", "ref_logprob")]
    cost = CostModel(pipeline, _profile(pipeline, obs))
    assert cost.unmeasured() == ["train_actor"]
    assert cost.source() == "profile; analytic for train_actor, which it did not measure"
    everything = obs + [Observation("train_actor", 8, 1, 1, 0.2)]
    assert CostModel(pipeline, _profile(pipeline, everything)).source() == "profile"


@pytest.mark.parametrize("content,message", [
    (None, "profile file not found"),
    ("{not json", "not a readable profile"),
    ('{"format": "something-else"}', "not an rlhfflow profile"),
    ('{"format": "rlhfflow-profile/1", "pipeline": "x"}', "malformed profile"),
])
def test_a_bad_profile_file_is_one_line(tmp_path, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileError) as err:
        Profile.load(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_profile_survives_a_round_trip(tmp_path):
    pipeline = load_pipeline(GRPO)
    profile = _profile(pipeline, [Observation("train_actor", 32, 1, 2, 0.5, workers=2)])
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.observations == profile.observations and again.shapes == profile.shapes


# --------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_simulated_schedule_keeps_every_dependency_and_one_task_per_worker(strategy):
    pipeline = load_pipeline(PPO, {"placement.strategy": strategy})
    plan = resolve_plan(pipeline, 2)
    sim = simulate(pipeline, plan, CostModel(pipeline), threads=1, iterations=4)
    specs = {s.id: s for s in sim.specs}
    for task_id, (_w, start, _stop) in sim.intervals.items():
        for need in specs[task_id].needs():
            if need in sim.intervals:
                assert sim.intervals[need][2] <= start + 1e-9, (need, task_id)
    per_worker = defaultdict(list)
    for task_id, (w, a, b) in sim.intervals.items():
        per_worker[w].append((a, b, task_id))
    for spans in per_worker.values():
        spans.sort()
        for (_a1, b1, t1), (a2, _b2, t2) in zip(spans, spans[1:], strict=False):
            assert b1 <= a2 + 1e-9, (t1, t2)
    assert sorted(sim.finishes) == [0, 1, 2, 3]
    assert sim.iteration_s > 0 and all(0 <= b <= 1 for b in sim.busy_frac)


def test_a_gang_runs_all_its_ranks_at_once():
    pipeline = load_pipeline(PPO, {"placement.strategy": "colocated"})
    sim = simulate(pipeline, resolve_plan(pipeline, 2), CostModel(pipeline), 1, iterations=3)
    ranks = [v for k, v in sim.intervals.items() if k.startswith("train_actor-1-r")]
    assert len(ranks) == 2 and ranks[0][2] == ranks[1][2]  # they end together
    assert {w for w, _, _ in ranks} == {0, 1}


def test_a_task_is_slowed_by_the_coordinator_only_while_every_core_is_busy():
    """On 2 cores with 2 one-thread workers, a task computes at ``contention``'s slower
    speed while the other worker computes too (the coordinator then shares their cores)
    and at full speed while it computes alone: its work, so integrated, is its time
    alone. The speed changes as the other worker's tasks start and end (processor
    sharing), not once at the task's start."""
    pipeline = load_pipeline(GRPO, {"placement.strategy": "interleaved"})
    plan = resolve_plan(pipeline, 2)
    cost = CostModel(pipeline, cores=2)
    sim = simulate(pipeline, plan, cost, threads=1, iterations=4, contended=True)
    specs = {s.id: s for s in sim.specs}
    kinds = set()
    for tid, (w, a, b) in sim.intervals.items():
        spec = specs[tid]
        if spec.label != "ref_logprob":
            continue
        rows = spec.rows[1] - spec.rows[0]
        fast = cost.stage_seconds("ref_logprob", rows, 1, contended=False)
        slow = cost.stage_seconds("ref_logprob", rows, 1, contended=True)
        shared = sum(max(0.0, min(b, y) - max(a, x))
                     for other, (v, x, y) in sim.intervals.items() if v != w and y > x)
        assert (b - a - shared) + shared * fast / slow == pytest.approx(fast), tid
        kinds.add("alone" if shared < 1e-9 else "shared" if shared >= b - a - 1e-9
                  else "partly")
    assert len(kinds) >= 2, kinds  # the reference ran more than one way in this plan


@pytest.mark.parametrize("every", [3, 5])
def test_checkpoints_cost_their_real_rate_whatever_the_window(every):
    """A checkpoint every ``every`` iterations costs 1/every of its time per iteration,
    whether the simulated window holds one checkpoint in 4 steady iterations or two in
    10: the prediction does not depend on where the window cuts."""
    pipeline = load_pipeline(GRPO, {"placement.strategy": "colocated",
                                    "checkpoint.every": every})
    plan = resolve_plan(pipeline, 1)
    cost = CostModel(pipeline)
    cost.device["checkpoint_s"] = 0.5  # a slow disk: a checkpoint weighs 3-4 iterations
    without = load_pipeline(GRPO, {"placement.strategy": "colocated", "checkpoint.every": 0})
    base = simulate(without, resolve_plan(without, 1), cost, 1, iterations=6).iteration_s
    saving = cost.checkpoint_seconds("actor")
    for window in (6, 12):
        sim = simulate(pipeline, plan, cost, 1, iterations=window)
        assert sim.iteration_s == pytest.approx(base + saving / every, rel=0.02), window


def test_the_timeline_draws_every_worker():
    pipeline = load_pipeline(PPO, {"placement.strategy": "interleaved"})
    sim = simulate(pipeline, resolve_plan(pipeline, 2), CostModel(pipeline), 1, iterations=4)
    lines = sim.timeline(2, 2)
    assert lines[0].startswith("  w0") and lines[1].startswith("  w1")
    assert "generate" in lines[-1] and "train_actor" in lines[-1]


# --------------------------------------------------------------------------- search


def test_auto_picks_the_fastest_plan_that_fits_and_changes_nothing_computed():
    pipeline = load_pipeline(PPO, {"overlap.max_staleness": 1})
    choice = choose_plan(pipeline, n_workers=2)
    times = [c.predicted_s for c in choice.candidates if not c.problem]
    # the fastest once each task of an iteration counts RANK_TASK_S: here a plan with
    # fewer tasks, predicted slower than the fastest by less than its tasks would cost
    def ranked(c):
        return c.predicted_s + RANK_TASK_S * tasks_per_iteration(c)

    assert ranked(choice.best) == min(ranked(c) for c in choice.candidates if not c.problem)
    assert choice.best.predicted_s > min(times)
    assert {c.strategy for c in choice.candidates} == set(STRATEGIES)
    chosen = choice.pipeline.spec
    assert chosen.placement.strategy == choice.best.strategy
    assert chosen.overlap.max_staleness == 1
    assert chosen.algorithm == pipeline.spec.algorithm
    assert chosen.stages == pipeline.spec.stages
    assert choice.pipeline.params == pipeline.params


def test_what_the_file_sets_is_not_searched():
    explicit = choose_plan(load_pipeline(GRPO, {"data.micro_batches": 2}), n_workers=2)
    assert {c.micro_batches for c in explicit.candidates} == {2}
    searched = choose_plan(load_pipeline(SMALL), n_workers=2)
    assert {c.micro_batches for c in searched.candidates} == {2, 4, 8}
    assert {c.fuse for c in searched.candidates} == {True, False}
    fixed = choose_plan(load_pipeline(SMALL, {"overlap.fuse": True}), n_workers=2)
    assert {c.fuse for c in fixed.candidates} == {True}


def test_the_embedded_cluster_searches_workers_and_threads_once_measured():
    pipeline = load_pipeline(GRPO)
    # unmeasured: each worker count with a core left to the coordinator where it can be
    # (1 worker x 1 thread), or sharing the cores with it (2 x 1)
    unmeasured = choose_plan(pipeline, cores=2)
    assert {(c.workers, c.threads, c.contended) for c in unmeasured.candidates} == \
        {(1, 1, False), (2, 1, True)}
    profile = _profile(pipeline, [Observation("generate", r, t, 1, 0.01 * r)
                                  for r in (4, 8) for t in (1, 2)])
    choice = choose_plan(pipeline, profile, cores=2)
    layouts = {(c.workers, c.threads) for c in choice.candidates}
    assert {(1, 2), (2, 1), (1, 1)} <= layouts
    assert choice.pipeline.spec.cluster.workers == choice.best.workers
    # a given cluster keeps its layout
    given = choose_plan(load_pipeline(GRPO, {"cluster.torch_threads": 1}), n_workers=3)
    assert {(c.workers, c.threads) for c in given.candidates} == {(3, 1)}


def test_a_plan_that_does_not_fit_is_never_chosen():
    pipeline = load_pipeline(PPO, {"cluster.memory_limit": "1MB"})
    with pytest.raises(PlanError) as err:
        choose_plan(pipeline, n_workers=2)
    assert "placement.strategy: no plan fits the cluster (does not fit: worker" in str(err.value)


# a GRPO actor of 128 MiB of fp32 weights (hidden 512, 8 layers) on 3 workers: 1189 MiB
# per worker unsharded and colocated (the process's 400 included), 958 MiB sharded over
# the train group, 866 MiB with gradient checkpointing too; a worker may use 80% of its
# limit (Dask pauses it above)
LARGER = {"models.actor.tiny": {"layers": 8, "hidden": 512, "heads": 4}, "cluster.workers": 3}


def _larger(**overrides):
    return load_pipeline(GRPO, {**LARGER, **overrides})


def test_the_memory_of_a_sharded_trainer_is_its_share_plus_what_it_gathers():
    pipeline = _larger(**{"stages.train_actor.backend": "fsdp",
                          "placement.strategy": "disaggregated"})
    cost = CostModel(pipeline)
    plan = make_plan(pipeline, 3)
    rows = {name: 0 for name in plan.stages}
    shape = cost.shapes["actor"]
    home, [shadow] = plan.homes["actor"], plan.shadows("actor")
    assert len(home) == 2
    parts = cost.memory_parts(plan, rows)
    layer, root = layer_params(shape)
    first, second = (trainer_state(shape, 2, saves=w == home[0]) for w in home)
    for w, state in zip(home, (first, second), strict=True):
        # half the two AdamW moments; one layer and the embeddings gathered, with grads
        assert parts[w]["trainer"] == pytest.approx(8 * shape.params / 2 + 8 * (layer + root))
        # the frozen reference's whole copy beside it
        assert parts[w]["weights"] == pytest.approx(shape.nbytes / 2 + cost.shapes["ref"].nbytes)
        # a training step's gradients (no rows: no activations) or loading, whichever
        assert parts[w]["work"] == pytest.approx(max(
            train_task_bytes(shape, 0, 0, 2, "fsdp", False), state["transient"]))
    assert first["transient"] > second["transient"]  # rank 0 gathers the checkpoint
    # the shadow: a whole copy, and the ranks' parts of the new weights in flight
    assert parts[shadow]["weights"] == shape.nbytes
    assert parts[shadow]["incoming"] == shape.moved_bytes
    # unsharded, each worker of the gang holds it all: 16 bytes per parameter
    plain = CostModel(_larger(**{"placement.strategy": "disaggregated"}))
    unsharded = plain.memory_parts(plan, rows)
    assert unsharded[home[0]]["trainer"] == 12 * shape.params
    # its shadow receives the whole new weights beside its own as well (measured on
    # SmolLM2: the generating worker's peak is its copy plus one more, docs/how-to/
    # sharded-training.md)
    assert unsharded[shadow]["incoming"] == shape.moved_bytes
    assert sum(parts[home[1]].values()) < 0.75 * sum(unsharded[home[1]].values())
    # the plan in words says how it trains and what it moves
    text = plan_text(plan, pipeline)
    assert "sharded over 2 workers (backend: fsdp)" in text
    assert "train_actor gathers weights (forward, backward) and reduce-scatters gradients" \
        in text and "all-reduces" not in text


def test_gradient_checkpointing_keeps_one_layer_input_per_layer():
    shape = CostModel(_larger()).shapes["actor"]
    full = activation_bytes(shape, 4, 64, False)
    kept = activation_bytes(shape, 4, 64, True)
    logits = 4 * 64 * shape.vocab * 4 * LOGITS
    assert full == 4 * 64 * shape.hidden * 4 * shape.layers * ACTIVATIONS + logits
    assert kept == 4 * 64 * shape.hidden * 4 * (shape.layers + ACTIVATIONS) + logits


def test_auto_shards_and_checkpoints_a_model_that_does_not_fit_otherwise():
    # today's plans are unchanged where everything fits
    assert choose_plan(_larger(), n_workers=3).best.fits == {}
    sharded = choose_plan(_larger(**{"cluster.memory_limit": "1.35GB"}), n_workers=3)
    assert sharded.best.fits == {"stages.train_actor.backend": "fsdp"}
    assert sharded.best.strategy == "disaggregated"
    assert sharded.pipeline.spec.stages["train_actor"].backend == "fsdp"
    assert not sharded.pipeline.spec.models["actor"].gradient_checkpointing
    assert max(sharded.best.memory) <= sharded.best.capacity
    text = "\n".join(describe_choice(sharded, None))
    assert "train_actor sharded (backend: fsdp)" in text
    assert "no plan fits memory as the file is written (does not fit: worker" in text
    both = choose_plan(_larger(**{"cluster.memory_limit": "1.2GB"}), n_workers=3)
    assert both.best.fits == {"stages.train_actor.backend": "fsdp",
                              "models.actor.gradient_checkpointing": True}
    assert both.pipeline.spec.models["actor"].gradient_checkpointing
    # what the file sets is the user's: an explicit backend is never changed
    with pytest.raises(PlanError, match="no plan fits the cluster"):
        choose_plan(_larger(**{"cluster.memory_limit": "1.35GB",
                               "stages.train_actor.backend": "torch"}), n_workers=3)


def test_a_plan_that_does_not_fit_says_what_needs_what_and_what_would_fit(tmp_path):
    pipeline = _larger(**{"cluster.memory_limit": "1.35GB", "placement.strategy": "colocated"})
    with pytest.raises(PlanError) as err:
        choose_plan(pipeline, n_workers=3, vary=False)
    line = str(err.value)
    assert "\n" not in line
    assert "does not fit: worker 0 needs 1.16 GiB (process 400.0 MiB, weights 256.4 MiB, " \
        "trainer 384.7 MiB, work 148.2 MiB) over its 1.01 GiB limit (cluster.memory_limit, at " \
        "Dask's pause fraction 0.8)" in line
    assert re.search(r"would fit: placement.strategy: disaggregated, "
                     r"stages.train_actor.backend: fsdp \(9\d\d.\d MiB\)", line), line
    assert "models.actor.lora trains adapters only" in line
    # rlhfflow run refuses it before starting a cluster (exit 2)
    result = CliRunner().invoke(main, ["run", str(GRPO), "--set", "cluster.workers=3",
                                       "--set", "cluster.memory_limit=1.35GB", "--set",
                                       "placement.strategy=colocated", "--set",
                                       "models.actor.tiny={layers: 8, hidden: 512, heads: 4}",
                                       "--set", f"output={tmp_path / 'out'}"])
    assert result.exit_code == 2, result.output
    assert "cluster.memory_limit: does not fit: worker 0 needs 1.16 GiB" in result.output


def test_resolve_plan_with_auto_returns_a_concrete_strategy():
    plan = resolve_plan(load_pipeline(PPO), 2)
    assert plan.strategy in STRATEGIES


def test_make_plan_leaves_auto_to_the_planner():
    """Placement knows no planner: a caller resolves ``auto`` first (``resolve_plan``)."""
    with pytest.raises(ValueError, match="resolve placement.strategy 'auto' first"):
        make_plan(load_pipeline(PPO), 2)


def test_large_clusters_are_planned_with_a_guided_search():
    pipeline = load_pipeline(SMALL, {"data.batch_size": 64})
    choice = choose_plan(pipeline, n_workers=64)
    assert not choice.exhaustive
    assert choice.best.workers == 64 and choice.best.simulation is not None


# --------------------------------------------------------------------------- commands


def test_plan_command_shows_the_prediction_timeline_and_candidates():
    result = CliRunner().invoke(main, ["plan", str(PPO), "--candidates", "3"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "predicted:" in text and "s per iteration" in text
    assert "planner: chose" in text and "timeline of one steady iteration" in text
    assert "  w0  |" in text and "  w1  |" in text
    assert "candidates:" in text and "  2. " in text and "(chosen)" in text


def test_plan_command_plans_a_larger_cluster_with_a_profile(tmp_path):
    pipeline = load_pipeline(GRPO)
    profile = _profile(pipeline, [Observation("generate", r, 1, 1, 0.01 * r) for r in (2, 4)])
    profile.save(tmp_path / "gpu.json")
    result = CliRunner().invoke(main, ["plan", str(GRPO), "--workers", "16", "--profile",
                                       str(tmp_path / "gpu.json")])
    assert result.exit_code == 0, result.output
    assert "on 16 worker(s)" in result.output and "from the profile of 2 measured" in \
        result.output


def test_plan_command_rejects_a_bad_profile_with_exit_2(tmp_path):
    (tmp_path / "bad.json").write_text("[]")
    result = CliRunner().invoke(main, ["plan", str(GRPO), "--profile",
                                       str(tmp_path / "bad.json")])
    assert result.exit_code == 2
    assert "placement.profile" in result.output and "not an rlhfflow profile" in result.output


def test_plan_command_says_when_no_plan_fits():
    result = CliRunner().invoke(main, ["plan", str(PPO), "--set", "cluster.memory_limit=1MB"])
    assert result.exit_code == 2 and "no plan fits the cluster" in result.output


# --------------------------------------------------------------------------- runs


@pytest.mark.slow
def test_a_run_records_task_intervals_a_profile_is_made_of(tmp_path):
    """Inline (no Dask): tasks.jsonl keeps every stage task with its rows; --from-run
    turns them into a profile the planner then predicts from."""
    path = small_pipeline(tmp_path, "grpo", iterations=3)
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    observed = observations_from_run(tmp_path / "out")
    stages = {o.stage for o in observed}
    assert {"generate", "reward", "train_actor", "store"} <= stages
    assert all(o.rows > 0 and o.seconds >= 0 for o in observed)
    lines = (tmp_path / "out" / "tasks.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]
    result = CliRunner().invoke(main, ["profile", str(path), "--from-run",
                                       str(tmp_path / "out"), "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    profile = Profile.load(tmp_path / "p.json")
    assert len(profile.observations) == len(observed)
    assert CostModel(load_pipeline(path), profile).profiled


def test_an_observation_counts_the_workers_busy_as_it_started(tmp_path):
    """Whether a task shared its cores with the coordinator depends on what ran beside
    it: on 2 workers, a task that started while the other was idle counts as alone."""
    layout = {"workers": 2, "threads": 1, "gangs": {}}
    tasks = [[0, "generate", 1, 10.0, 10.5, 16],     # w1 idle: alone
             [1, "ref_logprob", 1, 10.6, 10.7, 16],  # w0 idle again: alone
             [0, "generate", 1, 10.65, 11.0, 16],    # w1 busy: both
             [1, "store", 1, 10.9, 11.2, 16]]        # w0 busy: both
    (tmp_path / "tasks.jsonl").write_text(
        json.dumps({"iteration": 1, "layout": layout, "tasks": tasks}) + "\n")
    observed = observations_from_run(tmp_path, skip_first=False)
    assert [o.workers for o in observed] == [1, 1, 2, 2]
    cost = CostModel(load_pipeline(GRPO), cores=2)
    assert [cost.contended(o.workers, o.threads) for o in observed] == [False, False,
                                                                        True, True]


@pytest.mark.slow
def test_the_profiling_pass_measures_every_stage_on_an_embedded_cluster(tmp_path):
    path = small_pipeline(tmp_path, "grpo", iterations=2)
    pipeline = load_pipeline(path)
    profile = profile_pipeline(pipeline, iterations=2, worker_layouts=[(2, 1)],
                               say=lambda line: None)
    stages = {(o.stage, o.gang) for o in profile.observations}
    # co-located trains in a gang of two, interleaved alone
    assert {("generate", 1), ("train_actor", 2), ("train_actor", 1)} <= stages
    rows = {o.rows for o in profile.observations if o.stage == "generate"}
    assert len(rows) >= 2  # two splits: a line can be fitted
    assert CostModel(pipeline, profile).profiled


@pytest.mark.slow
def test_a_run_far_from_its_analytic_prediction_says_how_to_profile(tmp_path, monkeypatch,
                                                                      capsys):
    from rlhfflow.plan.auto import costmodel

    # constants of an impossibly fast machine: every run is far slower than predicted
    monkeypatch.setitem(costmodel.CPU_DEVICE, "flops_per_s", 1e18)
    for key in ("layer_s", "row_step_s", "train_step_s", "task_s", "latency_s", "finish_s"):
        monkeypatch.setitem(costmodel.CPU_DEVICE, key, 1e-9)
    path = small_pipeline(tmp_path, "grpo", iterations=4)
    run_pipeline(load_pipeline(path), progress=True)  # planned: the embedded cluster
    [line] = [x for x in capsys.readouterr().err.splitlines() if "iteration time:" in x]
    assert "chosen with the analytic cost model: `rlhfflow profile" in line
    assert f"--from-run {tmp_path / 'out'}` makes a profile" in line


def test_the_calibration_fit_recovers_the_times_of_another_machine():
    """benchmarks/calibrate.py: stage times made by the analytic model with other
    constants (a slower machine with more per-layer and per-step overhead) are far from
    the shipped constants' estimates, and within a few percent of the fitted ones."""
    import math
    import statistics

    from benchmarks.calibrate import errors, fit
    from rlhfflow.plan.auto.costmodel import CPU_DEVICE

    other = {**CPU_DEVICE, "flops_per_s": CPU_DEVICE["flops_per_s"] / 2,
             "layer_s": CPU_DEVICE["layer_s"] * 3, "train_step_s": 0.05,
             "row_step_s": CPU_DEVICE["row_step_s"] * 2, "contention": 0.6}
    cases = []
    for config in (GRPO, SMALL):
        cost = CostModel(load_pipeline(config))
        cost.device = other
        groups = {(stage, rows, threads, gang, shared):
                  cost.analytic(stage, rows, threads, gang, shared)
                  for stage in ("generate", "ref_logprob", "train_actor")
                  for rows in (8, 32) for threads in (1, 2) for gang in (1, 2)
                  for shared in (False, True)
                  if gang == 1 or stage == "train_actor"}
        cases.append((CostModel(load_pipeline(config)), groups))

    def median_error(device):
        return statistics.median(abs(math.expm1(e)) for e in errors(cases, device))

    assert median_error(dict(CPU_DEVICE)) > 0.3
    assert median_error(fit(cases, dict(CPU_DEVICE))) < 0.05


def test_a_trainer_of_selected_rows_is_costed_on_the_rows_it_keeps():
    # best-of-N: train_sft learns from the top 1 of each prompt's 4 samples, so its
    # update costs what training on a quarter of the rows (one per prompt) costs
    best_of_n = CONFIGS / "best-of-n-tiny.yaml"
    pipeline = load_pipeline(best_of_n)
    assert pipeline.graph.nodes["train_sft"].row_filter == "selected"
    assert pipeline.graph.nodes["select"].kept_share == 0.25
    every_row = CostModel(load_pipeline(best_of_n, {"stages.train_sft.params.selected": False,
                                                    "data.samples_per_prompt": 1}))
    kept = CostModel(pipeline).analytic("train_sft", 32, 1)
    assert kept == pytest.approx(every_row.analytic("train_sft", 8, 1))
    assert kept < CostModel(load_pipeline(best_of_n, {
        "stages.train_sft.params.selected": False})).analytic("train_sft", 32, 1)
