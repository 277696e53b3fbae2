"""KV-cached decoding of the active rows of a batch: compaction and speculative verification.

A :class:`KVState` holds one model's cache for the rows still decoding. Rows may carry
*holes*: cache columns whose attention-mask entry is 0 (left padding, rejected draft
tokens). Positions are explicit (``next_pos``), so a hole never shifts a row's positions.

:func:`verify` is speculative rejection sampling (Leviathan et al. 2023; Chen et al.
2023): the target scores ``[last, d_1..d_k]`` in one forward, draft token ``d_i`` is kept
with probability ``min(1, p_i(d_i) / q_i(d_i))``, the first rejected one is replaced by a
draw from ``norm(max(p - q, 0))``, and when all are kept a bonus token is drawn from
``p_{k+1}``. Every emitted token is then distributed exactly as the target's.

Randomness is counter-based per row: the uniforms used for output position ``t`` of a row
are ``u_sample[t]`` (today's stream: plain draws and residual/bonus draws),
``u_accept[t]`` (the accept test of the draft token at ``t``) and ``u_draft[t]`` (a model
drafter's own draw for ``t``). Those for ``t`` are independent of everything that decided
the draft at ``t``, which is what keeps the target distribution exact; with no draft
(``k = 0``) a step is today's plain step, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfflow import ops
from rlhfflow.engine.forward import (
    cache_kwargs,
    last_logits_kwargs,
    output_cache,
    prefill,
    stage_seed,
)
from rlhfflow.engine.sampling import filter_logits, inverse_cdf


@dataclass
class RowStreams:
    """Per-row uniforms ``[N, steps]`` (float64), one set per purpose."""

    sample: torch.Tensor
    accept: torch.Tensor
    draft: torch.Tensor

    def select(self, rows: torch.Tensor) -> RowStreams:
        """The streams of ``rows`` (indices into the current rows)."""
        return RowStreams(self.sample[rows], self.accept[rows], self.draft[rows])


def row_streams(seed: int, iteration: int, prompt_index: torch.Tensor,
                sample_index: torch.Tensor, steps: int, speculative: bool = True
                ) -> RowStreams:
    """Uniforms of every row: ``sample`` is exactly today's per-row stream
    (``sampling.sample_uniforms``); ``accept`` and ``draft`` come from generators of their
    own, so speculation never shifts the plain stream. Without ``speculative`` (no
    drafter will run) those two are ``[N, 0]``: plain decoding never reads them (and
    seeding two more generators per row cost ~1 ms of a 26 ms grpo-tiny generate)."""
    streams: dict[str, list[torch.Tensor]] = {"sample": [], "accept": [], "draft": []}
    drawn = list(streams) if speculative else ["sample"]
    for p, s in zip(prompt_index.tolist(), sample_index.tolist(), strict=True):
        for purpose in drawn:
            parts = (seed, iteration, p, s) if purpose == "sample" else (
                seed, iteration, p, s, purpose)
            gen = torch.Generator().manual_seed(stage_seed(*parts))
            streams[purpose].append(torch.rand(steps, generator=gen, dtype=torch.float64))
    rows = len(prompt_index)

    def stacked(purpose: str) -> torch.Tensor:
        if purpose not in drawn:
            return torch.zeros(rows, 0, dtype=torch.float64)
        values = streams[purpose]
        return torch.stack(values) if values else torch.zeros(0, steps, dtype=torch.float64)

    return RowStreams(*(stacked(purpose) for purpose in streams))


class KVState:
    """One model's KV cache, attention mask and next positions for the active rows."""

    def __init__(self, module: torch.nn.Module, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor) -> None:
        self.module = module
        self.device = next(module.parameters()).device
        self.mask = prompt_mask.long().to(self.device)
        self.cache, self.prefill_logits = prefill(module, prompt_ids, prompt_mask, self.device)
        self.next_pos = self.mask.sum(-1, keepdim=True)

    @classmethod
    def restore(cls, module: torch.nn.Module, state: dict[str, object]) -> KVState:
        """The cache ``export`` took, on this process's copy of the model (the same
        weights): decoding goes on exactly as it would have where it was exported."""
        from transformers import DynamicCache

        self = cls.__new__(cls)
        self.module = module
        self.device = next(module.parameters()).device
        layers = [(k.to(self.device), v.to(self.device))
                  for k, v in zip(state["keys"], state["values"], strict=True)]
        self.cache = DynamicCache(ddp_cache_data=layers, config=module.config)
        self.mask = state["mask"].to(self.device)
        self.next_pos = state["next_pos"].to(self.device)
        self.prefill_logits = None
        return self

    def export(self, rows: torch.Tensor) -> dict[str, object]:
        """The cache, mask and positions of ``rows`` (indices into the current rows), on
        the CPU, for ``restore`` on another worker."""
        rows = rows.to(self.device)
        keys, values = [], []
        for layer in self.cache.layers:
            keys.append(layer.keys[rows].cpu())
            values.append(layer.values[rows].cpu())
        return {"keys": keys, "values": values, "mask": self.mask[rows].cpu(),
                "next_pos": self.next_pos[rows].cpu()}

    @property
    def rows(self) -> int:
        """Rows still in the cache."""
        return self.mask.shape[0]

    def forward(self, tokens: torch.Tensor, fed: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Feed ``tokens [B, w]`` (``fed [B, w]`` marks the real ones; the others become
        holes) at the rows' next positions; returns float logits ``[B, w, V]`` (``[B, 1,
        V]`` with ``last_only``: the LM head at the last column only). Real tokens must
        come last in a row (holes first), so positions stay consecutive."""
        rows, width = tokens.shape
        real = torch.ones(rows, width, dtype=torch.long, device=self.device) if fed is None \
            else fed.long().to(self.device)
        # holes sit before the real tokens: count positions over real tokens only
        offsets = (real.cumsum(-1) - 1).clamp(min=0)
        positions = self.next_pos + offsets
        self.mask = torch.cat([self.mask, real], dim=1)
        out = self.module(input_ids=tokens.to(self.device), attention_mask=self.mask,
                          position_ids=positions, use_cache=True,
                          **cache_kwargs(self.module, self.cache),
                          **(last_logits_kwargs(self.module) if last_only else {}))
        self.cache = output_cache(out)
        self.next_pos = self.next_pos + real.sum(-1, keepdim=True)
        return out.logits.float()

    def reject(self, start: int, keep: torch.Tensor) -> None:
        """Turn the columns ``start ..`` of each row into holes from ``keep [B]`` on (the
        row keeps ``keep`` of them) and pull ``next_pos`` back to match."""
        width = self.mask.shape[1] - start
        column = torch.arange(width, device=self.device)
        drop = column[None, :] >= keep.to(self.device)[:, None]
        dropped = (self.mask[:, start:] * drop).sum(-1, keepdim=True)
        self.mask[:, start:] = self.mask[:, start:].masked_fill(drop, 0)
        self.next_pos = self.next_pos - dropped

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows): finished rows leave."""
        rows = rows.to(self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]

    def drop_empty_columns(self) -> None:
        """Remove cache columns that are holes in every row (after speculation at small
        batch most rejected columns are): attention then stops paying for them."""
        keep = self.mask.bool().any(0)
        if bool(keep.all()):
            return
        index = keep.nonzero().squeeze(-1)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self.mask = self.mask[:, index]


@dataclass
class Verdict:
    """Outcome of one verification for each row: ``tokens [B, w]`` (``count [B]`` of them
    emitted: the accepted drafts then one corrected or bonus token), ``accepted [B]``,
    ``logprobs [B, w]`` of the emitted tokens under the target."""

    tokens: torch.Tensor
    count: torch.Tensor
    accepted: torch.Tensor
    logprobs: torch.Tensor


def verify(logits: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor,
           draft_probs: torch.Tensor | None, streams: RowStreams, produced: torch.Tensor,
           params, sample_step) -> Verdict:
    """Speculative rejection sampling of one step.

    ``logits [B, w, V]``: the target's logits after ``last, d_1 .. d_{w-1}``;
    ``drafts [B, w-1]`` with ``draft_len [B]`` real ones per row; ``draft_probs
    [B, w-1, V]`` the drafter's distributions, or None for a deterministic drafter (an
    n-gram lookup: ``q`` is one-hot); ``produced [B]`` tokens each row emitted so far
    (which uniforms it uses). ``sample_step(logits, u, params)`` is the plain sampler.
    """
    rows, width, _ = logits.shape
    device = logits.device
    arange = torch.arange(rows, device=device)
    tempered = ops.tempered(logits, params.temperature)
    logprobs_all = torch.log_softmax(tempered, -1)
    k = width - 1
    accepted = torch.zeros(rows, dtype=torch.long, device=device)
    if k:
        steps = streams.sample.shape[1]
        cols = (produced[:, None] + torch.arange(k)[None, :]).clamp(max=steps - 1)
        drafts_d = drafts.to(device)
        if params.greedy:
            ok = logits[:, :k].argmax(-1) == drafts_d
        else:
            if params.top_k == 0 and params.top_p >= 1.0:
                # no filter: p(d) from the log-probs computed anyway (a softmax over the
                # vocabulary in float64 per draft position costs as much as a forward)
                p = logprobs_all[:, :k].gather(-1, drafts_d[..., None])[..., 0].double().exp()
            else:
                filtered = filter_logits(tempered[:, :k].reshape(rows * k, -1), params.top_k,
                                         params.top_p).reshape(rows, k, -1)
                p = torch.softmax(filtered.double(), -1).gather(-1, drafts_d[..., None])[..., 0]
            if draft_probs is None:
                q = torch.ones_like(p)
            else:
                q = draft_probs.to(device).gather(-1, drafts_d[..., None])[..., 0].double()
            u = streams.accept.gather(1, cols).to(device)
            ok = u * q < p
        ok &= torch.arange(k, device=device)[None, :] < draft_len.to(device)[:, None]
        accepted = ok.long().cumprod(-1).sum(-1)
    final_logits = logits[arange, accepted]
    final_u = streams.sample.gather(1, (produced.to(device) + accepted)[:, None].cpu())[:, 0]
    token = sample_step(final_logits, final_u, params).to(device)
    rejected = accepted < draft_len.to(device)
    if k and not params.greedy and bool(rejected.any()):
        # the first rejected draft is replaced by a draw from norm(max(p - q, 0))
        idx = rejected.nonzero().squeeze(-1)
        pos = accepted[idx]
        p = torch.softmax(filter_logits(tempered[idx, pos], params.top_k, params.top_p)
                          .double(), -1)
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(-1, drafts.to(device)[idx, pos][:, None], 1.0)
        else:
            q = draft_probs.to(device)[idx, pos].double()
        residual = (p - q).clamp(min=0)
        token[idx] = inverse_cdf(residual, final_u[idx.cpu()])
    tokens = torch.cat([drafts.to(device), torch.zeros(rows, 1, dtype=torch.long,
                                                       device=device)], dim=1)
    tokens[arange, accepted] = token
    logprobs = logprobs_all.gather(-1, tokens[..., None])[..., 0]
    return Verdict(tokens.cpu(), (accepted + 1).cpu(), accepted.cpu(), logprobs.cpu())


def emitted_lengths(verdict: Verdict, eos_id: torch.Tensor | int | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(count [B], hit_eos [B])``: emitted tokens per row, cut just after a first EOS
    (``eos_id``: one id or a tensor of them)."""
    count = verdict.count.clone()
    if eos_id is None:
        return count, torch.zeros_like(count, dtype=torch.bool)
    col = torch.arange(verdict.tokens.shape[1])
    is_eos = torch.isin(verdict.tokens, torch.as_tensor(eos_id)) & \
        (col[None, :] < count[:, None])
    hit = is_eos.any(-1)
    first = is_eos.long().argmax(-1) + 1
    return torch.where(hit, first, count), hit
