"""Tensor plumbing shared by stages: how a (prompt, response) batch enters a model.

Layout: ``prompt_ids [N, Lp]`` left-padded (``prompt_mask``), ``response_ids [N, Lr]``
right-padded (``response_mask``). The model sees ``cat(prompt, response)`` with positions
counted over real tokens only, so padding never shifts a sample's positions; the logits
at position ``Lp + t - 1`` predict response token ``t``. The model attends to every
response token up to a row's last masked one (``response_attention``): a mask with holes
(a multi-turn episode's environment tokens) marks context the losses skip.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from rlhfflow import ops
from rlhfflow.engine.batch import Batch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens: ``[N, L]`` from a 0/1 mask ``[N, L]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_attention(response_mask: torch.Tensor) -> torch.Tensor:
    """The response tokens a model attends to, ``[N, Lr]`` (long): every token up to a
    row's last one that ``response_mask`` marks. A mask with holes marks tokens that are
    context but not the model's own (the environment's turns of a multi-turn episode,
    ``rlhfflow.stages.rollout``): the model must see them as the sampler did, while the
    losses, which multiply by ``response_mask``, skip them. A prefix mask is unchanged."""
    return response_mask.long().flip(-1).cummax(-1).values.flip(-1)


def sequence_inputs(batch: Batch, device: str | torch.device = "cpu"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(input_ids [N, Lp+Lr], attention_mask, position_ids, Lp)`` for a batch."""
    prompt_ids, response_ids = batch["prompt_ids"], batch["response_ids"]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1).to(device)
    mask = torch.cat([batch["prompt_mask"].long(), response_attention(batch["response_mask"])],
                     dim=1)
    mask = mask.to(device)
    return input_ids, mask, position_ids(mask), prompt_ids.shape[1]


def response_logits(module: torch.nn.Module, batch: Batch, temperature: float = 1.0
                    ) -> torch.Tensor:
    """Logits ``[N, Lr, V]`` (float32, divided by ``temperature``) predicting each
    response token. Past a row's last real token the values mean nothing (padding's
    logits, or 0 where the row's length group was cut); every user masks them.

    A model that takes a KV cache (transformers' causal LMs and token-classification
    heads) skips work the padded layout would make it do (``response_parts``):
    rows that repeat a prompt (the samples of one prompt under GRPO, RLOO, best-of-N;
    the two sides of a DPO pair) share its forward, each distinct prompt running once
    with its KV cache rows repeated, and the responses run on top of that cache in
    groups of similar length, each cut to its longest row, so right padding is not
    computed. Causal attention makes a prompt's hidden states independent of what
    follows it, and a token's of what follows it, so this is the same function, and its
    gradient the same sum, over fewer tokens. Values move by float rounding only
    (~1e-7: the matrix products have other shapes)."""
    device = next(module.parameters()).device
    response_len = batch["response_ids"].shape[1]
    # a sharded model's ranks must make the same forward calls (each gathers the weights
    # with the other ranks), and the parts' count depends on a rank's rows: one call
    parts = response_parts(batch) if _takes_cache(module) and not _sharded(module) else None
    if parts is not None:
        logits = _logits_in_parts(module, batch, parts, device)
    elif _keeps_logits(module):
        input_ids, mask, positions, prompt_len = sequence_inputs(batch, device)
        # the LM head only where a response token is predicted (positions Lp-1 ..
        # Lp+Lr-2): with a real vocabulary the head is a large share of the forward, and
        # the prompt's logits were computed only to be thrown away (same values, tested)
        out = module(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                     use_cache=False, logits_to_keep=response_len + 1)
        logits = out.logits[:, :response_len].float()
    else:
        input_ids, mask, positions, prompt_len = sequence_inputs(batch, device)
        out = module(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                     use_cache=False)
        logits = out.logits[:, prompt_len - 1: prompt_len - 1 + response_len].float()
    return logits / temperature if temperature != 1.0 else logits


def _sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded over a gang (FSDP2's DTensors)."""
    from rlhfflow.engine.parallel import is_sharded

    return is_sharded(next(module.parameters()))


#: A response group of its own must save more than this share of the padded batch's
#: tokens: the fixed work of a forward call (Python, small ops). Measured on one CPU
#: core, forward and backward of 32 rows x 77 tokens split in 2 and 4 calls instead of
#: one: +3% and +10% on the 2-layer, 64-wide tiny model, nothing measurable on a
#: 6-layer, 256-wide one; 8% keeps tiny models from paying for groups.
CALL_SHARE = 0.08
#: Response groups at most (``length_groups``).
MAX_RESPONSE_GROUPS = 4
#: Distinct prompts that begin with this many of the same tokens or more (a system
#: prompt, the tools' schemas) run them once (``_prefix_forward``). A chat template's
#: own header (27 tokens of SmolLM2's) saves too little to pay for the extra call and
#: the cache copy; the calculator example's Hermes prompts share 307 of their 321.
MIN_SHARED_PREFIX = 64


def length_groups(sorted_lengths: torch.Tensor, call_cost: float,
                  max_groups: int = MAX_RESPONSE_GROUPS) -> list[int]:
    """Where to cut rows sorted by length into at most ``max_groups`` groups, each
    padded to its longest row, so that the padded tokens plus ``call_cost`` per group
    after the first are fewest: the end index of each group. Groups end only where the
    length changes, so this is a small dynamic program over the distinct lengths."""
    rows = len(sorted_lengths)
    change = (sorted_lengths[1:] != sorted_lengths[:-1]).nonzero().squeeze(-1) + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), change,
                        torch.tensor([rows])]).double()
    # cost[a, b]: the rows between boundaries a < b, padded to the length at b's end
    top = sorted_lengths[(bounds[1:] - 1).long()].double()
    span = bounds[1:][None, :] - bounds[:-1][:, None]
    cost = torch.where(span > 0, span * top[None, :], torch.inf)
    best = torch.full((len(bounds),), torch.inf, dtype=torch.float64)
    best[0] = 0.0
    choices, totals = [], []
    for groups in range(1, max_groups + 1):
        # best[b]: the fewest tokens covering rows up to boundary b in `groups` groups
        total = best[:-1, None] + cost
        best_next, came_from = total.min(0)
        best = torch.cat([torch.full((1,), torch.inf, dtype=torch.float64), best_next])
        choices.append(came_from)
        totals.append(float(best[-1]) + call_cost * (groups - 1))
    groups = min(range(max_groups), key=totals.__getitem__) + 1
    cuts, at = [], len(bounds) - 1
    for level in range(groups - 1, -1, -1):
        cuts.append(int(bounds[at]))
        at = int(choices[level][at - 1])
    return cuts[::-1]


@dataclass
class ResponseParts:
    """How ``response_logits`` runs a batch: ``shared`` (``shared_prompt_rows``, or None
    when every row has its own prompt) and ``groups``, row indices with the response
    length each group is cut to."""

    shared: tuple[torch.Tensor, torch.Tensor] | None
    groups: list[tuple[torch.Tensor, int]]


def response_parts(batch: Batch) -> ResponseParts | None:
    """The split ``response_logits`` uses for ``batch``; None when one plain forward over
    every row is cheapest (no prompt repeats, and no length groups that pay)."""
    shared = shared_prompt_rows(batch["prompt_ids"], batch["prompt_mask"])
    mask = batch["response_mask"].cpu()
    rows, width = mask.shape
    # a row's length: through its last real token (masks are prefixes; this is safe
    # for any mask)
    lengths = ((mask != 0).long() * torch.arange(1, width + 1)).amax(-1).clamp(min=1)
    order = torch.argsort(lengths, stable=True)
    ends = length_groups(lengths[order], CALL_SHARE * rows * width)
    starts = [0, *ends[:-1]]
    best = [(order[lo:hi], int(lengths[order[hi - 1]])) for lo, hi in zip(starts, ends,
                                                                          strict=True)]
    if shared is None and len(best) == 1 and best[0][1] == width:
        return None
    return ResponseParts(shared, best)


def shared_prompt_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows with the same (left-padded) prompt: ``(first [U], inverse [N])``, the first
    row of each distinct prompt and, per row, the index of its prompt in ``first``;
    None when no two rows share a prompt."""
    rows = prompt_ids.shape[0]
    if rows < 2:
        return None
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1).cpu()
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1
    if distinct == rows:
        return None
    first = torch.full((distinct,), rows, dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(rows), "amin")
    # number the prompts in order of first appearance (unique sorts them by value)
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(distinct)
    return first[order], rank[inverse]


def prefill(module: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            device: str | torch.device) -> tuple[object, torch.Tensor]:
    """The forward over left-padded prompts that starts decoding: ``(cache, logits
    [N, V])``, the KV cache of every row and the float logits at its last position.
    Rows that repeat a prompt share its forward (``shared_prompt_rows``): the prompt
    runs once and its cache rows are repeated."""
    shared = shared_prompt_rows(prompt_ids, prompt_mask)
    cache, logits, inverse = _prompt_forward(module, prompt_ids, prompt_mask, shared, device)
    if shared:
        cache.reorder_cache(inverse)
        logits = logits[inverse]
    return cache, logits


def _prompt_forward(module: torch.nn.Module, prompt_ids: torch.Tensor,
                    prompt_mask: torch.Tensor,
                    shared: tuple[torch.Tensor, torch.Tensor] | None,
                    device: str | torch.device) -> tuple[object, torch.Tensor, torch.Tensor]:
    """One forward over each distinct prompt: ``(cache [U], last logits [U, V], inverse
    [N])``, ``inverse`` (on ``device``) naming each row's prompt."""
    from transformers import DynamicCache

    if shared is None:
        first, inverse = slice(None), torch.arange(prompt_ids.shape[0])
    else:
        first, inverse = shared
    ids, mask = prompt_ids[first].to(device), prompt_mask[first].long().to(device)
    prefix = shared_prefix(ids, mask)
    if prefix:
        cache, logits = _prefix_forward(module, ids, mask, prefix)
        return cache, logits, inverse.to(device)
    # a cache of our own, which the model fills in place: a token-classification
    # head's output does not return the cache its base model filled
    cache = DynamicCache(config=module.config)
    out = module(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                 use_cache=True, **cache_kwargs(module, cache), **last_logits_kwargs(module))
    return cache, out.logits[:, -1].float(), inverse.to(device)


def common_prefix(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many real tokens every one of the left-padded prompts ``[U, Lp]`` begins
    with, short of the shortest prompt's last token (each keeps one of its own, whose
    logits start its response); 0 for a single prompt."""
    rows = prompt_ids.shape[0]
    lengths = prompt_mask.sum(-1)
    shortest = int(lengths.min())
    if rows < 2 or shortest < 2:
        return 0
    # each prompt's first `shortest` real tokens, left-aligned
    columns = prompt_ids.shape[1] - lengths[:, None] + torch.arange(shortest,
                                                                     device=lengths.device)
    heads = prompt_ids.gather(1, columns)
    same = (heads == heads[:1]).all(0)
    return min(int(same.long().cumprod(0).sum()), shortest - 1)


def shared_prefix(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """The leading real tokens the distinct prompts ``[U, Lp]`` share that a prompt
    forward runs once (``common_prefix``, when ``MIN_SHARED_PREFIX`` or more), else 0."""
    prefix = common_prefix(prompt_ids, prompt_mask)
    return prefix if prefix >= MIN_SHARED_PREFIX else 0


def _prefix_forward(module: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                    prefix: int) -> tuple[object, torch.Tensor]:
    """The prompt forward of distinct prompts ``ids [U, Lp]`` (left-padded, ``mask``)
    that all begin with the same ``prefix`` real tokens (a system prompt, the tools'
    schemas): the prefix runs once, as one row, and each prompt's rest on its cache.
    Returns ``(cache, last logits [U, V])`` as one forward over ``ids`` would: the cache
    in the left-padded layout of ``mask`` (callers extend it with the same mask), its
    padding columns holding copies that the mask hides. Causal attention makes the
    prefix's keys and values independent of what follows, so this is the same function
    (and, under gradients, the same sum) over fewer tokens; values move by float
    rounding only (the products have other shapes)."""
    from transformers import DynamicCache

    rows, width = ids.shape
    lengths = mask.sum(-1)
    rest = int(lengths.max()) - prefix
    # the prefix, as the first real tokens of row 0 (all rows have them)
    start = width - int(lengths[0])
    head = ids[:1, start:start + prefix]
    cache = DynamicCache(config=module.config)
    module(input_ids=head, attention_mask=torch.ones_like(head), use_cache=True,
           position_ids=torch.arange(prefix, device=ids.device)[None],
           **cache_kwargs(module, cache), **last_logits_kwargs(module))
    # every row on the prefix's cache; its rest left-padded to `rest` columns (the
    # last `rest` columns of the prompt: the rest is right-aligned there too)
    layers = [(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
              for layer in cache.layers]
    cache = DynamicCache(ddp_cache_data=layers, config=module.config)
    # (a shorter row's columns before its rest hold prefix tokens: holes here)
    own = torch.arange(rest, device=ids.device)[None] >= (prefix + rest - lengths)[:, None]
    tail_mask = torch.cat([torch.ones(rows, prefix, dtype=mask.dtype, device=mask.device),
                           own.to(mask.dtype)], dim=1)
    out = module(input_ids=ids[:, width - rest:], attention_mask=tail_mask,
                 position_ids=position_ids(tail_mask)[:, prefix:], use_cache=True,
                 **cache_kwargs(module, cache), **last_logits_kwargs(module))
    # cache columns [prefix | rest] to the prompts' layout [padding | prefix | rest]:
    # column j of row u is prefix token j - pad_u, or the rest's column that ends as j
    column = torch.arange(width, device=ids.device)[None]
    pad = width - lengths[:, None]
    source = torch.where(column < pad + prefix, (column - pad).clamp(min=0),
                         column - width + prefix + rest)
    layers = []
    for layer in cache.layers:
        index = source[:, None, :, None].expand(-1, layer.keys.shape[1], -1,
                                                layer.keys.shape[-1])
        layers.append((layer.keys.gather(2, index), layer.values.gather(2, index)))
    return (DynamicCache(ddp_cache_data=layers, config=module.config),
            out.logits[:, -1].float())


def cache_kwargs(module: torch.nn.Module, cache: object) -> dict[str, object]:
    """The forward keyword that passes a KV cache: ``cache`` from transformers 5.24 on
    (``past_key_values`` is deprecated there, with a warning on every process, and goes in
    5.40), ``past_key_values`` before."""
    return {"cache" if "cache" in _forward_parameters(module) else "past_key_values": cache}


def _forward_parameters(module: torch.nn.Module) -> frozenset[str]:
    """The keyword names of ``module``'s forward (looked up once per class); a LoRA
    model's (peft's wrapper passes its keywords on) are its base model's."""
    if hasattr(module, "peft_config") and hasattr(module, "get_base_model"):
        module = module.get_base_model()
    forward = type(module).forward
    if forward not in _FORWARD_PARAMETERS:
        import inspect

        _FORWARD_PARAMETERS[forward] = frozenset(inspect.signature(forward).parameters)
    return _FORWARD_PARAMETERS[forward]


_FORWARD_PARAMETERS: dict = {}


def output_cache(out: object) -> object:
    """The KV cache a forward with ``use_cache=True`` returned (``cache`` from
    transformers 5.24 on, ``past_key_values`` before; the old name warns on the new)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def _logits_in_parts(module: torch.nn.Module, batch: Batch, parts: ResponseParts,
                     device: str | torch.device, temperature: float | None = None
                     ) -> torch.Tensor:
    """``response_logits`` run as ``parts`` says: each distinct prompt once, then each
    response group on its rows' cache, cut to the group's length (see there). With a
    ``temperature``, each group's logits become the log-probs ``[N, Lr]`` of its response
    tokens at that temperature instead (``response_logprobs``): the logits of the whole
    batch, ``[N, Lr, V]``, are never assembled (at a real vocabulary each copy of them,
    and each copy's backward, is a few percent of a training step)."""
    prompt_mask = batch["prompt_mask"].long()
    response_len = batch["response_ids"].shape[1]
    prompt_cache, first_logits, inverse = _prompt_forward(
        module, batch["prompt_ids"], prompt_mask, parts.shared, device)
    labels = batch["response_ids"].to(device)
    if temperature is not None:  # token 0's log-probs, once per distinct prompt
        first_logits = torch.log_softmax(ops.tempered(first_logits, temperature), -1)
    pieces, order = [], []
    for index, length in parts.groups:
        # response tokens 0 .. length-2 predict tokens 1 .. length-1; the prompt's last
        # position predicted token 0
        rows = index.to(device)
        prompts = inverse[rows]  # each row's distinct prompt
        if temperature is None:
            logits = first_logits[prompts][:, None]
        else:
            logits = first_logits[prompts, labels[rows, 0]][:, None]
        if length > 1:
            cache = _cache_rows(prompt_cache, prompts)
            mask = torch.cat([prompt_mask[index], response_attention(
                batch["response_mask"][index])[:, :length - 1]], dim=1).to(device)
            step = module(input_ids=batch["response_ids"][index, :length - 1].to(device),
                          attention_mask=mask,
                          position_ids=position_ids(mask)[:, prompt_mask.shape[1]:],
                          use_cache=True, **cache_kwargs(module, cache))
            rest = step.logits.float()
            if temperature is not None:
                rest = ops.logprobs_from_logits(ops.tempered(rest, temperature),
                                                labels[rows, 1:length])
            logits = torch.cat([logits, rest], dim=1)
        if length < response_len:  # a pad of nothing would still copy [rows, Lr, V]
            widths = (0, response_len - length)
            logits = torch.nn.functional.pad(logits, widths if temperature is not None
                                             else (0, 0, *widths))
        pieces.append(logits)
        order.append(index)
    logits = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    rows = torch.cat(order)
    if torch.equal(rows, torch.arange(len(rows))):  # already in order: no copy
        return logits
    return logits[torch.argsort(rows.to(device))]


def _cache_rows(cache: object, rows: torch.Tensor) -> object:
    """A new cache holding ``rows`` of ``cache`` (the prompt cache stays as it was, for
    the next response group)."""
    import copy

    selected = copy.copy(cache)
    selected.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in selected.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)
    return selected


def _takes_cache(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward takes a KV cache (transformers' causal LMs and
    token-classification heads do; a wrapper such as a DeepSpeed engine does not say)."""
    names = _forward_parameters(module)
    return "cache" in names or "past_key_values" in names


def last_logits_kwargs(module: torch.nn.Module) -> dict[str, int]:
    """Forward keywords that compute the LM head at the last position only (a prefill
    needs no more): at a real vocabulary the head over every prompt token is a fifth of
    a prefill's work (SmolLM2-135M, 49k tokens)."""
    return {"logits_to_keep": 1} if _keeps_logits(module) else {}


def _keeps_logits(module: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs)."""
    return "logits_to_keep" in _forward_parameters(module)


def response_logprobs(module: torch.nn.Module, batch: Batch, temperature: float = 1.0
                      ) -> torch.Tensor:
    """Per-token log-probs ``[N, Lr]`` of the response under ``module`` at
    ``temperature``; 0 on padding. The values of ``ops.logprobs_from_logits`` on
    ``response_logits``, computed group by group where that splits the batch (the
    log-softmax is per position, so they are the same values)."""
    # one call on a sharded model, as in response_logits
    parts = response_parts(batch) if _takes_cache(module) and not _sharded(module) else None
    if parts is not None:
        device = next(module.parameters()).device
        logprobs = _logits_in_parts(module, batch, parts, device, temperature)
    else:
        logits = response_logits(module, batch, temperature)
        labels = batch["response_ids"].to(logits.device)
        logprobs = ops.logprobs_from_logits(logits, labels)
    return logprobs * batch["response_mask"].to(logprobs.device)


def response_values(module: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-token values ``[N, Lr]`` from a value-head model, aligned with the log-probs
    (the value of the state before each response token); 0 on padding."""
    device = next(module.parameters()).device
    # one call on a sharded model, as in response_logits
    parts = response_parts(batch) if _takes_cache(module) and not _sharded(module) else None
    if parts is not None:  # each prompt once, responses cut to length (response_logits)
        values = _logits_in_parts(module, batch, parts, device)[..., 0]
    else:
        input_ids, mask, positions, prompt_len = sequence_inputs(batch, device)
        response_len = batch["response_ids"].shape[1]
        out = module(input_ids=input_ids, attention_mask=mask, position_ids=positions)
        values = out.logits[..., 0].float()[:, prompt_len - 1: prompt_len - 1 + response_len]
    return values * batch["response_mask"].to(values.device)


def minibatch_indices(rows: int, minibatches: int, generator: torch.Generator,
                      shuffle: bool = True) -> list[torch.Tensor]:
    """Split ``range(rows)`` into ``minibatches`` near-equal index sets."""
    order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
    return [chunk for chunk in torch.tensor_split(order, minibatches) if len(chunk)]


def stage_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from integers and strings (``hash()`` is salted per process,
    so it cannot be used for anything that must repeat across workers)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        if isinstance(part, str):
            part = int.from_bytes(hashlib.blake2b(part.encode(), digest_size=8).digest(),
                                  "little")
        value = _splitmix64(value ^ (int(part) & 0xFFFFFFFFFFFFFFFF))
    return value & 0x7FFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
