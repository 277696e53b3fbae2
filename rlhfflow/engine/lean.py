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
  transformers, with and without a KV cache (``tests/test_lean.py``). Gradients flow
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
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: Environment switch: "0" keeps transformers' forward everywhere.
ENV = "RLHFFLOW_LEAN_FORWARD"
#: RoPE types whose inverse frequencies change with the sequence length: their
#: ``rotary_emb`` recomputes them in forward, so a fixed table would be wrong.
_DYNAMIC_ROPE = ("dynamic", "longrope")
#: Keyword arguments transformers' forward takes that this one handles (others fall back).
_HANDLED = frozenset({"return_dict"})
#: Device types whose models get the lean forward: where it was checked against
#: transformers (bitwise on CPU). Elsewhere a model keeps transformers' forward.
DEVICES: frozenset[str] = frozenset({"cpu"})


def unsupported(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot use the lean forward, or None when it can."""
    from transformers import LlamaForCausalLM

    cls = type(module)
    if getattr(cls, "_lean_base", None) is not None:
        return None  # already lean
    if cls is not LlamaForCausalLM:
        return f"{cls.__name__} is not LlamaForCausalLM"
    config = module.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in (None, "sdpa"):
        return f"attn_implementation {attention!r} (the lean forward is SDPA)"
    if getattr(module.model.rotary_emb, "rope_type", "default") in _DYNAMIC_ROPE:
        return f"rope_type {module.model.rotary_emb.rope_type!r}"
    if any(p.dtype != torch.float32 for p in module.parameters()):
        return "parameters are not float32"
    elsewhere = {p.device.type for p in module.parameters()} - DEVICES
    if elsewhere:
        return (f"parameters on {', '.join(sorted(elsewhere))} (the lean forward is checked "
                f"on {', '.join(sorted(DEVICES)) or 'no device'} only)")
    return None


def enable(module: torch.nn.Module) -> bool:
    """Give ``module`` the lean forward when it is supported and not switched off by
    ``RLHFFLOW_LEAN_FORWARD=0``; whether it has it now. Call it before wrapping the
    forward (autocast): a wrapped instance forward keeps transformers' arithmetic."""
    if os.environ.get(ENV, "1") == "0" or "forward" in vars(module):
        return False
    if unsupported(module) is not None:
        return False
    base = type(module)
    if getattr(base, "_lean_base", None) is None:
        module.__class__ = _lean_class(base)
    return True


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
            or not _HANDLED.issuperset(kwargs) or kwargs.get("return_dict") is False
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
    hidden = _rms_norm(inner.norm, hidden)
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:]
    logits = F.linear(hidden, self.lm_head.weight)
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
    return F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                    mlp.down_proj.weight)


def _attention(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, mask: torch.Tensor | None, cache: object | None,
               index: int) -> torch.Tensor:
    """One decoder layer's attention block (its input norm included), appending the new
    keys and values to ``cache``: the residual update ``[N, L, H]``."""
    attn = layer.self_attn
    x = _rms_norm(layer.input_layernorm, hidden)
    rows, length, _ = x.shape
    shape = (rows, length, -1, attn.head_dim)
    query = F.linear(x, attn.q_proj.weight).view(shape).transpose(1, 2)
    key = F.linear(x, attn.k_proj.weight).view(shape).transpose(1, 2)
    value = F.linear(x, attn.v_proj.weight).view(shape).transpose(1, 2)
    query = query * cos + _rotate_half(query) * sin
    key = key * cos + _rotate_half(key) * sin
    if cache is not None:
        key, value = cache.update(key, value, index)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=attn.scaling,
        is_causal=mask is None and length > 1, enable_gqa=key.shape[1] != query.shape[1])
    return F.linear(out.transpose(1, 2).reshape(rows, length, -1), attn.o_proj.weight)


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
