"""The environment time of multi-turn rollouts in the planner (``rlhfflow.plan.auto.envtime``
and ``CostModel.env_seconds``): a synchronous task waits for its slowest episode, a
streaming one costs the mean episode, the time comes from a profile or the declared
``env_step_s``, and the simulator's prediction carries it. The model's arithmetic only:
nothing runs, no timing is asserted."""

from __future__ import annotations

import pytest

from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.shapes import model_shapes
from rlhfflow.plan.auto import envtime
from rlhfflow.plan.auto.costmodel import CostModel, Observation, Profile, machine_info
from rlhfflow.plan.auto.planner import plan_for_cli
from tests.conftest import REPO

STREAM = REPO / "examples" / "multiturn" / "guess-stream-tiny.yaml"  # 2 workers, 3 turns at most
STEP = 0.05
THREADED = {"stages.rollout.params.env_workers": 16}


def _pipeline(stream: bool = True, order: str = "iteration", **overrides):
    orders = {"stages.rollout.params.stream_order": order} if stream else {}
    return load_pipeline(STREAM, {**THREADED, "stages.rollout.params.stream": stream,
                                  **orders, **overrides})


def test_a_synchronous_task_waits_for_its_slowest_episode():
    """With a thread per episode, the task's steps are the most turns' one after
    another; with one thread (steps in turn with decoding), every episode's steps."""
    assert envtime.sync_seconds(STEP, 16, 8, 16) == pytest.approx(8 * STEP)
    assert envtime.sync_seconds(STEP, 16, 8, 0) == pytest.approx(16 * 4.5 * STEP)
    assert envtime.sync_seconds(STEP, 16, 8, 4) == pytest.approx(16 * 4.5 / 4 * STEP)
    assert envtime.sync_seconds(0.0, 16, 8, 16) == 0.0


def test_a_streaming_task_costs_the_mean_episode():
    assert envtime.stream_seconds(STEP, 16, 8, 16) == pytest.approx(4.5 * STEP)
    # twice the episodes in flight: half the steps per slot; too few threads: theirs
    assert envtime.stream_seconds(STEP, 16, 8, 32, in_flight=32) == pytest.approx(
        4.5 / 2 * STEP)
    assert envtime.stream_seconds(STEP, 16, 8, 4) == pytest.approx(16 * 4.5 / 4 * STEP)
    for turns in (2, 4, 8):  # turns that vary: faster than the slowest episode
        assert envtime.stream_seconds(STEP, 16, turns, 16) < \
            envtime.sync_seconds(STEP, 16, turns, 16)
    # the inverse: a measured synchronous task's environment seconds give the step back
    assert envtime.step_from(envtime.sync_seconds(STEP, 16, 8, 4), 16, 8, 4) == \
        pytest.approx(STEP)


def test_a_finish_order_task_costs_the_mean_over_twice_its_rows_or_the_spread_tail():
    """In finish order twice the rows are in flight, but an episode started
    ``max_staleness`` versions back is owed: no task is shorter than the slowest
    episode's steps over the ``max_staleness + 1`` tasks it may span."""
    assert envtime.finish_seconds(STEP, 16, 8, 32, None, 1) == pytest.approx(
        max(4.5 / 2, 8 / 2) * STEP)
    assert envtime.finish_seconds(STEP, 16, 8, 32, None, 3) == pytest.approx(
        4.5 / 2 * STEP)
    assert envtime.finish_seconds(STEP, 16, 8, 4, None, 3) == pytest.approx(
        16 * 4.5 / 4 * STEP)  # too few threads: their throughput
    declared = {"stages.rollout.params.env_step_s": STEP}
    finish = CostModel(_pipeline(order="finish", **declared))
    assert finish.env_seconds("rollout", 8, streaming=True) == pytest.approx(
        envtime.finish_seconds(STEP, 8, 3, 16, None, 1))
    assert finish.env_seconds("rollout", 8, streaming=True) < \
        CostModel(_pipeline(**declared)).env_seconds("rollout", 8, streaming=True)


def test_the_declared_step_time_enters_the_analytic_estimate():
    """Without ``env_step_s`` (and no profile) nothing is charged, as before; with it,
    the analytic time of a rollout task grows by its slowest episode's steps and of a
    model-free stage by nothing."""
    plain = CostModel(_pipeline(stream=False))
    declared = CostModel(_pipeline(stream=False, **{"stages.rollout.params.env_step_s": STEP}))
    assert plain.env_seconds("rollout", 8) == 0.0
    assert declared.env_seconds("rollout", 8) == pytest.approx(3 * STEP)
    assert declared.analytic("rollout", 8, 1) - plain.analytic("rollout", 8, 1) == \
        pytest.approx(3 * STEP)
    assert declared.analytic("advantages", 16, 1) == plain.analytic("advantages", 16, 1)
    pooled = CostModel(_pipeline(stream=False, **{"stages.rollout.params.env_step_s": STEP,
                                                  "stages.rollout.params.env_placement":
                                                  "pool", "cluster.env_workers": 1}))
    assert pooled.env_seconds("rollout", 8) == 0.0  # its steps leave the model worker


def test_a_streaming_rollout_is_charged_the_mean_episode_not_the_slowest():
    declared = {"stages.rollout.params.env_step_s": STEP}
    sync = CostModel(_pipeline(stream=False, **declared))
    stream = CostModel(_pipeline(stream=True, **declared))
    gap = sync.stage_seconds("rollout", 8, 1) - stream.stage_seconds("rollout", 8, 1)
    assert gap == pytest.approx(envtime.sync_seconds(STEP, 8, 3, 16)
                                - envtime.stream_seconds(STEP, 8, 3, 16))
    assert gap > 0


def test_a_profiles_measured_environment_time_wins_over_the_declared_one():
    """A profile's rollout tasks say how long their steps took (``Observation.env``):
    the step time they imply replaces ``env_step_s``."""
    pipeline = _pipeline(stream=False, **{"stages.rollout.params.env_step_s": STEP})
    measured = 0.3  # 3 turns of 0.1 s: the slowest episode of each task
    profile = Profile(pipeline.name, machine_info(),
                      {m: s.__dict__ for m, s in model_shapes(pipeline).items()},
                      observations=[Observation("rollout", rows, 1, 1, measured + 0.02, 2,
                                                env=measured) for rows in (8, 8, 16)])
    cost = CostModel(pipeline, profile)
    assert cost.profiled
    assert cost.env_seconds("rollout", 8) == pytest.approx(measured)
    assert cost.env_seconds("rollout", 8, streaming=True) == pytest.approx(
        envtime.stream_seconds(0.1, 8, 3, 16))


def test_the_simulated_iteration_carries_the_environment_and_streaming_time():
    """The planner's prediction: the declared steps lengthen a synchronous iteration by
    about its slowest episode's, and the same rollout streaming is predicted faster."""
    declared = {"stages.rollout.params.env_step_s": 0.1}

    def predicted(**overrides) -> float:
        return plan_for_cli(_pipeline(**overrides), None, None).best.predicted_s

    plain, sync = predicted(stream=False), predicted(stream=False, **declared)
    assert sync - plain >= 0.9 * 3 * 0.1
    assert predicted(stream=True, **declared) < sync
