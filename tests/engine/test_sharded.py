"""Sharded training (``backend: fsdp``, torch FSDP2 over a gang): the same learning as the
unsharded trainer, checkpoints that resume exactly and load as transformers models, the
new weights reallocated to a generating shadow after each update, and what validation
refuses. Real Dask workers, a real gloo process group, tiny models."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhfflow.config.loader import load_pipeline
from rlhfflow.engine.models import load_model
from rlhfflow.errors import SpecError
from rlhfflow.plan.auto.planner import resolve_plan
from rlhfflow.plan.placement import PlanError
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage import ExperienceBuffer
from tests.conftest import CONFIGS, small_pipeline

GRPO = CONFIGS / "grpo-tiny.yaml"
#: one generating worker (the shadow) and a train group of two (the gang)
DISAGGREGATED = {"placement.strategy": "disaggregated", "placement.groups":
                 {"rollout": [0], "train": [1, 2]}}
COMPARED = ("reward_mean", "kl_mean", "policy_loss", "clip_frac", "tokens_generated")
#: adapters on every Linear of the actor (the tiny demo's output head among them)
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def cluster3():
    """Three device workers in their own processes: a shadow and a gang of two."""
    from rlhfflow.runtime.cluster import local_cluster

    with local_cluster(3, dashboard_address="127.0.0.1:0", torch_threads=1) as cluster:
        yield cluster


def _run(cluster, tmp_path: Path, backend: str, iterations: int = 4,
         overrides: dict | None = None, name: str | None = None, overwrite: bool = True):
    name = name or backend
    (tmp_path / name).mkdir(exist_ok=True)
    settings = {**DISAGGREGATED, "cluster.address": cluster.scheduler_address,
                "stages.train_actor.backend": backend, "cluster.collective_timeout_s": 120,
                "checkpoint.every": 1, **(overrides or {})}
    path = small_pipeline(tmp_path / name, "grpo", iterations=iterations,
                          overrides=settings, file_name="grpo.yaml")
    return run_pipeline(load_pipeline(path), progress=False, overwrite=overwrite)


@pytest.fixture(scope="module")
def runs(cluster3, tmp_path_factory):
    """The 4-iteration GRPO run, its actor trained unsharded (``torch``, the gang's
    data-parallel trainer) and sharded (``fsdp``)."""
    tmp_path = tmp_path_factory.mktemp("runs")
    return {b: _run(cluster3, tmp_path, b) for b in ("torch", "fsdp")}


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    module, _ = load_model(directory, "lm")
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_sharded_trainer_learns_as_the_unsharded_one_and_feeds_its_shadow(runs):
    """GRPO, 4 iterations, the actor trained on a gang of two and generating on a third
    worker: with the actor sharded (FSDP2) every iteration's metrics and sampled tokens
    are those of the unsharded gang, the final weights agree to float rounding, and the
    shadow got each update's weights (its samples are the unsharded run's) with their
    bytes and time reported."""
    for key in COMPARED:
        assert [m[key] for m in runs["fsdp"].metrics] == pytest.approx(
            [m[key] for m in runs["torch"].metrics], rel=1e-4, abs=1e-6), key
    norms = {b: [m["train"]["train_actor"]["grad_norm"] for m in r.metrics]
             for b, r in runs.items()}
    assert norms["fsdp"] == pytest.approx(norms["torch"], rel=1e-4)
    finals = {b: _weights(r.output_dir / "models" / "actor" / "final") for b, r in runs.items()}
    init = _weights(runs["torch"].output_dir / "models" / "actor" / "init")
    moved = torch.cat([(finals["torch"][k] - init[k]).flatten() for k in init])
    apart = torch.cat([(finals["fsdp"][k] - finals["torch"][k]).flatten() for k in init])
    # AdamW steps of lr size, and the same sums in another order: 2e-4 of the way moved
    assert apart.norm() < 1e-3 * moved.norm()
    # the shadow sampled each iteration from what the trainer had after the update before:
    # the same tokens as the unsharded run's shadow, which got the whole weights
    buffers = {b: ExperienceBuffer(r.output_dir / "buffer.zarr") for b, r in runs.items()}
    for k in range(1, 4):
        rows = {b: buf.read(k, ["response_ids", "sample_logprobs", "response_mask"])
                for b, buf in buffers.items()}
        assert (rows["fsdp"]["response_ids"] == rows["torch"]["response_ids"]).all()
        mask = rows["torch"]["response_mask"].astype(bool)
        logprobs = {b: r["sample_logprobs"][mask] for b, r in rows.items()}
        assert abs(logprobs["fsdp"] - logprobs["torch"]).max() < 1e-3
    nbytes = sum(t.numel() * t.element_size() for t in init.values())
    for m in runs["fsdp"].metrics:
        assert m["realloc_bytes"] == nbytes and m["realloc_s"] > 0


def test_a_sharded_run_checkpoints_and_resumes_exactly(runs, cluster3, tmp_path):
    """Every rank saves its part of the optimizer state, rank 0 the gathered weights as a
    transformers model; a run stopped after 2 iterations and resumed to 4 has the metrics
    and final weights of the uninterrupted one."""
    whole = runs["fsdp"]
    [*_, last] = sorted((whole.output_dir / "checkpoints").iterdir())
    assert sorted(p.name for p in (last / "optimizers").iterdir()) == \
        ["actor.zero-rank0.pt", "actor.zero-rank1.pt"]
    final = _weights(whole.output_dir / "models" / "actor" / "final")
    assert _max_difference(_weights(last / "models" / "actor"), final) == 0.0

    _run(cluster3, tmp_path, "fsdp", iterations=2, name="stopped")
    resumed = _run(cluster3, tmp_path, "fsdp", iterations=4, name="stopped", overwrite=False)
    assert [m["iteration"] for m in resumed.metrics] == [2, 3]
    for key in COMPARED:
        assert [m[key] for m in resumed.metrics] == [m[key] for m in whole.metrics[2:]], key
    again = _weights(resumed.output_dir / "models" / "actor" / "final")
    assert _max_difference(again, final) == 0.0


def test_gradient_checkpointing_on_a_sharded_model_changes_no_result(runs, cluster3, tmp_path):
    """Each sharded layer's activations recomputed in the backward pass (FSDP gathers its
    weights again for it): the metrics and final weights of the sharded run without it."""
    recomputed = _run(cluster3, tmp_path, "fsdp", overrides={
        "models.actor.gradient_checkpointing": True})
    for key in COMPARED:
        assert [m[key] for m in recomputed.metrics] == pytest.approx(
            [m[key] for m in runs["fsdp"].metrics], rel=1e-5, abs=1e-7), key
    final = _weights(recomputed.output_dir / "models" / "actor" / "final")
    assert _max_difference(final, _weights(runs["fsdp"].output_dir / "models" / "actor" /
                                           "final")) < 1e-6


def _plan(overrides: dict, workers: int):
    return resolve_plan(load_pipeline(GRPO, {"stages.train_actor.backend": "fsdp",
                                             **overrides}), workers)


def test_a_sharded_model_is_used_only_by_its_training_where_it_lives():
    with pytest.raises(PlanError, match="placement.stages.generate: stage 'generate' uses "
                                        "model 'actor', sharded on workers"):
        _plan({"placement.strategy": "colocated"}, 2)
    plan = _plan({}, 3)  # auto: the plan that generates on a shadow
    assert plan.strategy == "disaggregated" and plan.stages["train_actor"].gang
    assert plan.stages["generate"].shadow


def test_sharding_over_one_worker_is_refused():
    with pytest.raises(PlanError, match=r"stages.train_actor.backend: backend: fsdp shards "
                                        r"model 'actor' over its workers, and it has one"):
        _plan({"placement.strategy": "disaggregated"}, 2)


def test_zero3_over_more_than_one_worker_is_refused_for_fsdp():
    """DeepSpeed's ZeRO-3 leaves each rank a slice of every weight, which the other
    stages' forwards and the transfers to shadows read whole (a colocated run hung):
    refused where it would partition (a gang of 2), kept on one worker (tests/test_gpu.py
    trains it there on a GPU)."""
    zero3 = {"stages.train_actor.backend": "deepspeed",
             "stages.train_actor.deepspeed": {"zero_stage": 3}}
    for strategy, workers in (("colocated", 2), ("disaggregated", 3)):
        with pytest.raises(PlanError, match=r"stages.train_actor.deepspeed.zero_stage: ZeRO-3 "
                                            r"partitions model 'actor' over workers .* "
                                            r"backend: fsdp"):
            resolve_plan(load_pipeline(GRPO, {**zero3, "placement.strategy": strategy}),
                         workers)
    plan = resolve_plan(load_pipeline(GRPO, {**zero3, "placement.strategy": "colocated"}), 1)
    assert plan.homes["actor"] == (0,)


@pytest.mark.parametrize(("overrides", "key", "says"), [
    ({"models.actor.dtype": "float16"}, "models.actor.dtype", "no loss scaling"),
    ({"stages.generate.backend": "fsdp"}, "stages.generate.backend", "trains in the loop"),
])
def test_sharding_with_what_it_cannot_go_with_is_refused(overrides, key, says):
    with pytest.raises(SpecError, match=f"{key}: .*{says}"):
        load_pipeline(GRPO, {"stages.train_actor.backend": "fsdp", **overrides})


def test_the_cli_refuses_an_unshardable_plan_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", "plan", str(GRPO),
                           "stages.train_actor.backend=fsdp", "--strategy", "colocated"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "placement.stages.generate" in line and "backend: fsdp" in line


def test_a_sharded_run_killed_mid_run_resumes_as_if_never_stopped(runs, tmp_path):
    """SIGKILL of the coordinator of a real ``rlhfflow run`` (its own three workers) after
    two iterations; run again, it resumes from its last checkpoint, resharding the actor
    and its AdamW parts, and ends with the uninterrupted run's metrics."""
    import psutil

    from rlhfflow.storage import MetricsLog

    (tmp_path / "killed").mkdir()
    path = small_pipeline(tmp_path / "killed", "grpo", iterations=4, file_name="grpo.yaml",
                          overrides={**DISAGGREGATED, "cluster.workers": 3,
                                     "stages.train_actor.backend": "fsdp",
                                     "cluster.collective_timeout_s": 120,
                                     "checkpoint.every": 1})
    out = tmp_path / "killed" / "out"
    command = [sys.executable, "-m", "rlhfflow.cli.main", "run", str(path)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").exists() and
               len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    psutil.wait_procs(workers, timeout=60)

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming after iteration" in again.stderr
    metrics = MetricsLog(out / "metrics.jsonl").read()
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]
    for key in COMPARED:
        assert [m[key] for m in metrics] == [m[key] for m in runs["fsdp"].metrics], key


# --------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_runs(cluster3, tmp_path_factory):
    """The 4-iteration GRPO run of a LoRA actor (its reference the resident base)
    trained on the gang of two unsharded (``torch``) and sharded (``fsdp``)."""
    pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    tmp_path = tmp_path_factory.mktemp("lora")
    return {b: _run(cluster3, tmp_path, b, name=f"lora-{b}",
                    overrides={"models.actor.lora": LORA}) for b in ("torch", "fsdp")}


def _adapters(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    assert (directory / "adapter_config.json").is_file()
    return load_file(directory / "adapter_model.safetensors")


def test_sharded_lora_learns_as_the_unsharded_lora_gang(lora_runs):
    """The frozen base and the adapters sharded over the gang (FSDP2), AdamW over the
    adapters' parts only: every iteration's metrics, gradient norms and sampled tokens
    are those of the unsharded LoRA gang; only the adapters move to the shadow; the
    checkpoints hold the adapters (peft's format, each rank's part of their moments)
    and the final model is merged, as the unsharded run's."""
    for key in COMPARED:
        assert [m[key] for m in lora_runs["fsdp"].metrics] == pytest.approx(
            [m[key] for m in lora_runs["torch"].metrics], rel=1e-4, abs=1e-6), key
    norms = {b: [m["train"]["train_actor"]["grad_norm"] for m in r.metrics]
             for b, r in lora_runs.items()}
    assert norms["fsdp"] == pytest.approx(norms["torch"], rel=1e-4)
    buffers = {b: ExperienceBuffer(r.output_dir / "buffer.zarr") for b, r in lora_runs.items()}
    for k in range(1, 4):
        ids = {b: buf.read(k, ["response_ids"])["response_ids"] for b, buf in buffers.items()}
        assert (ids["fsdp"] == ids["torch"]).all()
    lasts = {b: sorted((r.output_dir / "checkpoints").iterdir())[-1]
             for b, r in lora_runs.items()}
    adapters = {b: _adapters(last / "models" / "actor") for b, last in lasts.items()}
    assert adapters["fsdp"].keys() == adapters["torch"].keys()
    assert all("lora_" in k for k in adapters["fsdp"])
    assert any(k.endswith("lora_B.weight") and t.abs().max() > 0
               for k, t in adapters["fsdp"].items())
    assert _max_difference(adapters["fsdp"], adapters["torch"]) < 1e-4
    assert sorted(p.name for p in (lasts["fsdp"] / "optimizers").iterdir()) == \
        ["actor.zero-rank0.pt", "actor.zero-rank1.pt"]
    nbytes = sum(t.numel() * t.element_size() for t in adapters["fsdp"].values())
    for m in lora_runs["fsdp"].metrics:
        assert m["realloc_bytes"] == nbytes and m["realloc_s"] > 0
    finals = {b: _weights(r.output_dir / "models" / "actor" / "final")
              for b, r in lora_runs.items()}
    init = _weights(lora_runs["torch"].output_dir / "models" / "actor" / "init")
    moved = torch.cat([(finals["torch"][k] - init[k]).flatten() for k in init])
    apart = torch.cat([(finals["fsdp"][k] - finals["torch"][k]).flatten() for k in init])
    assert moved.norm() > 0 and apart.norm() < 1e-3 * moved.norm()


def test_a_sharded_lora_run_resumes_exactly(lora_runs, cluster3, tmp_path):
    """Stopped after 2 iterations and resumed to 4 (the adapters from the checkpoint,
    resharded, each rank's AdamW part): the uninterrupted run's metrics, adapters and
    merged final weights, exactly."""
    whole = lora_runs["fsdp"]
    lora = {"models.actor.lora": LORA}
    _run(cluster3, tmp_path, "fsdp", iterations=2, name="stopped", overrides=lora)
    resumed = _run(cluster3, tmp_path, "fsdp", iterations=4, name="stopped", overrides=lora,
                   overwrite=False)
    assert [m["iteration"] for m in resumed.metrics] == [2, 3]
    for key in COMPARED:
        assert [m[key] for m in resumed.metrics] == [m[key] for m in whole.metrics[2:]], key
    [*_, last] = sorted((resumed.output_dir / "checkpoints").iterdir())
    [*_, whole_last] = sorted((whole.output_dir / "checkpoints").iterdir())
    assert _max_difference(_adapters(last / "models" / "actor"),
                           _adapters(whole_last / "models" / "actor")) == 0.0
    final = "models/actor/final"
    assert _max_difference(_weights(resumed.output_dir / final),
                           _weights(whole.output_dir / final)) == 0.0


def test_the_base_of_a_sharded_lora_model_is_read_on_its_shadow():
    """A reference ``from:`` a sharded LoRA actor is a view of the actor's base: under
    ``disaggregated`` it runs beside generation, on the shadow's whole copy; placed on
    the gang it is refused (its forward would be on the shards)."""
    plan = _plan({"models.actor.lora": LORA, "placement.strategy": "disaggregated"}, 3)
    assert plan.stages["ref_logprob"].workers == plan.stages["generate"].workers == (0,)
    assert plan.stages["train_actor"].workers == (1, 2)
    with pytest.raises(PlanError, match=r"placement.stages.ref_logprob: stage 'ref_logprob' "
                                        r"uses model 'ref' \(the base of 'actor'\), sharded"):
        _plan({"models.actor.lora": LORA, **DISAGGREGATED,
               "placement.stages.ref_logprob": "train"}, 3)


def test_a_lora_critic_trains_sharded_as_unsharded(cluster3, tmp_path):
    """PPO with adapters on the actor and on the critic, whose value head trains in full
    beside them (peft's ``modules_to_save``), both sharded: the metrics of the
    unsharded gang, each rank's part of both models' AdamW state, the critic's
    adapters and head in its checkpoint and merged into its final model."""
    pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    runs = {}
    for backend in ("torch", "fsdp"):
        (tmp_path / backend).mkdir()
        path = small_pipeline(tmp_path / backend, "ppo", iterations=3, file_name="ppo.yaml",
                              overrides={
                                  **DISAGGREGATED, "cluster.address": cluster3.scheduler_address,
                                  "cluster.collective_timeout_s": 120, "checkpoint.every": 1,
                                  # the critic's and the actor's inference on the shadow
                                  "placement.stages.values": "rollout",
                                  "placement.stages.old_logprob": "rollout",
                                  "models.actor.lora": LORA, "models.critic.lora": LORA,
                                  "stages.train_actor.backend": backend,
                                  "stages.train_critic.backend": backend})
        runs[backend] = run_pipeline(load_pipeline(path), progress=False, overwrite=True)
    for key in ("reward_mean", "kl_mean", "policy_loss", "value_loss"):
        assert [m[key] for m in runs["fsdp"].metrics] == pytest.approx(
            [m[key] for m in runs["torch"].metrics], rel=1e-4, abs=1e-6), key
    [*_, last] = sorted((runs["fsdp"].output_dir / "checkpoints").iterdir())
    assert sorted(p.name for p in (last / "optimizers").iterdir()) == [
        "actor.zero-rank0.pt", "actor.zero-rank1.pt", "critic.zero-rank0.pt",
        "critic.zero-rank1.pt"]
    heads = {b: {k: v for k, v in _adapters(sorted((r.output_dir / "checkpoints").iterdir())[-1]
                                            / "models" / "critic").items() if "score" in k}
             for b, r in runs.items()}
    assert heads["fsdp"] and heads["fsdp"].keys() == heads["torch"].keys()
    finals = {}
    for backend, result in runs.items():
        module, _ = load_model(result.output_dir / "models" / "critic" / "final", "value")
        finals[backend] = {k: v.detach() for k, v in module.state_dict().items()}
    assert _max_difference(finals["fsdp"], finals["torch"]) < 1e-4
