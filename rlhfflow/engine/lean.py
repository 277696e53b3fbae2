"""A lean forward for transformers' ``LlamaForCausalLM`` (SmolLM2, Llama, the tiny models).

The same arithmetic as transformers' modules, in one function over the model's own
parameters, without their per-call Python: the decorators on every forward (kwarg
deprecation, output capturing, config defaults), ``create_causal_mask``'s mask
functions, rotary embeddings recomputed from the positions on every call, and ~20
``nn.Module`` calls per layer. On the 2-layer, 64-wide demo model that Python is most of
a forward: measured on one CPU thread, a decode step over 64 rows took 2.6 ms through
transformers and 2.0 ms here, an inference forward over 64 x 77 tokens 53 ms and 38 ms.
On SmolLM2-135M at batch 1 the step is memory-bound and gains ~3%.

What is the same, so nothing else changes:

* **Values.** The same operations in the same order (RMSNorm in float32, rotary tables
  from the model's own ``inv_freq`` and ``attention_scaling``, SDPA with a boolean mask of
  keys a query sees, the same scaling): on CPU the logits are bitwise those of
  transformers, with and without a KV cache (``tests/engine/test_lean.py``). Gradients flow
  through the same parameters, so training, DeepSpeed's engine (which calls the module)
  and checkpoints are unchanged.
* **The interface.** The forward takes transformers' arguments (``input_ids``,
  ``attention_mask`` over past and new tokens, ``position_ids``, a ``DynamicCache`` as
  ``cache`` or ``past_key_values``, ``use_cache``, ``logits_to_keep``) and returns
  transformers' ``CausalLMOutputWithPast``. Anything else goes to transformers' own
  forward: ``inputs_embeds``, ``labels``, a 4D attention mask, an empty batch,
  ``output_attentions``, a cache of another kind, attention dropout or gradient
  checkpointing while training, a model converted from float32 since, a call under
  autocast, parameters partitioned by DeepSpeed's ZeRO-3.

**LoRA.** A model with peft's LoRA adapters (``engine.lora``) gets it too: ``enable`` gives
the transformers model under peft's wrapper the lean forward (peft's ``PeftModel`` and
``LoraModel`` forwards are a few calls per forward, not per layer, and stay), and where
the lean forward reads a Linear that peft's LoRA ``Linear`` replaced it computes what that
layer's forward computes, the same operations in the same order: the base layer, then
``B(A(dropout(x))) * scaling`` added for each active adapter, the base alone with the
adapters disabled (logits and the gradients of ``A`` and ``B`` bitwise peft's on CPU,
``tests/engine/test_lean.py``). Within ``merged_adapters`` (generation), a layer computed
without gradients is one product with its merged weight ``W + scaling * B A`` instead,
equal up to float rounding. Within ``training`` (a training step), a layer whose merged
weight still matches its adapters is one product with it too, its gradients those of the
adapters' path up to float rounding (``rlhfflow.engine.mergedlora``). A layer in a state
it does not cover (adapters merged into the weights, forward hooks such as peft's per-row
``adapter_names``) is called as a module.
Adapters of another shape keep peft's forward for the whole model (``unsupported`` says
why): other peft methods, DoRA and other LoRA variants, adapters on layers other than the
attention and MLP projections and the output head, ``fan_in_fan_out``.

``enable(module)`` switches a loaded model over by giving it a subclass of its class with
this forward (``type(module).__name__`` stays ``LlamaForCausalLM``, so ``save_pretrained``
writes the same ``architectures``, and ``copy.copy`` views such as the ``layers`` drafter
keep it). Models it does not cover (other architectures, RoPE types that change with the
sequence length, attention or MLP biases, parameters other than float32 or not on the
CPU) keep transformers' forward: ``unsupported(module)`` says why. GPUs are left out
until it is checked on one (SDPA and ``rms_norm`` take other kernels there):
``DEVICES`` names the device types it is switched on for, and ``tests/test_gpu.py`` adds
``cuda`` to compare it with transformers on a GPU. ``RLHFFLOW_LEAN_FORWARD=0`` turns it off
for a process tree. A model loaded with an ``attn_implementation`` other than ``sdpa``
keeps transformers' forward too; gradient checkpointing (``rlhfflow.engine.recompute``)
checkpoints this forward's layer loop.

**Sampling.** Within ``sampling`` (every stage that samples: ``ResidentModel.generating``)
the products taken without gradients may go through oneDNN's linear kernel
(``torch.ops.mkldnn._linear_pointwise``, the one torch's compiler uses on CPU) instead of
MKL's GEMM. Which is faster depends on the CPU: on 2 cores of an AMD EPYC (Zen 4), where
MKL takes a slower path, oneDNN ran a decode step's 32-row products 1.05-1.4x faster and
SmolLM2's 49152-token output head 1.9x (2.4x at 4 rows); on an Intel Xeon the layer
products ran 0.9-1.0x (slower) and the head 1.3-1.4x. So the kernel is chosen per kind
of product (an output head, ``HEAD_FEATURES`` output features or more, or a layer's) by
timing both kernels once on the machine at hand (``KERNEL_SHAPES``, at the process's
torch thread count; ``kernel_timings``; ``rlhfflow.engine.cpukernels``), kept beside the
matmul peak (``rlhfflow.engine.machine``): oneDNN's is taken where it was faster by
``ONEDNN_MARGIN``. ``RLHFFLOW_ONEDNN=1`` takes oneDNN's for every kind, ``0`` keeps MKL's
for all. Values equal MKL's up to float rounding (not bitwise transformers'). A LoRA
model's training step (``training``) takes its frozen plain Linears and its merged
products through the same choice; a full model's training and the inference stages
(reference, rewards, values) keep MKL's. Products with fewer than
``ONEDNN_MIN_FEATURES`` output features keep MKL's everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlhfflow.engine.cpukernels import FrozenLinear, onednn_linear
from rlhfflow.engine.mergedlora import MergedLoRA, is_lora, mergeable_layers, merged_weights

#: Environment switch: "0" keeps transformers' forward everywhere.
ENV = "RLHFFLOW_LEAN_FORWARD"
#: RoPE types whose inverse frequencies change with the sequence length: their
#: ``rotary_emb`` recomputes them in forward, so a fixed table would be wrong.
_DYNAMIC_ROPE = ("dynamic", "longrope")
#: Keyword arguments transformers' forward takes that this one handles (others fall back,
#: unless None: peft's wrapper passes ``output_attentions=None`` and the like).
_HANDLED = frozenset({"return_dict"})
#: The Linear layers of a Llama block the lean forward reads, and the output head.
_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj", "lm_head"})
#: Device types whose models get the lean forward: where it was checked against
#: transformers (bitwise on CPU). Elsewhere a model keeps transformers' forward. The
#: contexts that change its products (``sampling``'s oneDNN, ``training``) act on the CPU
#: only.
DEVICES: frozenset[str] = frozenset({"cpu"})
#: Inside ``merged_adapters``: the merged weight of each LoRA layer, by ``id(layer)``.
_MERGED: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
    "rlhfflow_lean_merged", default=None)
#: Inside ``training``: the merged weights that match their adapters, by ``id(layer)``,
#: with the versions of ``A`` and ``B`` they were chosen at.
_TRAINING: contextvars.ContextVar[dict[int, tuple] | None] = contextvars.ContextVar(
    "rlhfflow_lean_training", default=None)
#: Inside ``sampling``: products without gradients go through oneDNN (``_product``).
_SAMPLING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "rlhfflow_lean_sampling", default=False)
def transformers_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model of ``module``: the base model under peft's wrapper
    (``PeftModel``), else ``module`` itself."""
    if hasattr(module, "peft_config") and hasattr(module, "get_base_model"):
        return module.get_base_model()
    return module


def unsupported(module: torch.nn.Module) -> str | None:
    """Why ``module`` (a transformers model, or one with peft's LoRA adapters) cannot use
    the lean forward, or None when it can."""
    from transformers import LlamaForCausalLM

    if module is not transformers_model(module):
        return _unsupported_adapters(module) or unsupported(transformers_model(module))
    cls = type(module)
    if getattr(cls, "_lean_base", None) is not None:
        return None  # already lean
    if cls is not LlamaForCausalLM:
        return f"{cls.__name__} is not LlamaForCausalLM"
    problem = unsupported_config(module.config)
    if problem is not None:
        return problem
    if getattr(module.model.rotary_emb, "rope_type", "default") in _DYNAMIC_ROPE:
        return f"rope_type {module.model.rotary_emb.rope_type!r}"
    if any(p.dtype != torch.float32 for p in module.parameters()):
        return "parameters are not float32"
    elsewhere = {p.device.type for p in module.parameters()} - DEVICES
    if elsewhere:
        return (f"parameters on {', '.join(sorted(elsewhere))} (the lean forward is checked "
                f"on {', '.join(sorted(DEVICES)) or 'no device'} only)")
    for name, child in module.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in _PROJECTIONS and type(child) is not torch.nn.Linear and not is_lora(child):
            return f"{name} is {type(child).__name__}, not a Linear or peft's LoRA Linear"
    return None


def unsupported_config(config) -> str | None:
    """What in transformers ``config`` (a Llama's, as ``LlamaForCausalLM`` loads it) the
    lean forward does not cover, or None: the checks of ``unsupported`` that need no
    weights (the planner asks them of models it never loads)."""
    if getattr(config, "model_type", "llama") != "llama":
        return f"model_type {config.model_type!r} is not llama"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in (None, "sdpa"):
        return f"attn_implementation {attention!r} (the lean forward is SDPA)"
    return None


def _unsupported_adapters(wrapper: torch.nn.Module) -> str | None:
    """Why the adapters of peft model ``wrapper`` keep peft's forward, or None when
    every adapted layer is a LoRA Linear of the default shape on a projection the lean
    forward reads (what ``_adapted`` computes)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    kinds = {getattr(config.peft_type, "value", str(config.peft_type))
             for config in wrapper.peft_config.values()}
    if kinds != {"LORA"}:
        return f"peft adapters of type {', '.join(sorted(kinds))} (only LoRA is lean)"
    for name, layer in wrapper.get_base_model().named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        if not is_lora(layer) or name.rpartition(".")[2] not in _PROJECTIONS:
            return f"adapter on {name} ({type(layer).__name__}): lean covers LoRA Linears"
        if layer.fan_in_fan_out:
            return f"{name}: fan_in_fan_out"
        if layer.lora_variant or any(layer.use_dora.values()):
            return f"{name}: a LoRA variant (DoRA, aLoRA, ...)"
        if type(layer.get_base_layer()) is not torch.nn.Linear:
            return f"{name}: base layer {type(layer.get_base_layer()).__name__}"
    return None


def enable(module: torch.nn.Module) -> bool:
    """Give ``module`` the lean forward when it is supported and not switched off by
    ``RLHFFLOW_LEAN_FORWARD=0``; whether it has it now. Call it before wrapping the
    forward (autocast): a wrapped instance forward keeps transformers' arithmetic."""
    if os.environ.get(ENV, "1") == "0" or "forward" in vars(module):
        return False
    if unsupported(module) is not None:
        return False
    module = transformers_model(module)  # under peft's wrapper: its forward calls this one
    if "forward" in vars(module):
        return False
    base = type(module)
    if getattr(base, "_lean_base", None) is None:
        module.__class__ = _lean_class(base)
    return True


def disable(module: torch.nn.Module) -> None:
    """Give ``module`` (under peft's wrapper: its transformers model) transformers'
    forward back, where ``enable`` gave it the lean one."""
    module = transformers_model(module)
    base = getattr(type(module), "_lean_base", None)
    if base is not None:
        module.__class__ = base


_CLASSES: dict[type, type] = {}


def _lean_class(base: type) -> type:
    """A subclass of ``base`` (same name) whose forward is ``lean_forward``."""
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (base,), {
            "forward": lean_forward, "_lean_base": base, "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__doc__": base.__doc__})
    return _CLASSES[base]


def lean_forward(self, input_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache: object | None = None,
                 inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                 past_key_values: object | None = None, **kwargs):
    """transformers' ``LlamaForCausalLM.forward``, lean (see the module docstring)."""
    from transformers import DynamicCache
    from transformers.modeling_outputs import CausalLMOutputWithPast

    cache = cache if cache is not None else past_key_values
    inner = self.model
    if (input_ids is None or input_ids.numel() == 0 or inputs_embeds is not None
            or labels is not None
            or (attention_mask is not None and attention_mask.dim() != 2)
            or any(v is not None and k not in _HANDLED for k, v in kwargs.items())
            or kwargs.get("return_dict") is False
            or not isinstance(logits_to_keep, int)
            or (cache is not None and type(cache) is not DynamicCache)
            or self.lm_head.weight.dtype != torch.float32  # converted after loading
            or self.lm_head.weight.device.type not in DEVICES
            # ZeRO-3 partitions the parameters and gathers them in module hooks
            or hasattr(self.lm_head.weight, "ds_id")
            or torch.is_autocast_enabled(self.lm_head.weight.device.type)
            or (self.training and (self.config.attention_dropout or
                                   inner.gradient_checkpointing))):
        return self._lean_base.forward(
            self, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
            use_cache=use_cache, logits_to_keep=logits_to_keep,
            **({cache_keyword(self._lean_base.forward): cache} if cache is not None else {}),
            **kwargs)
    if cache is None and (use_cache if use_cache is not None else self.config.use_cache):
        cache = DynamicCache(config=self.config)
    rows, length = input_ids.shape
    past = cache.get_seq_length() if cache is not None else 0
    if position_ids is None:
        position_ids = torch.arange(past, past + length, device=input_ids.device)[None]
    cos, sin = _rotary(inner, int(position_ids.max()) + 1, input_ids.device)
    cos, sin = cos[position_ids][:, None], sin[position_ids][:, None]
    mask = _attention_mask(attention_mask, rows, length, past, input_ids.device)
    hidden = F.embedding(input_ids, inner.embed_tokens.weight, inner.embed_tokens.padding_idx)
    # gradient checkpointing (rlhfflow.engine.recompute): each layer's input is kept, its
    # intermediates are recomputed in the backward pass
    recompute = (getattr(self, "_rlhfflow_recompute", False) and cache is None
                 and torch.is_grad_enabled())
    for index, layer in enumerate(inner.layers[:self.config.num_hidden_layers]):
        if recompute:
            hidden = checkpoint(_layer, layer, hidden, cos, sin, mask, cache, index,
                                use_reentrant=False)
        else:
            hidden = _layer(layer, hidden, cos, sin, mask, cache, index)
    if logits_to_keep:
        # the norm is per position: normed after the cut, the head's input is contiguous
        # (a strided [N, 1, H] view makes F.linear a batched product with the head's
        # weight expanded per row, 6x slower for SmolLM2's 49152-token head)
        hidden = hidden[:, -logits_to_keep:]
    hidden = _rms_norm(inner.norm, hidden)
    logits = _linear(self.lm_head, hidden)
    return CausalLMOutputWithPast(logits=logits, **{output_cache_field(CausalLMOutputWithPast):
                                                    cache})


@functools.cache
def cache_keyword(forward) -> str:
    """The keyword ``forward`` takes a KV cache by: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (an older forward swallows an unknown ``cache`` in its
    ``**kwargs`` and runs without the cache)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@functools.cache
def output_cache_field(output_class: type) -> str:
    """The field of ``output_class`` (``CausalLMOutputWithPast``) that holds the KV cache:
    ``cache`` from transformers 5.24 on, ``past_key_values`` before."""
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm`` (float32 statistics; parameters are float32 here)."""
    return F.rms_norm(hidden, (hidden.shape[-1],), norm.weight, norm.variance_epsilon)


def _layer(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           mask: torch.Tensor | None, cache: object | None, index: int) -> torch.Tensor:
    """One decoder layer: attention, then MLP, each a residual update."""
    hidden = hidden + _attention(layer, hidden, cos, sin, mask, cache, index)
    return hidden + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, hidden))


def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP``: ``down(silu(gate(x)) * up(x))``."""
    return _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


def _attention(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, mask: torch.Tensor | None, cache: object | None,
               index: int) -> torch.Tensor:
    """One decoder layer's attention block (its input norm included), appending the new
    keys and values to ``cache``: the residual update ``[N, L, H]``."""
    attn = layer.self_attn
    x = _rms_norm(layer.input_layernorm, hidden)
    rows, length, _ = x.shape
    shape = (rows, length, -1, attn.head_dim)
    query = _linear(attn.q_proj, x).view(shape).transpose(1, 2)
    key = _linear(attn.k_proj, x).view(shape).transpose(1, 2)
    value = _linear(attn.v_proj, x).view(shape).transpose(1, 2)
    query = query * cos + _rotate_half(query) * sin
    key = key * cos + _rotate_half(key) * sin
    if cache is not None:
        key, value = cache.update(key, value, index)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=attn.scaling,
        is_causal=mask is None and length > 1, enable_gqa=key.shape[1] != query.shape[1])
    return _linear(attn.o_proj, out.transpose(1, 2).reshape(rows, length, -1))


def _linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for a Linear without bias, or peft's LoRA Linear on one."""
    if type(layer) is torch.nn.Linear:
        if (_TRAINING.get() is not None and torch.is_grad_enabled()
                and not layer.weight.requires_grad):
            return FrozenLinear.apply(x, layer.weight)
        return _product(x, layer.weight)
    return _adapted(layer, x)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; within ``sampling`` and without gradients, through
    oneDNN's kernel where it is faster (see the module docstring)."""
    if bias is None and _SAMPLING.get() and not torch.is_grad_enabled():
        return onednn_linear(x, weight)
    return F.linear(x, weight, bias)


def _adapted(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """peft's LoRA ``Linear.forward`` for the active adapters, the same operations in
    the same order: ``W x + B(A(dropout(x))) * scaling`` each; the base alone with the
    adapters disabled. States it does not cover (merged weights, forward hooks such as
    peft's per-row ``adapter_names``, a variant) call the layer itself."""
    if (not is_lora(layer) or layer.merged or layer.lora_variant
            or layer._forward_pre_hooks or layer._forward_hooks):
        return layer(x)
    # adapters switched off since the merged weights were chosen: the base alone
    merged = None if layer.disable_adapters else _from_merged(layer, x)
    if merged is not None:
        return merged
    result = F.linear(x, layer.base_layer.weight, layer.base_layer.bias)
    if layer.disable_adapters:
        return result
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        down, up = layer.lora_A[adapter], layer.lora_B[adapter]
        hidden = F.linear(layer.lora_dropout[adapter](x), down.weight, down.bias)
        result = result + F.linear(hidden, up.weight, up.bias) * layer.scaling[adapter]
    return result


def _from_merged(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """LoRA ``layer``'s output from its merged weight, where the context chose one for
    it: ``merged_adapters`` without gradients, ``training`` with them (unless an
    optimizer step changed its adapters in place since); else None."""
    if not torch.is_grad_enabled():
        weight = (_MERGED.get() or {}).get(id(layer))
        return None if weight is None else _product(x, weight, layer.base_layer.bias)
    chosen = (_TRAINING.get() or {}).get(id(layer))
    if chosen is None:
        return None
    weight, down_version, up_version = chosen
    [adapter] = [a for a in layer.active_adapters if a in layer.lora_A]
    down, up = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    if (down._version, up._version) != (down_version, up_version):  # stepped in place
        return None
    return MergedLoRA.apply(x, weight, down, up, layer.scaling[adapter])


@contextlib.contextmanager
def merged_adapters(module: torch.nn.Module) -> Iterator[None]:
    """Within, the lean forward of LoRA ``module`` computes each adapted layer, when no
    gradients are taken, as one product with its merged weight ``W + scaling * B A``
    instead of the base product plus the adapters' two: what a decode step costs is then
    the base model's. The merged weights are made on entry where the adapters (or the
    base) changed since the last entry, and kept on ``module`` until then: one more copy
    of the adapted layers' weights. Outputs equal the adapters' path up to float
    rounding (not bitwise). A model without the lean forward or adapters, and layers
    whose dropout is active (train mode), compute as they would outside."""
    base = transformers_model(module)
    if module is base or getattr(type(base), "_lean_base", None) is None:
        yield
        return
    token = _MERGED.set(merged_weights(module, base))
    try:
        yield
    finally:
        _MERGED.reset(token)


@contextlib.contextmanager
def sampling(module: torch.nn.Module, merge: bool = True) -> Iterator[None]:
    """Where ``module`` samples (callers take no gradients): its lean forward's products
    go through oneDNN's kernel (``_product``) and, with ``merge``, a LoRA model's adapted
    layers through their merged weights (``merged_adapters``)."""
    token = _SAMPLING.set(True)
    try:
        with merged_adapters(module) if merge else contextlib.nullcontext():
            yield
    finally:
        _SAMPLING.reset(token)


@contextlib.contextmanager
def training(module: torch.nn.Module, merged: bool = True) -> Iterator[None]:
    """Where LoRA ``module`` takes one training step: the forward and backward passes of
    a loss, the optimizer step last. Its lean forward computes every plain Linear whose
    weight does not train (the output head, layers without adapters) through oneDNN's
    kernel, forward and input gradient (``FrozenLinear``); and, with ``merged``, each
    adapted layer whose merged weight, made for sampling (``merged_adapters``), still
    matches its adapters as one product with it: the adapters' two products and their
    sum are not computed, and the gradients of ``x``, ``A`` and ``B`` come from
    ``MergedLoRA``, equal to the adapters' path up to float rounding. Nothing is merged
    here: a layer without a current merged weight (none made on this worker, or the
    adapters stepped since, as after a minibatch's update) takes the adapters' path
    (the base product as MKL computes it), which costs less than merging again for one
    forward; so does a layer whose adapters an optimizer step changed in place since
    entry. A model without adapters or the lean forward, or not on the CPU (where
    autograd's device threads would not see this context), computes as outside."""
    base = transformers_model(module)
    if (module is base or getattr(type(base), "_lean_base", None) is None
            or base.lm_head.weight.device.type != "cpu"):
        yield
        return
    cache = module.__dict__.get("_lean_merged", {}) if merged else {}
    weights = {}
    for name, layer, adapters in mergeable_layers(base) if cache else ():
        entry = cache.get(name)
        if entry is None or layer.base_layer.weight.requires_grad:
            continue
        if len(adapters) == 1 and entry.current(layer, adapters):
            down, up = layer.lora_A[adapters[0]].weight, layer.lora_B[adapters[0]].weight
            weights[id(layer)] = (entry.weight, down._version, up._version)
    token = _TRAINING.set(weights)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attention_mask(attention_mask: torch.Tensor | None, rows: int, length: int, past: int,
                    device: torch.device) -> torch.Tensor | None:
    """Which keys each new token sees, ``[N, 1, L, past + L]`` (bool): keys at or before
    its own column that the 0/1 ``attention_mask`` over past and new tokens marks real.
    None where that is plain causal attention over everything (SDPA's ``is_causal``,
    as transformers does): no padding and no cache, or one new token and no padding."""
    if attention_mask is None or bool(attention_mask.all()):
        if past == 0 or length == 1:
            return None
        attention_mask = None
    total = past + length
    causal = torch.ones(length, total, dtype=torch.bool, device=device).tril(past)
    if attention_mask is None:
        return causal[None, None].expand(rows, 1, length, total)
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def _rotary(inner: torch.nn.Module, positions: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[P, head_dim]`` for positions ``0 .. P-1``, computed as
    ``LlamaRotaryEmbedding`` computes them per call (the same float32 products), kept
    on the model and grown by doubling."""
    rotary = inner.rotary_emb
    table = getattr(rotary, "_lean_table", None)
    if table is None or table[0].shape[0] < positions or table[0].device != device:
        size = max(positions, 2 * (table[0].shape[0] if table is not None else 64))
        steps = torch.arange(size, device=device, dtype=torch.float32)
        freqs = steps[:, None] * rotary.inv_freq.to(device=device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        table = (emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling)
        rotary._lean_table = table
    return table
