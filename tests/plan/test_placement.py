"""Placement: the execution plan of each strategy, impossible placements, data-parallel
gangs (a real gloo process group), and the promise that placement changes speed, never
results (the three strategies on a real 2-worker Dask cluster)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config import load_pipeline
from rlhfflow.engine.models import load_model
from rlhfflow.engine.parallel import free_port
from rlhfflow.launch.forkserver import start_fork_server
from rlhfflow.plan.auto.planner import resolve_plan
from rlhfflow.plan.placement import PlanError
from rlhfflow.runtime.run import run_pipeline
from tests.conftest import CONFIGS, make_prompt_batch, small_pipeline, torch_and_deepspeed_runs

PPO = CONFIGS / "ppo-tiny.yaml"


def _plan(overrides=None, workers=2):
    pipeline = load_pipeline(PPO, overrides)
    return resolve_plan(pipeline, workers)


# --------------------------------------------------------------------------- plans


def test_colocated_puts_every_model_everywhere_and_trains_in_gangs():
    plan = _plan({"placement.strategy": "colocated"})
    assert set(plan.homes.values()) == {(0, 1)}
    assert plan.stages["generate"].workers == (0, 1)
    assert plan.stages["generate"].worker(0) == 0 and plan.stages["generate"].worker(1) == 1
    assert plan.stages["train_actor"].gang and plan.stages["train_critic"].gang
    assert plan.gangs == ((0, 1),)
    assert plan.transfers == ()


def test_interleaved_gives_models_exclusive_groups():
    plan = _plan({"placement.strategy": "interleaved"})
    assert plan.homes["actor"] == (0,) and plan.homes["critic"] == (1,)
    # the reference goes where fewer bytes live: next to the (smaller) critic
    assert plan.homes["ref"] == (1,)
    assert not any(s.gang for s in plan.stages.values())
    assert plan.transfers == ()


def test_disaggregated_generates_on_a_shadow_that_is_synced_after_each_update():
    plan = _plan({"placement.strategy": "disaggregated"}, workers=4)
    assert plan.groups == {"rollout": (0, 1), "train": (2, 3)}
    assert plan.stages["generate"].workers == (0, 1) and plan.stages["generate"].shadow
    assert plan.homes["actor"] == (2, 3)
    assert plan.shadows("actor") == (0, 1)
    [transfer] = plan.transfers
    assert (transfer.model, transfer.after, transfer.source, transfer.targets) == \
        ("actor", "train_actor", 2, (0, 1))
    assert transfer.nbytes == plan.model_bytes["actor"] > 0


def test_explicit_groups_and_stage_placement_override_the_strategy():
    plan = _plan({"placement.strategy": "interleaved",
                  "placement.groups": {"big": [0, 1], "small": [2]},
                  "placement.models": {"actor": "big", "ref": 2},
                  "placement.stages": {"ref_logprob": [2]}}, workers=3)
    assert plan.homes["actor"] == (0, 1) and plan.homes["ref"] == (2,)
    assert plan.stages["train_actor"].gang
    assert plan.stages["ref_logprob"].workers == (2,)


@pytest.mark.parametrize("strategy,expected", [
    ("colocated", ["train_actor    train_actor  workers 0,1    data-parallel gang of 2",
                   "generate       generate     workers 0,1    2 micro-batch(es), each on "
                   "whichever of them is free",
                   "actor: train_actor all-reduces gradients over workers 0,1"]),
    ("interleaved", ["actor          workers 0 (", "critic         workers 1 (",
                     "none: every model is updated where it is used"]),
    ("disaggregated", ["rollout        workers 0", "train          workers 1",
                       "[shadow]", "actor: after train_actor, worker 1 -> 0: 537.8 KiB"]),
])
def test_plan_command_prints_workers_splits_and_moved_bytes(strategy, expected):
    result = CliRunner().invoke(main, ["plan", str(PPO), "--strategy", strategy])
    assert result.exit_code == 0, result.output
    assert f"strategy {strategy} on 2 worker(s)" in result.output
    for line in expected:
        assert line in result.output, (line, result.output)


@pytest.mark.parametrize("overrides,workers,message", [
    ({"placement.models": {"actor": 5}}, 2,
     "placement.models.actor: worker index 5, but the cluster has 2 worker(s) (0..1)"),
    ({"placement.groups": {"a": 0.5, "b": 0.5, "c": 0.5}}, 2,
     "placement.groups.c: no worker left: 0.5 of 2 worker(s) is 1, but groups before it "
     "(a, b) already take 2"),
    ({"placement.strategy": "disaggregated"}, 1,
     "placement.strategy: disaggregated needs at least 2 workers"),
    ({"placement.strategy": "disaggregated", "placement.groups": {"rollout": [0, 1]}}, 2,
     "placement.groups.train: the train group has no worker"),
    ({"placement.models": {"actor": "gpu"}}, 2,
     "placement.models.actor: unknown group 'gpu'; no placement.groups are defined"),
    ({"placement.stages": {"train_actor": [0]}}, 2,
     "placement.stages.train_actor: a training stage runs where its model lives"),
    ({"placement.models": {"actor": [0, 1], "critic": [1, 2]}}, 3,
     "placement.models.critic: training on workers [1, 2] overlaps the training of 'actor'"),
])
def test_impossible_placements_are_one_line_errors(overrides, workers, message):
    with pytest.raises(PlanError) as info:
        _plan(overrides, workers)
    assert message in str(info.value)
    assert str(info.value).startswith(str(PPO))


def test_plan_command_reports_an_impossible_placement_with_exit_2():
    result = CliRunner().invoke(main, ["plan", str(PPO), "--workers", "1",
                                       "--strategy", "disaggregated"])
    assert result.exit_code == 2
    assert "disaggregated needs at least 2 workers" in result.output
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- gangs


def _train_rank(rank: int, world: int, port: int, model_dir: str, batch: dict,
                results, algorithm_settings: dict, stage_type: str = "train_actor",
                stage_params: dict | None = None) -> None:
    """One rank of a gang training the actor on ``batch`` (or alone when world is 1)."""
    from rlhfflow.config.spec import AlgorithmSpec
    from rlhfflow.engine.parallel import join_gang
    from rlhfflow.stages import ModelConfig, ModelStore, StageContext, create_stage

    torch.set_num_threads(1)
    gang = None
    if world > 1:
        gang = join_gang(tuple(f"w{i}" for i in range(world)), f"w{rank}", "127.0.0.1",
                         port, 60.0)
    store = ModelStore({"actor": ModelConfig("actor", "lm", model_dir, trainable=True,
                                             optimizer={"lr": 1e-2, "grad_clip": 1.0})})
    algorithm = AlgorithmSpec(**algorithm_settings)
    stage = create_stage(stage_type, stage_type, stage_params or {"epochs": 2,
                                                                  "minibatches": 2},
                         algorithm, "actor")
    ctx = StageContext(iteration=0, seed=0, models=store, algorithm=algorithm, gang=gang)
    metrics = stage.run(batch, ctx)
    weights = torch.cat([p.detach().flatten() for p in store.get("actor").module.parameters()])
    # numpy, not a tensor: torch would share the tensor's memory with the parent through
    # a file descriptor that dies with this process
    results.put((rank, weights.numpy().copy(), metrics))


def _train(world: int, model_dir, batch, algorithm_settings: dict, *stage) -> list:
    # forks of the fork server the embedded cluster's workers come from (it imported torch
    # and the stages once), as gang ranks are in a run; a spawned rank imports them again,
    # ~10 s a process on 2 cores
    ctx = mp.get_context("forkserver" if start_fork_server() else "spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_train_rank,
                         args=(rank, world, port, str(model_dir), batch, results,
                               algorithm_settings, *stage))
             for rank in range(world)]
    for p in procs:
        p.start()
    out = sorted(((rank, torch.from_numpy(w), m) for rank, w, m in
                  (results.get(timeout=120) for _ in procs)), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return out


@pytest.mark.parametrize(("algorithm_settings", "weights_atol"), [
    # a rank runs its shard's distinct prompts and length groups (response_logits), the
    # lone worker the whole minibatch's: other matrix shapes, so logits differ by float
    # rounding (~1e-7), which Adam's normalised steps at lr 1e-2 turn into weight
    # differences of up to 1.1e-4 after four steps (measured: 1.0e-4, 2.3e-5, 7.5e-6);
    # a wrong divisor or pairing shows in the grad norm and the losses, checked to 1e-4
    ({"loss_agg": "seq-mean-token-mean", "entropy_coef": 0.01, "kl_coef": 0.1,
      "kl_in": "loss"}, 3e-4),
    ({"loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": 4.0, "entropy_coef": 0.01,
      "kl_coef": 0.1, "kl_in": "loss", "importance_sampling_level": "sequence",
      "dual_clip": 3.0}, 3e-4),
    ({"loss_agg": "token-sum", "kl_coef": 0.1, "kl_in": "loss"}, 3e-4),
], ids=["seq-mean-token-mean", "gspo-token-sum-norm", "token-sum"])
def test_a_two_rank_gang_makes_the_same_update_as_one_worker(tiny_lm_dir, tokenizer,
                                                              algorithm_settings, weights_atol):
    """gloo all-reduce of gradients scaled by the whole minibatch's divisors equals the
    single-worker update on the whole batch, for every loss aggregation (policy, KL and
    entropy terms alike) and with uneven masks (up to float rounding)."""
    gen = torch.Generator().manual_seed(0)
    batch = make_prompt_batch(tokenizer, ["abc", "hello there", "x", "vowels please", "ok"],
                              samples=2)
    rows = len(batch["prompt_ids"])
    length = 6
    batch["response_ids"] = torch.randint(3, 40, (rows, length), generator=gen)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    batch["response_mask"] = (torch.arange(length)[None] < lengths[:, None]).to(torch.int8)
    batch["old_logprobs"] = -torch.rand(rows, length, generator=gen) * 3
    batch["ref_logprobs"] = -torch.rand(rows, length, generator=gen) * 3
    batch["advantages"] = torch.randn(rows, length, generator=gen)
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    [(_, alone, alone_metrics)] = _train(1, tiny_lm_dir, batch, algorithm_settings)
    ranks = _train(2, tiny_lm_dir, batch, algorithm_settings)
    for _, weights, metrics in ranks:
        assert (weights - alone).abs().max() < weights_atol
        assert metrics["grad_norm"] == pytest.approx(alone_metrics["grad_norm"], rel=1e-4)
        for key in ("policy_loss", "kl_loss", "entropy", "clip_frac") & metrics.keys():
            assert metrics[key] == pytest.approx(alone_metrics[key], rel=1e-3, abs=1e-6), key
    assert torch.equal(ranks[0][1], ranks[1][1])  # the replicas stay identical


@pytest.mark.parametrize("stage_type", ["train_dpo_online", "train_sft"])
def test_a_two_rank_gang_makes_the_same_dpo_and_sft_update_as_one_worker(
        tiny_lm_dir, tokenizer, stage_type):
    """Three DPO pairs (or three selected rows) in two minibatches: one minibatch holds a
    single one, so one rank's share is empty and it joins the all-reduce with nothing;
    the update is still the single worker's."""
    gen = torch.Generator().manual_seed(0)
    batch = make_prompt_batch(tokenizer, ["abc", "hello there", "x"], samples=2)
    rows, length = len(batch["prompt_ids"]), 6
    batch["response_ids"] = torch.randint(3, 40, (rows, length), generator=gen)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    batch["response_mask"] = (torch.arange(length)[None] < lengths[:, None]).to(torch.int8)
    batch["ref_logprobs"] = -torch.rand(rows, length, generator=gen) * 3
    batch["scores"] = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.3, 0.4])
    batch["score_valid"] = torch.ones(rows, dtype=torch.int8)
    batch["selected"] = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.int8)
    batch["policy_version"] = torch.zeros(rows, dtype=torch.long)
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    stage = (stage_type, {"epochs": 2, "minibatches": 2})
    [(_, alone, alone_metrics)] = _train(1, tiny_lm_dir, batch, {}, *stage)
    ranks = _train(2, tiny_lm_dir, batch, {}, *stage)
    loss = "dpo_loss" if stage_type == "train_dpo_online" else "sft_loss"
    for _, weights, metrics in ranks:
        # Adam's four steps at lr 1e-2 amplify float rounding (other matrix shapes per
        # rank, see above) to ~1.1e-4 here (measured); a wrong divisor shows in the grad
        # norm, a wrong pairing in the loss
        assert (weights - alone).abs().max() < 3e-4
        assert metrics["grad_norm"] == pytest.approx(alone_metrics["grad_norm"], rel=1e-4)
        assert metrics[loss] == pytest.approx(alone_metrics[loss], rel=1e-4)
    assert torch.equal(ranks[0][1], ranks[1][1])


def _nan_step_rank(rank: int, port: int, model_dir: str, results) -> None:
    """One rank of a two-rank gang: a step where only rank 1's loss is NaN, then one
    where both are finite."""
    from rlhfflow.engine.parallel import join_gang
    from rlhfflow.stages import ModelConfig, ModelStore

    torch.set_num_threads(1)
    gang = join_gang(("w0", "w1"), f"w{rank}", "127.0.0.1", port, 60.0)
    resident = ModelStore({"actor": ModelConfig(
        "actor", "lm", model_dir, trainable=True,
        optimizer={"lr": 1e-2, "skip_nonfinite": 1})}).get("actor")
    ids = torch.tensor([[1, 5, 9, 4 + rank]])

    def loss() -> torch.Tensor:
        logits = resident.module(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]) / 2

    def weights() -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in resident.module.parameters()])

    before = weights()
    norm = resident.step(loss() * (float("nan") if rank == 1 else 1.0), gang)
    skipped = (norm != norm, resident.skipped_steps, torch.equal(weights(), before))
    resident.step(loss(), gang)
    results.put((rank, skipped, weights().numpy().copy()))


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(tiny_lm_dir):
    """Whether a rank's loss is finite travels with the gradients (one collective per
    step): every rank skips the step together, and the next step goes on in step."""
    ctx = mp.get_context("forkserver" if start_fork_server() else "spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_nan_step_rank, args=(rank, port, str(tiny_lm_dir), results))
             for rank in range(2)]
    for p in procs:
        p.start()
    out = sorted((results.get(timeout=120) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for _, skipped, _ in out:
        assert skipped == (True, 1, True)  # NaN norm, counted, weights untouched
    assert (out[0][2] == out[1][2]).all()  # the next step: the same update on both


# --------------------------------------------------------------------------- runs




def _actor_weights(out) -> torch.Tensor:
    module, _ = load_model(os.path.join(out, "models", "actor", "final"), "lm")
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.slow
def test_placement_changes_speed_never_results(cluster, tmp_path):
    """Same seed, on-policy, 2 workers, 2 iterations: same rewards, same final actor,
    whatever the strategy, including the one the planner chooses (auto)."""
    runs = {}
    for strategy in ("colocated", "interleaved", "disaggregated", "auto"):
        (tmp_path / strategy).mkdir()
        path = small_pipeline(tmp_path / strategy, "ppo", iterations=2, overrides={
            "placement.strategy": strategy, "cluster.address": cluster.scheduler_address})
        result = run_pipeline(load_pipeline(path), progress=False, overwrite=True)
        runs[strategy] = (result.metrics, _actor_weights(result.output_dir))
    base_metrics, base_weights = runs["colocated"]
    for strategy, (metrics, weights) in runs.items():
        assert [m["reward_mean"] for m in metrics] == [m["reward_mean"] for m in base_metrics]
        assert (weights - base_weights).abs().max() < 1e-4, strategy
    moved = [m["realloc_bytes"] for m in runs["disaggregated"][0]]
    assert moved == [moved[0]] * 2 and moved[0] > 0
    assert all(m["realloc_bytes"] == 0 for m in runs["colocated"][0])
    assert "realloc" in runs["disaggregated"][0][-1]["stage_s"]


@pytest.mark.slow
def test_deepspeed_zero2_trains_the_actor_like_the_torch_backend(cluster, tmp_path):
    """ZeRO-2 on a 2-worker gang inside a real run: same rewards as the torch backend,
    an actor within float rounding of it, ZeRO shards per rank in the checkpoint, and
    checkpoint weights that load back as a plain transformers model."""
    runs = {backend: (result, _actor_weights(result.output_dir))
            for backend, result in torch_and_deepspeed_runs(cluster, tmp_path).items()}
    (torch_run, torch_weights), (ds_run, ds_weights) = runs["torch"], runs["deepspeed"]
    assert [m["reward_mean"] for m in ds_run.metrics] == \
        pytest.approx([m["reward_mean"] for m in torch_run.metrics], abs=1e-6)
    assert (ds_weights - torch_weights).abs().max() < 1e-4
    [checkpoint] = sorted((ds_run.output_dir / "checkpoints").iterdir())
    shards = sorted(p.name for p in (checkpoint / "optimizers").iterdir())
    assert shards == ["actor.zero-rank0.pt", "actor.zero-rank1.pt", "critic.pt"]
    module, _ = load_model(checkpoint / "models" / "actor", "lm")
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    assert torch.equal(weights, ds_weights)


def test_a_lock_left_by_a_killed_extension_build_is_removed_a_fresh_one_kept(tmp_path,
                                                                            capsys):
    """torch waits forever for a build's lock file to vanish: DeepSpeed's first run
    killed mid-compile would otherwise hang every later run."""
    import os
    import time

    from rlhfflow.engine.parallel import STALE_BUILD_LOCK_S, clear_stale_build_locks

    old, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir()
        lock.touch()
    then = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(old, (then, then))
    assert clear_stale_build_locks(tmp_path) == [old]
    assert not old.exists() and fresh.exists()
    assert "interrupted build" in capsys.readouterr().err
    assert clear_stale_build_locks(tmp_path / "missing") == []
