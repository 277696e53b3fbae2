"""``generate``: sample responses from a causal LM with a KV cache.

Sampling is reproducible **per sample**: every row draws its random numbers from its own
generator seeded by ``(seed, iteration, prompt_index, sample_index)``, so a prompt's
response does not depend on which batch or micro-batch it lands in. Each step samples by
inverse CDF with that row's uniform draw, which is exact categorical sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from pydantic import Field

from rlhfflow.stages.base import Batch, Column, Stage, StageContext, StageParams, register_stage
from rlhfflow.stages.common import position_ids, stage_seed


class GenerateParams(StageParams):
    """Sampling settings. A response ends at an EOS id (the tokenizer's and the model's
    ``generation_config``'s) or right after the first of the ``stop`` strings."""

    max_new_tokens: Annotated[int, Field(gt=0)] = 32
    temperature: Annotated[float, Field(gt=0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    greedy: bool = False
    stop: list[str] = []


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. ``logits [N, V]``."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the tokens before it already cover top_p (keeps at least one)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_uniforms(seed: int, iteration: int, prompt_index: torch.Tensor,
                    sample_index: torch.Tensor, steps: int) -> torch.Tensor:
    """One uniform per row and step ``[N, steps]``, each row from its own generator."""
    rows = []
    for p, s in zip(prompt_index.tolist(), sample_index.tolist(), strict=True):
        gen = torch.Generator().manual_seed(stage_seed(seed, iteration, p, s))
        rows.append(torch.rand(steps, generator=gen, dtype=torch.float64))
    return torch.stack(rows) if rows else torch.zeros(0, steps, dtype=torch.float64)


def sample_step(logits: torch.Tensor, uniforms: torch.Tensor, params: GenerateParams
                ) -> torch.Tensor:
    """Sample one token per row from ``logits [N, V]`` with ``uniforms [N]``."""
    if params.greedy:
        return logits.argmax(-1)
    filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(filtered.double(), dim=-1)
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    token = torch.searchsorted(cdf, target).squeeze(-1)
    # searchsorted may land on a zero-probability token after the last positive one
    return token.clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def generate(module: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             uniforms: torch.Tensor, params: GenerateParams,
             eos_id: int | Sequence[int] | None, pad_id: int) -> dict[str, torch.Tensor]:
    """Sample up to ``max_new_tokens`` per left-padded prompt with a KV cache.

    Returns ``response_ids [N, max_new_tokens]`` (right-padded with ``pad_id``),
    ``response_mask`` (1 up to and including EOS) and ``sample_logprobs``: the log-prob
    of each sampled token under ``log_softmax(logits / temperature)`` (unfiltered, the
    distribution the policy loss uses).
    """
    device = next(module.parameters()).device
    rows, steps = prompt_ids.shape[0], params.max_new_tokens
    mask = prompt_mask.long().to(device)
    out = module(input_ids=prompt_ids.to(device), attention_mask=mask,
                 position_ids=position_ids(mask), use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1].float()
    next_pos = mask.sum(-1, keepdim=True)
    tokens = torch.full((rows, steps), pad_id, dtype=torch.long)
    logprobs = torch.zeros(rows, steps)
    response_mask = torch.zeros(rows, steps, dtype=torch.int8)
    alive = torch.ones(rows, dtype=torch.bool)  # no EOS yet: this step's token is real
    for t in range(steps):
        token = sample_step(logits, uniforms[:, t], params).cpu()
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        lp = torch.log_softmax(logits / params.temperature, -1).cpu()
        logprobs[:, t] = lp.gather(-1, token[:, None]).squeeze(-1) * alive
        tokens[:, t] = token
        response_mask[:, t] = alive
        if eos_id is not None:
            alive &= ~torch.isin(token, torch.as_tensor(eos_id))
        if not alive.any() or t == steps - 1:
            break
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=device)], dim=1)
        out = module(input_ids=token[:, None].to(device), attention_mask=mask,
                     position_ids=next_pos, past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        next_pos = next_pos + 1
    return {"response_ids": tokens, "response_mask": response_mask,
            "sample_logprobs": logprobs}


@register_stage
class GenerateStage(Stage):
    """Sample responses from a causal LM (the actor). Writes response tokens, their mask,
    the sampling log-probs and ``policy_version``: the version of the weights that
    sampled each row (how stale it is when trained on)."""

    type_name = "generate"
    Params = GenerateParams
    model_head = "lm"
    generates = True

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("prompt_ids", "prompt_mask", "prompt_index", "sample_index")

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"response_ids": Column("int64", "response"),
                "response_mask": Column("int8", "response"),
                "sample_logprobs": Column("float32", "response"),
                "policy_version": Column("int64"),
                "response_text": Column("str")}

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        tok = resident.tokenizer
        uniforms = sample_uniforms(ctx.seed, ctx.iteration, batch["prompt_index"],
                                   batch["sample_index"], self.params.max_new_tokens)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        out = generate(resident.module, batch["prompt_ids"], batch["prompt_mask"], uniforms,
                       self.params, eos_ids(resident.module, tok), pad_id)
        if self.params.stop:
            cut_at_stop(out, tok, self.params.stop, pad_id)
        real = out["response_ids"].masked_fill(out["response_mask"] == 0, pad_id)
        out["response_text"] = tok.batch_decode(real.tolist(), skip_special_tokens=True)
        out["policy_version"] = torch.full((len(real),), resident.version, dtype=torch.long)
        return out



# ---------------------------------------------------------------------------------------
# Where a response ends (owned by the data side): EOS ids and stop strings.


def eos_ids(module: torch.nn.Module, tokenizer) -> list[int] | None:
    """Every EOS id of a model: the tokenizer's and its ``generation_config``'s (an int or
    a list: chat models often end a turn with a token that is not the tokenizer's EOS,
    e.g. ``<|im_end|>``)."""
    ids = [tokenizer.eos_token_id]
    config_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    ids += config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return ids or None


def cut_at_stop(out: dict[str, torch.Tensor], tokenizer, stops: Sequence[str],
                pad_id: int) -> None:
    """End each response at the token that completes its first stop string (kept, as
    transformers' ``stop_strings`` does): later tokens are padded and masked out. Done
    after sampling: tokens after a stop never influence those before it, so the kept
    tokens, log-probs and mask are those of a loop that had stopped there."""
    for row in range(out["response_ids"].shape[0]):
        length = int(out["response_mask"][row].sum())
        ids = out["response_ids"][row, :length].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not any(stop in text for stop in stops):
            continue
        # the shortest prefix whose text holds a stop string (decoded prefixes grow)
        low, high = 1, length
        while low < high:
            mid = (low + high) // 2
            prefix = tokenizer.decode(ids[:mid], skip_special_tokens=True)
            if any(stop in prefix for stop in stops):
                high = mid
            else:
                low = mid + 1
        out["response_ids"][row, low:] = pad_id
        out["response_mask"][row, low:] = 0
        out["sample_logprobs"][row, low:] = 0.0
