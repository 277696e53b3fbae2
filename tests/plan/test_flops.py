"""Model FLOPs and MFU: the count against a hand count and torch's own FLOP counter, the
measured matmul peak and its cache, and the figures a real (inline, tiny) run reports in
metrics.jsonl, its closing line and ``rlhfflow report``."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.shapes import ModelShape, model_shapes
from rlhfflow.engine import peak
from rlhfflow.engine.models import (
    build_char_tokenizer,
    build_tiny_model,
    matmul_parameters,
    tiny_config,
    tiny_matmul_parameters,
)
from rlhfflow.monitor.report import build_report
from rlhfflow.plan.flops import (
    StageWork,
    attention_pairs,
    forward_flops,
    stage_work,
    weight_passes,
)
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage import ExperienceBuffer, MetricsLog
from tests.conftest import small_pipeline


def test_the_flops_of_the_tiny_actor_match_a_hand_count(tmp_path):
    pipeline = load_pipeline(small_pipeline(tmp_path, "grpo"))
    shape = model_shapes(pipeline)["actor"]  # tiny: {layers: 2, hidden: 64, heads: 4}
    vocab = len(build_char_tokenizer())
    # per layer q, k, v, o (4 x 64 x 64) and gate, up, down (3 x 64 x 256); the LM head
    weights = 2 * (4 * 64 * 64 + 3 * 64 * 256) + vocab * 64
    assert shape.matmul_params == weights
    # a 10-token and a 3-token sequence: 2 FLOPs per weight and token, and per layer
    # 4 x 64 per (query, key) pair: 55 and 6 pairs
    assert attention_pairs(10) == 55
    assert forward_flops(shape, [10, 3]) == 2 * weights * 13 + 2 * 4 * 64 * (55 + 6)
    passes = {w.stage: w.passes for w in stage_work(pipeline, model_shapes(pipeline))}
    # the scorer has no model; train_actor runs 2 epochs of forward + backward
    assert passes == {"generate": 1.0, "ref_logprob": 1.0, "train_actor": 6.0}


def test_a_lora_training_step_counts_no_weight_gradients_of_the_frozen_base(tmp_path,
                                                                          monkeypatch):
    pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    pipeline = load_pipeline(small_pipeline(tmp_path, "grpo",
                                            overrides={"models.actor.lora": lora}))
    shapes = model_shapes(pipeline)
    base = shapes["actor"].matmul_params
    # r x (in + out) per adapted Linear: q, k, v, o (64 -> 64), gate, up (64 -> 256),
    # down (256 -> 64), in each of the 2 layers; the LM head has none
    adapters = 2 * (4 * 4 * (64 + 64) + 3 * 4 * (64 + 256))
    assert shapes["actor"].adapters == adapters
    work = {w.stage: w for w in stage_work(pipeline, shapes)}
    tokens = 10
    # generation from merged weights and the reference are the base alone; the other
    # forwards (and generation with merge_for_generation off) multiply by the adapters too
    assert work["generate"].flops(tokens, 0) == 2 * base * tokens
    assert work["ref_logprob"].flops(tokens, 0) == 2 * base * tokens
    assert shapes["actor"].merged == 2 * (4 * 64 * 64 + 3 * 64 * 256)
    unmerged = load_pipeline(small_pipeline(tmp_path, "grpo", file_name="unmerged.yaml",
                             overrides={"models.actor.lora": {**lora,
                                                              "merge_for_generation": False}}))
    unmerged_shapes = model_shapes(unmerged)
    assert unmerged_shapes["actor"].merged == 0
    # no lean forward, no merging: mixed precision, or the lean forward switched off
    bf16 = load_pipeline(small_pipeline(tmp_path, "grpo", file_name="bf16.yaml", overrides={
        "models.actor.lora": lora, "models.actor.dtype": "bfloat16"}))
    assert model_shapes(bf16)["actor"].merged == 0
    monkeypatch.setenv("RLHFFLOW_LEAN_FORWARD", "0")
    assert model_shapes(pipeline)["actor"].merged == 0
    monkeypatch.delenv("RLHFFLOW_LEAN_FORWARD")
    generate = {w.stage: w for w in stage_work(unmerged, unmerged_shapes)}["generate"]
    assert generate.flops(tokens, 0) == 2 * (base + adapters) * tokens
    # 2 epochs of a forward, input gradients through the base, and the adapters' own
    # gradients: 4 N + 6 N_a per token, not 6 (N + N_a); attention as without LoRA
    train = work["train_actor"]
    assert train.passes == 6.0
    assert train.flops(tokens, 0) == pytest.approx(2 * (4 * base + 6 * adapters) * tokens)
    assert train.flops(0, 55) == 6 * 4 * 2 * 64 * 55
    full = {w.stage: w for w in stage_work(pipeline, {**shapes, "actor": ModelShape(
        shapes["actor"].params, 2, 64, shapes["actor"].vocab, 4, base, 64)})}
    assert full["train_actor"].flops(tokens, 0) == 6 * 2 * base * tokens


def test_the_lora_count_agrees_with_torch_on_a_real_backward():
    """torch's FLOP counter on a forward and backward of a tiny LoRA model: what is counted,
    less the input gradients of the first layer's q, k and v products (base and adapter
    ``A``), which autograd skips: their input, the embedding's output, needs none."""
    pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    from rlhfflow.engine.lora import apply_lora

    tokenizer = build_char_tokenizer()
    layers, hidden, rank, length = 3, 32, 4, 12
    model = build_tiny_model(tokenizer, arch="llama", n_layer=layers, hidden=hidden, n_head=4)
    model.set_attn_implementation("eager")  # the counter has no rule for CPU SDPA
    for p in model.parameters():
        p.requires_grad_(False)
    base = tiny_matmul_parameters(tokenizer, "lm", arch="llama", n_layer=layers, hidden=hidden)
    model = apply_lora(model, {"r": rank, "target_modules": "all-linear"}, "lm")
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model.train(True)
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=torch.ones(1, length, dtype=torch.long), use_cache=False).logits
        logits.log_softmax(-1)[..., 7].mean().backward()
    shape = ModelShape(0, layers, hidden, len(tokenizer), 4, base, hidden, adapters)
    work = StageWork("train", "actor", "float32", 3.0, 2.0 * (base + adapters),
                     4.0 * layers * hidden, weight_passes(3.0, shape))
    # eager attention multiplies every (query, key) pair, masked or not
    counted = work.flops(length, length * length)
    skipped = 2 * length * 3 * (hidden * hidden + rank * hidden)
    assert counter.get_total_flops() == pytest.approx(counted - skipped, rel=1e-12)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("head", ["lm", "value"])
def test_the_matmul_weights_of_a_tiny_model_agree_with_its_config_and_torch(arch, head):
    tokenizer = build_char_tokenizer()
    config = tiny_config(tokenizer, arch=arch, n_layer=3, hidden=32, n_head=4)
    counted = tiny_matmul_parameters(tokenizer, head, arch=arch, n_layer=3, hidden=32)
    assert matmul_parameters(config, head) == counted
    if head != "lm" or arch != "llama":
        return
    # torch's FLOP counter on a real forward (eager attention: the counter has no rule for
    # CPU SDPA): the products with the weights, and the attention's over every (query,
    # key) pair, masked or not, where causal attention uses S (S + 1) / 2
    model = build_tiny_model(tokenizer, arch=arch, n_layer=3, hidden=32, n_head=4).eval()
    model.set_attn_implementation("eager")
    length = 12
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.ones(1, length, dtype=torch.long), use_cache=False)
    full_attention = 3 * 4 * 32 * length * length
    expected = 2 * counted * length + full_attention
    assert counter.get_total_flops() == expected
    shape = type("Shape", (), {"matmul_params": counted, "layers": 3, "attention_width": 32})
    assert forward_flops(shape, [length]) == expected - 3 * 4 * 32 * (
        length * length - attention_pairs(length))


def test_the_matmul_peak_is_measured_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = peak.matmul_peaks(("float32",), threads=1)
    assert first["float32"] > 1e8  # any CPU multiplies faster than 0.1 GFLOP/s
    cache = tmp_path / "rlhfflow" / peak.CACHE_FILE
    stored = json.loads(cache.read_text())
    [key] = stored
    assert "float32" in key and "x1 threads" in key
    stored[key] = 12345.0  # what the cache says is what a run uses: nothing re-measured
    cache.write_text(json.dumps(stored))
    assert peak.matmul_peaks(("float32",), threads=1) == {"float32": 12345.0}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 3-iteration GRPO run, inline, with the peaks it is measured against cached: its
    pipeline, result and the lines it logged."""
    tmp = tmp_path_factory.mktemp("mfu")
    cache = tmp / "cache" / "rlhfflow"
    cache.mkdir(parents=True)
    peaks = {"float32": 2e9, "bfloat16": 4e9}
    threads = torch.get_num_threads()
    cache.joinpath(peak.CACHE_FILE).write_text(json.dumps(
        {peak._key(dtype, threads, "cpu"): v for dtype, v in peaks.items()}))
    pipeline = load_pipeline(small_pipeline(tmp, "grpo", iterations=3,
                                            overrides={"cluster.torch_threads": threads}))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("rlhfflow")
    logger.addHandler(handler)
    old_level, logger.level = logger.level, logging.INFO
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp / "cache"))
        try:
            result = run_pipeline(pipeline, progress=True, inline=True)
        finally:
            logger.removeHandler(handler)
            logger.level = old_level
    return pipeline, result, [r.getMessage() for r in records], peaks


def test_a_run_counts_its_model_flops_from_its_tokens(tiny_run):
    pipeline, result, _, peaks = tiny_run
    shape = model_shapes(pipeline)["actor"]  # ref is a copy: the same shape
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr", create=False)
    for record in MetricsLog(result.output_dir / "metrics.jsonl").read():
        rows = buffer.read(record["iteration"], ["prompt_ids", "prompt_mask",
                                                 "response_mask"])
        # a prompt that several rows repeat is one forward: its tokens and attention
        # count once, each row's response (attending to it) on its own
        prompts = {tuple(ids[mask.astype(bool)].tolist())
                   for ids, mask in zip(rows["prompt_ids"], rows["prompt_mask"], strict=True)}
        assert len(prompts) < len(rows["prompt_ids"])  # the shared case is what is checked
        one_forward = forward_flops(shape, [len(p) for p in prompts])
        for p, r in zip(rows["prompt_mask"], rows["response_mask"], strict=True):
            whole, alone = int(p.sum() + r.sum()), int(p.sum())
            one_forward += forward_flops(shape, [whole]) - forward_flops(shape, [alone])
        assert record["stage_flops"] == {"generate": pytest.approx(one_forward),
                                         "ref_logprob": pytest.approx(one_forward),
                                         "train_actor": pytest.approx(6 * one_forward)}
        assert record["model_flops"] == pytest.approx(8 * one_forward)
        # iteration_s is rounded to 0.1 ms in the record: on a short iteration that
        # is a relative error of up to 1e-3 in the MFU recomputed from it
        assert record["mfu"] == pytest.approx(
            record["model_flops"] / 2e9 / record["iteration_s"], rel=2e-3, abs=1e-4)
        assert record["matmul_peak_flops_per_s"] == peaks


def test_a_run_gives_its_mfu_in_the_closing_line_the_summary_and_the_report(tiny_run):
    _, result, lines, _ = tiny_run
    [closing] = [line for line in lines if line.startswith("rlhfflow: overlap")]
    match = re.search(r"; MFU (\d+\.\d{3}) \(model FLOPs ([\d.e+]+) GFLOP/s; matmul peak "
                      r"float32 2, bfloat16 4 GFLOP/s\)(; memory peak: w0 \d+ MiB)$", closing)
    assert match, closing
    assert float(match[1]) == pytest.approx(result.summary["mfu"], abs=1e-3)
    steady = MetricsLog(result.output_dir / "metrics.jsonl").read()[1:2]
    assert result.summary["mfu"] == steady[0]["mfu"]
    page = build_report(result.output_dir, samples=0)
    assert (f"<th>MFU (model FLOPs / matmul peak), 1 steady iterations</th>"
            f"<td>{result.summary['mfu']:.4g}</td>") in page
    assert "<th>matmul peak (GFLOP/s)</th><td>float32 2, bfloat16 4</td>" in page


def test_prompts_that_begin_alike_count_their_common_prefix_once():
    """Distinct prompts sharing 64+ leading tokens run that prefix once in every forward
    (``engine.forward``): the tokens and attention pairs the FLOPs are counted on hold it
    once, each prompt's rest attending to it; prompts sharing less count whole."""
    from rlhfflow.engine.batch import pad_prompts
    from rlhfflow.runtime.worker.tasks import partial_metrics

    head = list(range(5, 75))  # 70 shared tokens
    prompts = [head + [1, 2, 3], head + [4], head + [2, 2, 2, 2, 2], head + [1, 2, 3]]
    ids, mask = pad_prompts(prompts, 0)
    response = torch.ones(4, 2, dtype=torch.int8)
    batch = {"prompt_ids": ids, "prompt_mask": mask, "response_mask": response}
    got = partial_metrics(batch)
    distinct = [73, 71, 75]  # the last prompt repeats the first: its forward is shared too
    assert got["prompt_tokens"] == 70 + sum(n - 70 for n in distinct)
    prompt_pairs = attention_pairs(70) + sum(attention_pairs(n) - attention_pairs(70)
                                             for n in distinct)
    response_pairs = sum(2 * n + attention_pairs(2) for n in [73, 71, 75, 73])
    assert got["attention_pairs"] == prompt_pairs + response_pairs
    short = [head[:10] + p[70:] for p in prompts]  # 10 shared: below the threshold
    ids, mask = pad_prompts(short, 0)
    got = partial_metrics({"prompt_ids": ids, "prompt_mask": mask, "response_mask": response})
    assert got["prompt_tokens"] == 13 + 11 + 15
