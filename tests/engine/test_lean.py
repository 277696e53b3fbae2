"""The lean Llama forward computes exactly what transformers' modules compute."""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from rlhfflow.engine import cpukernels, lean, mergedlora
from rlhfflow.engine.drafting import shallow_view
from rlhfflow.engine.forward import response_logprobs
from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model, save_tiny_model
from rlhfflow.stages import ModelConfig, ModelStore
from tests.conftest import padded_ids

# the KV cache's names in the installed transformers (``cache`` from 5.24 on)
CACHE = lean.cache_keyword(LlamaForCausalLM.forward)
OUTPUT_CACHE = lean.output_cache_field(CausalLMOutputWithPast)


def _pair(**config):
    """A tiny Llama with transformers' forward and a deep copy of it with the lean one."""
    model = build_tiny_model(build_char_tokenizer(), n_layer=2, hidden=32, n_head=4,
                             **config).eval()
    fast = copy.deepcopy(model)
    assert lean.enable(fast)
    return model, fast


def test_lean_logits_and_gradients_equal_transformers_bitwise():
    model, fast = _pair()
    ids, mask, pos = padded_ids()
    real = mask.bool()
    model.train()
    fast.train()
    outs = [m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            for m in (model, fast)]
    assert torch.equal(outs[0][real], outs[1][real])
    for out in outs:
        out.logsumexp(-1)[real].sum().backward()
    for (name, p), q in zip(model.named_parameters(), fast.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_lean_decoding_with_cache_and_holes_equals_transformers():
    model, fast = _pair()
    ids, mask, pos = padded_ids(length=20)
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    with torch.no_grad():
        first = [m(input_ids=ids[:, :10], attention_mask=mask[:, :10], position_ids=pos[:, :10],
                   use_cache=True, logits_to_keep=1, **{CACHE: c}).logits
                 for m, c in zip((model, fast), caches, strict=True)]
        assert first[1].shape[1] == 1 and torch.equal(first[0], first[1])
        for start in (10, 13, 16, 19):
            step_mask = mask[:, :start + (3 if start < 19 else 1)].clone()
            step_mask[1, start] = 0  # a rejected draft token: a hole in row 1
            width = step_mask.shape[1] - start
            outs = [m(input_ids=ids[:, start:start + width], attention_mask=step_mask,
                      position_ids=pos[:, start:start + width], use_cache=True, **{CACHE: c})
                    for m, c in zip((model, fast), caches, strict=True)]
            assert torch.equal(outs[0].logits, outs[1].logits)
            assert outs[1][OUTPUT_CACHE] is caches[1]
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_lean_keeps_grouped_query_attention_and_tied_embeddings_exact():
    model = build_tiny_model(build_char_tokenizer(), n_layer=2, hidden=32, n_head=4).eval()
    config = copy.deepcopy(model.config)
    config.num_key_value_heads = 2
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    fast = copy.deepcopy(model)
    assert lean.enable(fast)
    ids, mask, pos = padded_ids()
    with torch.no_grad():
        a, b = (m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                for m in (model, fast))
    assert torch.equal(a[mask.bool()], b[mask.bool()])


def test_response_logprobs_through_stage_helpers_are_unchanged():
    """The shared-prompt, length-grouped path (KV cache, response groups) too."""
    model, fast = _pair()
    prompt_ids, prompt_mask, _ = padded_ids(rows=4, length=8)
    prompt_ids[1], prompt_mask[1] = prompt_ids[0], prompt_mask[0]  # a repeated prompt
    gen = torch.Generator().manual_seed(1)
    response_ids = torch.randint(3, 30, (4, 6), generator=gen)
    response_mask = torch.ones_like(response_ids)
    response_mask[2, 3:] = 0
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
             "response_ids": response_ids, "response_mask": response_mask}
    with torch.no_grad():
        assert torch.equal(response_logprobs(model, batch), response_logprobs(fast, batch))


def test_lean_falls_back_to_transformers_for_what_it_does_not_cover():
    model, fast = _pair()
    ids, mask, pos = padded_ids()
    with torch.no_grad():
        embeds = model.model.embed_tokens(ids)
        a = model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).logits
        b = fast(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).logits
        assert torch.equal(a, b)
        out = fast(input_ids=ids, attention_mask=mask, labels=ids)
        assert out.loss is not None  # transformers' loss, from its own forward
        hidden = fast(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert hidden.hidden_states is not None
        four_d = mask.bool()[:, None, None, :].expand(-1, 1, mask.shape[1], -1)
        a = model(input_ids=ids, attention_mask=four_d, position_ids=pos).logits
        b = fast(input_ids=ids, attention_mask=four_d, position_ids=pos).logits
        assert torch.equal(a, b)  # a 4D mask: transformers' forward


def test_unsupported_models_keep_transformers_forward(monkeypatch):
    gpt2 = build_tiny_model(build_char_tokenizer(), arch="gpt2")
    assert "GPT2" in lean.unsupported(gpt2)
    assert not lean.enable(gpt2)
    value = build_tiny_model(build_char_tokenizer(), head="value")
    assert not lean.enable(value)  # token classification: not a causal LM
    half = build_tiny_model(build_char_tokenizer()).to(torch.bfloat16)
    assert lean.unsupported(half) == "parameters are not float32"
    model = build_tiny_model(build_char_tokenizer())
    monkeypatch.setenv(lean.ENV, "0")
    assert not lean.enable(model)
    assert not hasattr(type(model), "_lean_base")


def test_lean_model_saves_as_plain_llama_and_layer_views_keep_it(tmp_path):
    save_tiny_model(tmp_path / "m", n_layer=3, hidden=32, n_head=4)
    store = ModelStore({"m": ModelConfig("m", "lm", str(tmp_path / "m"))})
    module = store.get("m").module
    assert type(module)._lean_base.__name__ == type(module).__name__ == "LlamaForCausalLM"
    module.save_pretrained(tmp_path / "saved")
    assert '"LlamaForCausalLM"' in (tmp_path / "saved" / "config.json").read_text()
    view = shallow_view(module, 1)  # the `layers` drafter: first layer, same weights
    reference = copy.deepcopy(view)
    reference.__class__ = type(module)._lean_base
    ids, mask, pos = padded_ids(rows=2, length=6)
    with torch.no_grad():
        assert torch.equal(view(input_ids=ids, attention_mask=mask, position_ids=pos).logits,
                           reference(input_ids=ids, attention_mask=mask,
                                     position_ids=pos).logits)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_mixed_precision_models_keep_the_autocast_forward(tmp_path, dtype):
    save_tiny_model(tmp_path / "m", n_layer=1, hidden=32, n_head=4)
    store = ModelStore({"m": ModelConfig("m", "lm", str(tmp_path / "m"), trainable=True,
                                         dtype=dtype)})
    module = store.get("m").module
    assert not hasattr(type(module), "_lean_base")
    assert "forward" in vars(module)  # autocast's wrapper


def test_a_model_converted_after_loading_or_run_under_autocast_uses_transformers():
    model, fast = _pair()
    ids, mask, pos = padded_ids()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = (m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                for m in (model, fast))
        assert torch.equal(a, b)
    model.to(torch.bfloat16)
    fast.to(torch.bfloat16)
    with torch.no_grad():
        a, b = (m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                for m in (model, fast))
    assert torch.equal(a, b)


def test_the_lean_forward_stays_on_the_devices_it_was_checked_on(monkeypatch):
    model, fast = _pair()
    monkeypatch.setattr(lean, "DEVICES", frozenset())  # as a CUDA model sees it today
    assert lean.unsupported(build_tiny_model(build_char_tokenizer())) == \
        "parameters on cpu (the lean forward is checked on no device only)"
    assert not lean.enable(build_tiny_model(build_char_tokenizer()))

    def not_lean(*args, **kwargs):
        raise AssertionError("the lean arithmetic ran on a device it is not checked on")

    monkeypatch.setattr(lean, "_attention", not_lean)
    ids, mask, pos = padded_ids()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():  # an already lean model falls back, its KV cache included
        out = fast(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                   **{CACHE: cache})
        a = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(out.logits, a)
    assert cache.get_seq_length() == ids.shape[1]


def test_the_cache_goes_by_the_name_the_installed_transformers_takes():
    """transformers before 5.24 named the cache ``past_key_values``, in the forward and in
    its output (the GPU machine has 5.17): an older forward would swallow ``cache=`` in its
    ``**kwargs`` and run without it."""
    from dataclasses import dataclass

    def old_forward(self, input_ids=None, past_key_values=None, **kwargs):
        """transformers 5.17's signature, in short."""

    def new_forward(self, input_ids=None, cache=None, **kwargs):
        """transformers 5.24's."""

    @dataclass
    class OldOutput:
        logits: object = None
        past_key_values: object = None

    assert lean.cache_keyword(old_forward) == "past_key_values"
    assert lean.cache_keyword(new_forward) == "cache"
    assert lean.output_cache_field(OldOutput) == "past_key_values"
    installed = lean.output_cache_field(CausalLMOutputWithPast)
    assert lean.cache_keyword(LlamaForCausalLM.forward) == installed


# ---------------------------------------------------------------- peft's LoRA layers
def _lora_pair(dropout: float = 0.0, **config):
    """A tiny Llama with peft's LoRA adapters (B drawn, not zero: the adapters count) on
    transformers' and peft's forward, and a deep copy of it with the lean one."""
    peft = pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    model = build_tiny_model(build_char_tokenizer(), n_layer=2, hidden=32, n_head=4).eval()
    settings = {"r": 4, "lora_alpha": 8, "lora_dropout": dropout,
                "target_modules": "all-linear", "task_type": "CAUSAL_LM", **config}
    torch.manual_seed(0)
    slow = peft.get_peft_model(model, peft.LoraConfig(**settings)).eval()
    with torch.no_grad():
        for name, p in slow.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    fast = copy.deepcopy(slow)
    return slow, fast


def test_lean_lora_logits_and_adapter_gradients_equal_peft_bitwise():
    slow, fast = _lora_pair(dropout=0.1)  # dropout: the same draws in the same order
    assert lean.unsupported(fast) is None and lean.enable(fast)
    assert type(fast.get_base_model())._lean_base is LlamaForCausalLM
    ids, mask, pos = padded_ids()
    real = mask.bool()
    outs = []
    for model in (slow, fast):
        model.train()
        torch.manual_seed(3)
        outs.append(model(input_ids=ids, attention_mask=mask, position_ids=pos,
                          use_cache=False).logits)
        outs[-1].logsumexp(-1)[real].sum().backward()
    assert torch.equal(outs[0][real], outs[1][real])
    adapters = [(n, p, q) for (n, p), q in zip(slow.named_parameters(), fast.parameters(),
                                               strict=True) if p.requires_grad]
    assert {n.split(".")[-3] for n, _, _ in adapters} == {"lora_A", "lora_B"}
    for name, p, q in adapters:
        assert torch.equal(p.grad, q.grad), name


def test_lean_lora_with_adapters_off_is_the_base_bitwise():
    from rlhfflow.engine.lora import base_view

    slow, fast = _lora_pair()
    lean.enable(fast)
    plain = base_view(fast)  # the reference: plain layers, lean on its own
    assert lean.enable(plain)
    ids, mask, pos = padded_ids()
    with torch.no_grad():
        with slow.disable_adapter():
            off = slow(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        with fast.disable_adapter():
            assert torch.equal(off, fast(input_ids=ids, attention_mask=mask,
                                         position_ids=pos).logits)
        assert torch.equal(off, plain(input_ids=ids, attention_mask=mask,
                                      position_ids=pos).logits)
        on = fast(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert (on - off).abs().max() > 1e-3  # the adapters count when on


def test_lean_lora_decoding_with_cache_equals_peft():
    slow, fast = _lora_pair()
    lean.enable(fast)
    ids, mask, pos = padded_ids(length=16)
    caches = [DynamicCache(config=slow.config) for _ in range(2)]
    with torch.no_grad():
        for start, width in ((0, 10), (10, 3), (13, 1), (14, 2)):
            outs = [m(input_ids=ids[:, start:start + width], attention_mask=mask[:, :start + width],
                      position_ids=pos[:, start:start + width], use_cache=True, **{CACHE: c})
                    for m, c in zip((slow, fast), caches, strict=True)]
            assert torch.equal(outs[0].logits, outs[1].logits)
            assert outs[1][OUTPUT_CACHE] is caches[1]
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_lean_lora_calls_peft_for_merged_adapters_and_per_row_adapter_names():
    slow, fast = _lora_pair()
    lean.enable(fast)
    ids, mask, pos = padded_ids()
    names = ["default", "__base__", "default", "__base__", "default"]
    with torch.no_grad():
        for model in (slow, fast):  # peft's adapter_names: hooks on each layer, per row
            model.merge_adapter()
        a, b = (m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                for m in (slow, fast))
        assert torch.equal(a, b)
        for model in (slow, fast):
            model.unmerge_adapter()
        a, b = (m(input_ids=ids, attention_mask=mask, position_ids=pos,
                  adapter_names=names).logits for m in (slow, fast))
        assert torch.equal(a, b)


@pytest.mark.parametrize("config, reason", [
    ({"use_dora": True}, "a LoRA variant"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "adapter on model.embed_tokens"),
])
def test_lora_shapes_the_lean_forward_does_not_cover_keep_peft(config, reason):
    _, fast = _lora_pair(**config)
    assert reason in lean.unsupported(fast)
    assert not lean.enable(fast)
    assert not hasattr(type(fast.get_base_model()), "_lean_base")


def test_a_lora_model_in_the_store_is_lean_and_recomputes_in_its_loop(tmp_path):
    pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    save_tiny_model(tmp_path / "m", n_layer=2, hidden=32, n_head=4)
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(tmp_path / "m"),
                                             trainable=True, optimizer={"lr": 1e-2},
                                             lora=lora, gradient_checkpointing=True)})
    inner = store.get("actor").module.get_base_model()
    assert type(inner)._lean_base is LlamaForCausalLM
    assert getattr(inner, "_rlhfflow_recompute", False)


def test_lean_lora_generates_from_merged_weights_remade_when_the_adapters_change():
    slow, fast = _lora_pair()
    lean.enable(fast)
    ids, mask, pos = padded_ids()
    layers = [m for m in fast.modules() if mergedlora.is_lora(m)]

    def logits(model, merged: bool) -> torch.Tensor:
        with torch.no_grad(), (lean.merged_adapters(model) if merged else nullcontext()):
            return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits

    real = mask.bool()
    peft_out = logits(slow, merged=False)
    merged_out = logits(fast, merged=True)
    # one product with W + s B A: peft's values up to float rounding, not its bitwise path
    torch.testing.assert_close(merged_out[real], peft_out[real], rtol=1e-5, atol=1e-5)
    cache = fast.__dict__["_lean_merged"]
    assert len(cache) == len(layers) == 14  # 2 layers x 7 projections (all-linear)
    first = {name: entry.weight for name, entry in cache.items()}
    logits(fast, merged=True)  # unchanged adapters: the same tensors, not merged again
    assert all(cache[name].weight is w for name, w in first.items())
    for w in first.values():  # the forward reads these weights, not the adapters
        w.zero_()
    assert not torch.allclose(logits(fast, merged=True), peft_out)
    fast.__dict__["_lean_merged"] = {}
    logits(fast, merged=True)  # merged again from the adapters as they are now
    # an update that leaves no version behind (a shadow's .data copy, DeepSpeed)
    with torch.no_grad():
        for (name, p), q in zip(slow.named_parameters(), fast.parameters(), strict=True):
            if "lora_B" in name:
                p.add_(0.05)
                q.data.copy_(p.data)
    torch.testing.assert_close(logits(fast, merged=True)[real], logits(slow, False)[real],
                               rtol=1e-5, atol=1e-5)
    # taking gradients, or outside the context: the adapters' own path, bitwise peft's
    fast.train(), slow.train()
    with lean.merged_adapters(fast):
        grad_out = fast(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(grad_out[real], slow(input_ids=ids, attention_mask=mask,
                                            position_ids=pos).logits[real])
    assert torch.equal(logits(fast.eval(), False)[real], logits(slow.eval(), False)[real])


def test_merged_generation_leaves_a_model_without_adapters_or_the_lean_forward_alone():
    slow, fast = _lora_pair()  # slow: peft's forward (not lean)
    ids, mask, pos = padded_ids()
    with torch.no_grad():
        outside = slow(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        with lean.merged_adapters(slow):
            inside = slow(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(outside, inside) and "_lean_merged" not in slow.__dict__
    plain = build_tiny_model(build_char_tokenizer(), n_layer=2, hidden=32, n_head=4).eval()
    lean.enable(plain)
    with lean.merged_adapters(plain):
        assert "_lean_merged" not in plain.__dict__


def _resident_lora(tmp_path, merge: bool):
    """A tiny trainable LoRA actor (r=4, every Linear) resident in a ``ModelStore``, with
    ``lora.merge_for_generation: merge``."""
    pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")
    save_tiny_model(tmp_path / "m", n_layer=2, hidden=32, n_head=4)
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear",
            "merge_for_generation": merge}
    store = ModelStore({"actor": ModelConfig("actor", "lm", str(tmp_path / "m"),
                                             trainable=True, lora=lora)})
    return store.get("actor")


@pytest.mark.parametrize("merge", [True, False])
def test_a_resident_lora_model_generates_merged_unless_its_spec_says_not(tmp_path, merge):
    resident = _resident_lora(tmp_path, merge)
    with torch.no_grad():
        for name, p in resident.module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids, mask, pos = padded_ids()

    def sampled() -> torch.Tensor:
        with resident.generating():
            assert not torch.is_grad_enabled()  # a rollout's own loop takes none either
            return resident.module(input_ids=ids, attention_mask=mask,
                                   position_ids=pos).logits

    before = sampled()
    assert len(resident.module.__dict__.get("_lean_merged", {})) == (14 if merge else 0)
    for entry in resident.module.__dict__.get("_lean_merged", {}).values():
        entry.weight.zero_()  # what generation reads when merged
    assert torch.equal(before, sampled()) is not merge


# ---------------------------------------------------------------- oneDNN products, training
def test_sampling_takes_its_products_from_onednn_with_mkl_s_values(monkeypatch):
    """Within ``sampling`` the products without gradients go through oneDNN's kernel
    (this torch build has it: the speed of generation on CPU depends on it), equal to
    MKL's up to float rounding; outside it, and with ``RLHFFLOW_ONEDNN=0``, MKL's."""
    assert cpukernels._onednn() is not None
    model = build_tiny_model(build_char_tokenizer(), n_layer=2, hidden=32, n_head=4).eval()
    assert lean.enable(model)
    monkeypatch.setattr(cpukernels, "ONEDNN_MIN_FEATURES", 0)  # the tiny model's are 32 wide
    calls = []
    real_linear = lean.onednn_linear
    monkeypatch.setattr(lean, "onednn_linear",
                        lambda x, w: calls.append(w.shape) or real_linear(x, w))
    ids, mask, pos = padded_ids()

    def logits() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits

    with torch.no_grad():
        outside = logits()
        assert not calls
        with lean.sampling(model):
            inside = logits()
    assert len(calls) == 2 * 7 + 1  # every projection of both layers, and the head
    real = mask.bool()
    torch.testing.assert_close(inside[real], outside[real], rtol=1e-5, atol=1e-5)
    calls.clear()
    with lean.sampling(model):  # taking gradients: MKL's, bitwise transformers'
        assert torch.equal(logits(), outside) and not calls
    monkeypatch.setenv(cpukernels.ONEDNN_ENV, "0")
    cpukernels._onednn.cache_clear()
    try:
        with torch.no_grad(), lean.sampling(model):
            assert torch.equal(logits(), outside)  # the op was asked for, MKL's answered
    finally:
        monkeypatch.delenv(cpukernels.ONEDNN_ENV)
        cpukernels._onednn.cache_clear()


def test_each_kind_of_product_takes_the_kernel_measured_faster_on_the_machine():
    assert cpukernels.choose_kernels({"layer": (1.0, 0.9), "head": (1.0, 0.97)}) == {
        "layer": True, "head": False}  # a tie within the margin keeps MKL's
    assert cpukernels.choose_kernels({"layer": (1.0, 1.2), "head": (3.0, 2.0)}) == {
        "layer": False, "head": True}  # as measured on an Intel Xeon
    assert cpukernels.product_kind(49152) == "head" and cpukernels.product_kind(14336) == "layer"


def _kernels_run(x: torch.Tensor, weight: torch.Tensor) -> set[str]:
    """The matmul ops ``cpukernels.onednn_linear(x, weight)`` ran (torch's profiler)."""
    cpukernels._onednn(), cpukernels._kernels()  # their self-check and choice, before profiling
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cpukernels.onednn_linear(x, weight)
    return {e.key for e in prof.key_averages()} & {"mkldnn::_linear_pointwise",
                                                     "aten::linear"}


def test_the_kernel_choice_is_measured_once_cached_and_forced_by_the_environment(
        tmp_path, monkeypatch):
    from rlhfflow.engine import machine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(cpukernels.ONEDNN_ENV, raising=False)
    shapes = {"layer": (4, 8, 16), "head": (4, 8, 64)}
    first = cpukernels.kernel_timings(1, shapes)
    assert set(first) == {"layer", "head"} and all(t > 0 for ts in first.values() for t in ts)
    cache = tmp_path / "rlhfflow" / cpukernels.KERNEL_CACHE
    [key] = json.loads(cache.read_text())
    assert "x1 threads" in key and "mkldnn" in key
    # timings put in the cache are what a process chooses from: nothing measured again
    key = machine.machine_key("F.linear vs mkldnn._linear_pointwise", torch.get_num_threads())
    cache.write_text(json.dumps({key: {"layer": [1.0, 2.0], "head": [2.0, 1.0]}}))
    assert cpukernels.kernel_timings(torch.get_num_threads(), shapes) == {
        "layer": [1.0, 2.0], "head": [2.0, 1.0]}
    monkeypatch.setattr(cpukernels, "ONEDNN_MIN_FEATURES", 0)
    monkeypatch.setattr(cpukernels, "HEAD_FEATURES", 64)
    x, layer, head = torch.randn(4, 8), torch.randn(16, 8), torch.randn(64, 8)
    cpukernels._kernels.cache_clear()
    try:
        assert cpukernels._kernels() == {"layer": False, "head": True}
        assert _kernels_run(x, layer) == {"aten::linear"}
        assert _kernels_run(x, head) == {"mkldnn::_linear_pointwise"}
        monkeypatch.setenv(cpukernels.ONEDNN_ENV, "1")  # forced: oneDNN's for every kind
        cpukernels._kernels.cache_clear()
        assert _kernels_run(x, layer) == {"mkldnn::_linear_pointwise"}
        monkeypatch.setenv(cpukernels.ONEDNN_ENV, "0")  # forced off: MKL's for every kind
        cpukernels._onednn.cache_clear()
        assert _kernels_run(x, head) == {"aten::linear"}
    finally:
        monkeypatch.delenv(cpukernels.ONEDNN_ENV, raising=False)
        cpukernels._kernels.cache_clear()
        cpukernels._onednn.cache_clear()


def _step(model, ids, mask, pos) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One loss and backward pass: the logits and the adapters' gradients."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    out.logsumexp(-1)[mask.bool()].sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("recompute", [False, True])
def test_a_lora_training_step_reads_the_merged_weights_its_sampling_made(recompute,
                                                                         monkeypatch):
    """Within ``lean.training``, an adapted layer whose merged weight (made by sampling)
    still matches its adapters is one product with it (oneDNN's, forward and input
    gradient): the logits and the gradients of A and B are peft's up to float rounding,
    with gradient checkpointing too. After an update the weights are stale and nothing
    is merged again: the adapters' path."""
    monkeypatch.setattr(cpukernels, "ONEDNN_MIN_FEATURES", 0)  # the tiny model's are 32 wide
    slow, fast = _lora_pair()
    lean.enable(fast)
    fast.get_base_model()._rlhfflow_recompute = recompute
    ids, mask, pos = padded_ids()
    real = mask.bool()
    with torch.no_grad(), lean.sampling(fast):
        fast(input_ids=ids, attention_mask=mask, position_ids=pos)
    merged = {name: entry.weight for name, entry in fast.__dict__["_lean_merged"].items()}
    slow.train(), fast.train()
    expected, expected_grads = _step(slow, ids, mask, pos)
    applied = []
    real_apply = mergedlora.MergedLoRA.apply
    mergedlora.MergedLoRA.apply = lambda *args: applied.append(args[1]) or real_apply(*args)
    try:
        with lean.training(fast):
            assert len(lean._TRAINING.get()) == 14
            got, grads = _step(fast, ids, mask, pos)
    finally:
        mergedlora.MergedLoRA.apply = real_apply
    # 14 layers, each once in the forward (and once more in the recomputation)
    assert len(applied) == 14 * (2 if recompute else 1)
    assert {id(w) for w in applied} == {id(w) for w in merged.values()}
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # an optimizer step: the merged weights are stale now
        for p in fast.parameters():
            if p.requires_grad:
                p.add_(0.01)
    with lean.training(fast):
        assert lean._TRAINING.get() == {}  # the adapters' path, nothing merged again
        _step(fast, ids, mask, pos)
    assert all(fast.__dict__["_lean_merged"][name].weight is w for name, w in merged.items())


def test_a_lora_training_context_leaves_adapters_stepped_or_switched_off_inside_it():
    """The merged weights are chosen on entering ``lean.training``: an adapter an
    optimizer changed in place since, or adapters switched off, take the adapters' own
    path (bitwise peft's), not a merged weight of other adapters."""
    slow, fast = _lora_pair()
    lean.enable(fast)
    ids, mask, pos = padded_ids()
    with torch.no_grad(), lean.sampling(fast):
        fast(input_ids=ids, attention_mask=mask, position_ids=pos)
    slow.train(), fast.train()
    applied = []
    real_apply = mergedlora.MergedLoRA.apply
    mergedlora.MergedLoRA.apply = lambda *args: applied.append(1) or real_apply(*args)
    try:
        with lean.training(fast):
            assert len(lean._TRAINING.get()) == 14
            with torch.no_grad():  # as an optimizer step does, in place
                for model in (slow, fast):
                    for name, p in model.named_parameters():
                        if "lora_A" in name:
                            p.mul_(1.5)
            got = fast(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert not applied
        with torch.no_grad(), lean.sampling(fast):  # merged again: current on entry
            fast(input_ids=ids, attention_mask=mask, position_ids=pos)
        with lean.training(fast):
            assert len(lean._TRAINING.get()) == 14
            with fast.disable_adapter(), slow.disable_adapter():
                off = fast(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                base = slow(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    finally:
        mergedlora.MergedLoRA.apply = real_apply
    assert not applied
    real = mask.bool()
    expected = slow(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(off[real], base[real], rtol=1e-5, atol=1e-5)


def test_a_training_step_refuses_a_merged_weight_remade_before_its_backward():
    """The merged weight a forward read is saved for its backward pass: merging it again
    in place before then (an update, then a sampling task) must fail, not give
    gradients of other weights."""
    _, fast = _lora_pair()
    lean.enable(fast)
    ids, mask, pos = padded_ids()
    with torch.no_grad(), lean.sampling(fast):
        fast(input_ids=ids, attention_mask=mask, position_ids=pos)
    fast.train()
    with lean.training(fast):
        out = fast(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        with torch.no_grad():
            for name, p in fast.named_parameters():
                if "lora_B" in name:  # as a shadow's copy does: no version left behind
                    p.data.add_(0.01)
            with lean.sampling(fast):
                fast(input_ids=ids[:1], attention_mask=mask[:1], position_ids=pos[:1])
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.logits.sum().backward()


@pytest.mark.parametrize("merge", [True, False])
def test_a_resident_lora_model_trains_from_its_merged_weights_unless_told_not_to(
        tmp_path, merge):
    resident = _resident_lora(tmp_path, merge)
    ids, mask, pos = padded_ids()
    with resident.generating():
        resident.module(input_ids=ids, attention_mask=mask, position_ids=pos)
    with resident.training():
        assert len(lean._TRAINING.get()) == (14 if merge else 0)
    assert lean._TRAINING.get() is None
