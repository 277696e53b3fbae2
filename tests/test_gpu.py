"""What differs on a GPU: the CPU tests' claims, checked again on CUDA.

Every test but the last is marked ``gpu`` and skipped where ``torch.cuda.is_available()``
is False; ``make gpu-check`` (``gpu/check.py``) runs them with ``pytest -m gpu`` on a lent
GPU machine and records each outcome. Each one repeats a CPU test's claim where CUDA
takes other code paths: other kernels (SDPA, ``rms_norm``, cuBLAS, which need not give
CPU's bits), autocast on another device type, NCCL instead of gloo, and the embedded
cluster handing each worker its own GPU. The last test runs everywhere: it simulates a
CUDA build to check that the fork server's imports leave CUDA uninitialised.
``RLHFFLOW_GPU_TEST_DEVICE=cpu`` runs the tests that can on the CPU instead, which proves
the tests (not the GPU) before a GPU is lent.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlhfflow.engine import lean
from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model, save_model
from rlhfflow.stages import ModelConfig, ModelStore, StageContext, concat_batches, create_stage
from tests.conftest import REPO, make_prompt_batch, padded_ids, peaked_model, small_pipeline

CUDA = torch.cuda.is_available()
#: Where the tests run: ``cuda``; ``RLHFFLOW_GPU_TEST_DEVICE=cpu`` runs them on the CPU,
#: which checks the tests themselves (``make gpu-check GPU=0``), not the GPU.
DEVICE = os.environ.get("RLHFFLOW_GPU_TEST_DEVICE", "cuda")
needs_cuda = pytest.mark.skipif(DEVICE == "cuda" and not CUDA, reason="no CUDA device")
needs_real_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")

TEXTS = ["describe the sun:", "a", "talk about a fire and a rain:", "hello there",
         "speak of the star:", "x y z"]
DRAFTERS = {
    "ngram": {"drafter": "ngram", "ngram_min": 1},
    "layers": {"drafter": "layers", "draft_layers": 1},
    "model": {"drafter": "model", "draft_model": "draft"},
}


@pytest.fixture(scope="module")
def cuda_store(tmp_path_factory) -> ModelStore:
    """A peaked actor and draft model, and a plain tiny actor, resident on the GPU."""
    root = tmp_path_factory.mktemp("gpu")
    tok = build_char_tokenizer()
    save_model(peaked_model(tok, 0), tok, root / "actor")
    save_model(peaked_model(tok, 1), tok, root / "draft")
    save_model(build_tiny_model(tok, "lm", seed=0), tok, root / "plain")
    return ModelStore({name: ModelConfig(name, "lm", str(root / name))
                       for name in ("actor", "draft", "plain")}, device=DEVICE)


def _generate(store, batch, model="actor", seed=0, **params):
    stage = create_stage("generate", params={"max_new_tokens": 16, **params}, model=model)
    return stage.run(batch, StageContext(iteration=0, seed=seed, models=store))


# --------------------------------------------------------------------------- the lean forward


@pytest.mark.gpu
@needs_real_cuda
def test_a_cuda_model_keeps_transformers_forward_by_default():
    model = build_tiny_model(build_char_tokenizer()).cuda()
    assert "cuda" in lean.unsupported(model)
    assert not lean.enable(model)


@pytest.mark.gpu
@needs_cuda
def test_the_lean_forward_on_cuda_matches_transformers_within_float_rounding(monkeypatch):
    """Switched on for CUDA (``lean.DEVICES``): logits, gradients and cached decoding
    within float rounding of transformers' modules on the same GPU (on CPU they are
    bitwise equal; CUDA's SDPA and norms may pick other kernels)."""
    monkeypatch.setattr(lean, "DEVICES", frozenset({"cpu", "cuda"}))
    model = build_tiny_model(build_char_tokenizer(), n_layer=2, hidden=32, n_head=4).to(DEVICE)
    fast = copy.deepcopy(model)
    assert lean.enable(fast)
    ids, mask, pos = (t.to(DEVICE) for t in padded_ids(length=20))
    real = mask.bool()
    model.train()
    fast.train()
    outs = [m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            for m in (model, fast)]
    torch.testing.assert_close(outs[1][real], outs[0][real], atol=1e-4, rtol=1e-4)
    for out in outs:
        out.logsumexp(-1)[real].sum().backward()
    for (name, p), q in zip(model.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, msg=name)
    from transformers import DynamicCache

    model.eval()
    fast.eval()
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    with torch.no_grad():
        for start, end in ((0, 10), (10, 13), (13, 16), (16, 20)):
            step = [m(input_ids=ids[:, start:end], attention_mask=mask[:, :end],
                      position_ids=pos[:, start:end], use_cache=True,
                      **{lean.cache_keyword(type(model).forward): c}).logits
                    for m, c in zip((model, fast), caches, strict=True)]
            torch.testing.assert_close(step[1], step[0], atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- generation


@pytest.mark.gpu
@needs_cuda
def test_greedy_generation_gives_transformers_generate_tokens_on_cuda(cuda_store):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=1)
    steps = 16
    ours = _generate(cuda_store, batch, greedy=True, max_new_tokens=steps)
    module = cuda_store.get("actor").module
    with torch.no_grad():
        theirs = module.generate(input_ids=batch["prompt_ids"].to(DEVICE),
                                 attention_mask=batch["prompt_mask"].long().to(DEVICE),
                                 max_new_tokens=steps, do_sample=False,
                                 eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id).cpu()
    new = theirs[:, batch["prompt_ids"].shape[1]:]
    new = torch.nn.functional.pad(new, (0, steps - new.shape[1]), value=tok.pad_token_id)
    is_eos = new == tok.eos_token_id
    lengths = torch.where(is_eos.any(-1), is_eos.long().argmax(-1) + 1, steps)
    assert torch.equal(ours["response_mask"].sum(-1).long(), lengths)
    mask = ours["response_mask"].bool()
    assert torch.equal(ours["response_ids"][mask], new[mask])


@pytest.mark.gpu
@needs_cuda
def test_sampling_is_reproducible_per_row_seed_on_cuda(cuda_store):
    """A row's sample depends on its seed alone: the same call repeats it, another seed
    changes it, and the same prompts in another order and other calls (other padding
    widths, other batch shapes) give each row the same tokens."""
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=2)
    whole = _generate(cuda_store, batch, model="plain", temperature=1.0)
    again = _generate(cuda_store, batch, model="plain", temperature=1.0)
    other = _generate(cuda_store, batch, model="plain", seed=1, temperature=1.0)
    assert torch.equal(whole["response_ids"], again["response_ids"])
    assert not torch.equal(whole["response_ids"], other["response_ids"])
    order = [4, 1, 5, 0, 3, 2]
    first = make_prompt_batch(tok, [TEXTS[i] for i in order[:2]], 2, order[:2])
    second = make_prompt_batch(tok, [TEXTS[i] for i in order[2:]], 2, order[2:])
    parts = concat_batches([_generate(cuda_store, first, model="plain", temperature=1.0),
                            _generate(cuda_store, second, model="plain", temperature=1.0)])
    index = concat_batches([first, second])
    rows = {(p, s): i for i, (p, s) in enumerate(zip(
        batch["prompt_index"].tolist(), batch["sample_index"].tolist(), strict=True))}
    for j, key in enumerate(zip(index["prompt_index"].tolist(),
                                index["sample_index"].tolist(), strict=True)):
        i = rows[key]
        assert torch.equal(parts["response_ids"][j], whole["response_ids"][i]), key
        torch.testing.assert_close(parts["sample_logprobs"][j], whole["sample_logprobs"][i],
                                   atol=1e-4, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_speculation_gives_the_plain_tokens_on_cuda(cuda_store, drafter):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=2)
    plain = _generate(cuda_store, batch, greedy=True, compact=False)
    spec = _generate(cuda_store, batch, greedy=True, **DRAFTERS[drafter])
    assert torch.equal(spec["response_ids"], plain["response_ids"])
    assert torch.equal(spec["response_mask"], plain["response_mask"])
    torch.testing.assert_close(spec["sample_logprobs"], plain["sample_logprobs"],
                               atol=1e-4, rtol=0)
    assert int(spec["gen_drafted"].sum()) > 0  # it did speculate


# --------------------------------------------------------------------------- training


def _resident(path, dtype: str):
    config = ModelConfig("actor", "lm", str(path), trainable=True, dtype=dtype,
                         optimizer={"lr": 1e-5, "grad_clip": 1.0})
    return ModelStore({"actor": config}, device=DEVICE).get("actor")


def _lm_loss(resident) -> torch.Tensor:
    tok = build_char_tokenizer()
    enc = tok(["speak of the sun and the rain", "a leaf"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].to(DEVICE), enc["attention_mask"].to(DEVICE)
    logits = resident.module(input_ids=ids, attention_mask=mask).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _changed_fraction(resident, steps: int) -> float:
    before = {k: v.detach().float().clone() for k, v in resident.module.named_parameters()}
    for _ in range(steps):
        resident.step(_lm_loss(resident))
    changed = sum(int((p.detach().float() != before[k]).sum())
                  for k, p in resident.module.named_parameters())
    return changed / sum(v.numel() for v in before.values())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_steps_on_cuda_move_the_fp32_weights_like_fp32(tiny_lm_dir, dtype):
    """bf16 autocast (and fp16 with loss scaling) on CUDA: fp32 master weights, a forward
    computed in the low precision, every update kept (as fp32 keeps them), no NaN."""
    mixed = _resident(tiny_lm_dir, dtype)
    assert all(p.dtype == torch.float32 and p.device.type == DEVICE
               for p in mixed.module.parameters())
    seen = []
    hook = mixed.module.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, out: seen.append(out.dtype))
    assert _lm_loss(mixed).dtype == torch.float32
    hook.remove()
    assert seen == [getattr(torch, dtype)]
    in_fp32 = _changed_fraction(_resident(tiny_lm_dir, "float32"), 3)
    assert in_fp32 > 0.95
    assert _changed_fraction(mixed, 3) == pytest.approx(in_fp32, abs=0.01)
    assert all(torch.isfinite(p).all() for p in mixed.module.parameters())
    if dtype == "float16":
        assert mixed.scaler is not None and mixed.overflow_steps <= 1


@pytest.mark.gpu
@needs_cuda
def test_a_grpo_iteration_trains_in_bf16_through_the_stages_on_cuda(tmp_path):
    """The train stage path: generate, score, advantages and train_actor on the GPU with
    a bf16 mixed-precision actor (one in-process worker)."""
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.runtime.run import run_pipeline

    path = small_pipeline(tmp_path, "grpo", iterations=2, overrides={
        "cluster.device": DEVICE, "models.actor.dtype": "bfloat16"})
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    losses = [m["policy_loss"] for m in result.metrics]
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # no NaN
    from rlhfflow.engine.models import load_model

    init, _ = load_model(result.output_dir / "models" / "actor" / "init", "lm")
    final, _ = load_model(result.output_dir / "models" / "actor" / "final", "lm")
    moved = [not torch.equal(a, b) for a, b in zip(init.parameters(), final.parameters(),
                                                   strict=True)]
    assert sum(moved) > len(moved) // 2
    assert all(torch.isfinite(p).all() for p in final.parameters())


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.gpu
@needs_cuda
def test_a_checkpoint_saved_on_cuda_resumes_exactly(tmp_path):
    """As tests/runtime/test_resume.py on CPU: 3 iterations, a checkpoint, 2 more after a resume,
    the same results as 5 in one go. cuBLAS and some backward kernels are not
    deterministic by default (atomics): deterministic algorithms are asked for, so a
    difference is the resume's, not the GPU's."""
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.runtime.run import run_pipeline
    from rlhfflow.storage import MetricsLog

    keys = ("iteration", "samples", "reward_mean", "reward_std", "kl_mean", "policy_loss",
            "value_loss", "clip_frac", "response_length_mean", "tokens_generated")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        def pipeline(name: str, iterations: int):
            (tmp_path / name).mkdir(exist_ok=True)
            return small_pipeline(tmp_path / name, iterations=iterations, overrides={
                "cluster.device": DEVICE, "checkpoint.every": 2, "checkpoint.keep": 2})

        def results(name):
            return [{k: r[k] for k in keys}
                    for r in MetricsLog(tmp_path / name / "out" / "metrics.jsonl").read()]

        stopped = pipeline("a", 3)
        run_pipeline(load_pipeline(stopped), progress=False, inline=True)
        resumed = run_pipeline(load_pipeline(stopped, {"iterations": 5}), progress=False,
                               inline=True)
        assert [r["iteration"] for r in resumed.metrics] == [3, 4]
        run_pipeline(load_pipeline(pipeline("b", 5)), progress=False, inline=True)
        if results("a") != results("b"):  # the resume's fault, or the GPU's?
            run_pipeline(load_pipeline(pipeline("c", 5)), progress=False, inline=True)
            assert results("b") == results("c"), \
                "two uninterrupted runs differ: this GPU's kernels are not deterministic"
    finally:
        torch.use_deterministic_algorithms(was)
    assert results("a") == results("b")


# --------------------------------------------------------------------------- the cluster


def _worker_view() -> dict:
    """What a device worker sees of CUDA (runs on the worker)."""
    from rlhfflow.runtime.worker.host import worker_device

    x = torch.ones(4, device="cuda") * 2
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "count": torch.cuda.device_count(), "device": worker_device("auto"),
            "sum": float(x.sum()), "name": torch.cuda.get_device_name(0)}


@pytest.mark.gpu
@needs_real_cuda
def test_the_embedded_cluster_gives_each_worker_its_own_gpu():
    from distributed import Client

    from rlhfflow.runtime.cluster import local_cluster

    gpus = torch.cuda.device_count()
    with local_cluster(gpus + 1, dashboard_address="127.0.0.1:0", torch_threads=1,
                       device="cuda") as cluster, Client(cluster) as client:
        client.wait_for_workers(gpus, timeout=120)
        views = client.run(_worker_view)
    assert len(views) == gpus  # one worker per GPU, however many were asked for
    assert sorted(v["visible"] for v in views.values()) == [str(i) for i in range(gpus)]
    for view in views.values():
        assert view["count"] == 1 and view["device"] == "cuda" and view["sum"] == 8.0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_zero_trains_the_actor_on_one_gpu_like_the_torch_backend(tmp_path,
                                                                         zero_stage):
    """ZeRO on a gang of one GPU worker (NCCL) inside a real run: the same first
    iteration as the torch backend, an actor within float tolerance of it after two,
    and a checkpoint whose weights load back as a plain transformers model."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the GPU kit has it)")
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.engine.models import load_model
    from rlhfflow.runtime.run import run_pipeline

    runs = {}
    for backend in ("torch", "deepspeed"):
        (tmp_path / backend).mkdir()
        overrides = {"placement.strategy": "colocated", "cluster.workers": 1,
                     "cluster.device": DEVICE}
        if backend == "deepspeed":
            overrides.update({"stages.train_actor.backend": "deepspeed",
                              "stages.train_actor.deepspeed": {"zero_stage": zero_stage}})
        path = small_pipeline(tmp_path / backend, "ppo", iterations=2, overrides=overrides)
        result = run_pipeline(load_pipeline(path), progress=False, overwrite=True)
        module, _ = load_model(result.output_dir / "models" / "actor" / "final", "lm")
        runs[backend] = (result, torch.cat([p.detach().flatten() for p in module.parameters()]))
    (torch_run, torch_weights), (ds_run, ds_weights) = runs["torch"], runs["deepspeed"]
    assert ds_run.metrics[0]["reward_mean"] == pytest.approx(
        torch_run.metrics[0]["reward_mean"], abs=1e-6)
    assert (ds_weights - torch_weights).abs().max() < 1e-3
    [checkpoint] = sorted((ds_run.output_dir / "checkpoints").iterdir())
    assert (checkpoint / "optimizers" / "actor.zero-rank0.pt").is_file()


# --------------------------------------------------------------------------- everywhere


def test_the_fork_servers_imports_leave_cuda_uninitialised():
    """The embedded cluster forks its workers from a server that imported torch and the
    stages, then sets each worker's ``CUDA_VISIBLE_DEVICES``. ``torch.cuda.is_available()``
    initialises the CUDA driver (``cudaGetDeviceCount``) unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and a driver initialised before a fork is unusable
    in the child. Simulated on any machine: a CUDA build is faked, and every call of
    ``cudaGetDeviceCount`` during the server's imports is recorded."""
    probe = textwrap.dedent("""
        import traceback, torch, torch.cuda
        calls = []
        torch.cuda._is_compiled = lambda: True
        torch.cuda._device_count_nvml = lambda: 1
        def count():
            calls.append("".join(traceback.format_stack(limit=8)))
            return 1
        torch._C._cuda_getDeviceCount = count
        from rlhfflow.runtime.worker.preload import warm
        warm()
        print("\\n".join(calls) or "none")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "none", done.stdout
