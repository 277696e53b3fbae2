"""The decoding loop of the ``generate`` stage: plain steps, or speculative steps with the
drafters and policy of :mod:`rlhfflow.engine.drafting`, row by row as they finish, and
rows handed to another worker mid-way (:class:`Continuation`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlhfflow.engine.decoding import KVState, RowStreams, emitted_lengths, verify
from rlhfflow.engine.drafting import Draft, FixedPolicy


# --------------------------------------------------------------------------- the loop
@dataclass
class DecodeStats:
    """Per-row and per-call figures of one decoding call (see ``GenerateStage``);
    ``moved`` marks the rows finished on another worker (sample reallocation)."""

    steps: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    k_sum: torch.Tensor
    choices: Counter = field(default_factory=Counter)
    rows_left: int = 0
    seconds: float = 0.0
    moved: torch.Tensor | None = None


def per_row_step_s(step_times: dict[int, list[float]]) -> float:
    """What one more row adds to a plain decode step, in seconds: the least-squares
    slope of the median step time over the batch sizes seen (rows leave as they end).
    0 until two sizes at least 25% apart were seen: a step's cost need not grow with its
    rows (on a CPU at a few rows it is mostly weight reads and dispatch), so handing rows
    to another worker is predicted to save only what this call has measured."""
    points = [(rows, sorted(times)[len(times) // 2]) for rows, times in step_times.items()]
    if len(points) < 2:
        return 0.0
    sizes = [rows for rows, _ in points]
    if max(sizes) < 1.25 * min(sizes):
        return 0.0
    mean_x = sum(sizes) / len(points)
    mean_y = sum(t for _, t in points) / len(points)
    var = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (t - mean_y) for x, t in points) / var
    return max(slope, 0.0)


def _plain_step(target, last: torch.Tensor, streams, produced: torch.Tensor, params,
                sample_step, eos_id: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One plain decoding step of the active rows: ``(token [B], logprob [B], hit_eos
    [B])``, bit for bit what ``verify`` gives with no drafts (the same operations on the
    same values) without its bookkeeping for drafts (~2 ms of a 26 ms grpo-tiny
    generate call)."""
    logits = target.forward(last[:, None])[:, 0]
    uniforms = streams.sample.gather(1, produced[:, None])[:, 0]
    token = sample_step(logits, uniforms, params).to(logits.device)
    logprob = torch.log_softmax(logits / params.temperature, -1).gather(
        -1, token[:, None])[:, 0]
    token = token.cpu()
    hit = torch.isin(token, eos_id) if eos_id is not None else \
        torch.zeros(len(token), dtype=torch.bool)
    return token, logprob.cpu(), hit


@dataclass
class Continuation:
    """Rows of a plain decoding call handed over mid-way (sample reallocation): all the
    loop needs to go on with them elsewhere exactly as it would have gone on here.

    ``rows`` are their indices in the handing call's batch; ``cache`` is
    ``KVState.export``'s (shipped rather than re-prefilled: a prefill of the generated
    tokens need not give the incremental decode's logits bit for bit); ``tokens``,
    ``logprobs``, ``mask`` and ``steps`` their outputs and step counts so far."""

    rows: torch.Tensor
    cache: dict
    streams: RowStreams
    produced: torch.Tensor
    last: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    steps: torch.Tensor


@torch.no_grad()
def decode(module: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
           streams: RowStreams, params, eos_id: int | Sequence[int] | None, pad_id: int,
           sample_step,
           make_drafters=None, policy=None, handoff=None, resume: Continuation | None = None
           ) -> tuple[dict[str, torch.Tensor], DecodeStats]:
    """Decode with finished rows leaving the batch, and optional speculation.

    ``make_drafters(first_tokens)`` returns ``{name: drafter}`` for the rows (called after
    the first token, which comes from the prompt's logits); ``policy`` chooses
    ``(drafter, k)`` per step (default: plain). Output as ``generate.generate``.

    Sample reallocation (plain decoding only): ``handoff`` (a ``StageContext.peers``)
    may name an idle worker between steps, given the seconds handing half the active
    rows over is predicted to save (the remaining steps times those rows' share of a
    step, ``per_row_step_s``); they then go there as a ``Continuation`` and their
    results are merged back at the end. ``resume`` is the
    receiving side: decode a ``Continuation`` (``prompt_ids``/``prompt_mask`` unused);
    the output has its rows. Either way every token and log-prob is the one this call
    would have produced alone (counter-based per-row streams, the cache shipped).
    """
    start_time = time.perf_counter()
    steps = params.max_new_tokens
    if eos_id is not None:
        eos_id = torch.as_tensor(eos_id).flatten()  # one id or several (chat models)
    if resume is not None:
        rows_total = len(resume.rows)
        target = KVState.restore(module, resume.cache)
        tokens_out, logprobs_out = resume.tokens.clone(), resume.logprobs.clone()
        mask_out = resume.mask.clone()
        stats = DecodeStats(resume.steps.clone(),
                            *(torch.zeros(rows_total, dtype=torch.long) for _ in range(3)))
        active = torch.arange(rows_total)
        produced, last = resume.produced.clone(), resume.last.clone()
        streams = resume.streams
        finished = torch.zeros(rows_total, dtype=torch.bool)
        make_drafters, handoff = None, None
    else:
        rows_total = prompt_ids.shape[0]
        target = KVState(module, prompt_ids, prompt_mask)
        tokens_out = torch.full((rows_total, steps), pad_id, dtype=torch.long)
        logprobs_out = torch.zeros(rows_total, steps)
        mask_out = torch.zeros(rows_total, steps, dtype=torch.int8)
        stats = DecodeStats(*(torch.zeros(rows_total, dtype=torch.long) for _ in range(4)))
        if rows_total == 0:
            return {"response_ids": tokens_out, "response_mask": mask_out,
                    "sample_logprobs": logprobs_out}, stats

        logits = target.prefill_logits
        first = sample_step(logits, streams.sample[:, 0], params).cpu()
        lp = torch.log_softmax(logits / params.temperature, -1).cpu()
        tokens_out[:, 0], mask_out[:, 0] = first, 1
        logprobs_out[:, 0] = lp.gather(-1, first[:, None]).squeeze(-1)
        active = torch.arange(rows_total)
        produced = torch.ones(rows_total, dtype=torch.long)
        last = first
        finished = produced >= steps
        if eos_id is not None:
            finished |= torch.isin(first, eos_id)
    stats.moved = torch.zeros(rows_total, dtype=torch.long)
    # each row's tokens so far, as lists: only drafters read them (plain decoding skips
    # this per-row Python work, which at batch 64 cost more than compaction saved)
    seqs = []
    if make_drafters:
        real = prompt_mask.bool()
        seqs = [prompt_ids[r][real[r]].tolist() + [int(first[r])] for r in range(rows_total)]
    drafters = make_drafters(first, seqs) if make_drafters else {}
    policy = policy or FixedPolicy(None, 0)
    if drafters:
        handoff = None  # drafter state (caches, n-gram indexes) does not travel
    handed: list[tuple[Continuation, object]] = []
    step_times: dict[int, list[float]] = {}  # active rows -> seconds of plain steps

    while True:
        if bool(finished.any()):
            keep = (~finished).nonzero().squeeze(-1)
            stats.rows_left += int(finished.sum())
            if not len(keep):
                break
            target.select(keep)
            for drafter in drafters.values():
                drafter.select(keep)
            streams, active, produced, last = (streams.select(keep), active[keep],
                                               produced[keep], last[keep])
            if drafters:
                seqs[:] = [seqs[r] for r in keep.tolist()]
        if handoff is not None and len(active) >= 2:
            saving = (steps - int(produced.min())) * \
                per_row_step_s(step_times) * (len(active) // 2)
            peer = handoff.peer(len(active), saving)
            if peer is not None:
                half = len(active) // 2
                give, keep = torch.arange(half, len(active)), torch.arange(half)
                rows = active[give]
                cont = Continuation(rows, target.export(give), streams.select(give),
                                    produced[give], last[give], tokens_out[rows],
                                    logprobs_out[rows], mask_out[rows], stats.steps[rows])
                handed.append((cont, handoff.send(peer, cont)))
                target.select(keep)
                streams, active, produced, last = (streams.select(keep), active[keep],
                                                   produced[keep], last[keep])
        step_start = time.perf_counter()
        name, k = policy.choose(len(active), drafters)
        if not drafters:  # plain decoding: one token per row, as verify would at k = 0
            token, logprob, hit_eos = _plain_step(target, last, streams, produced, params,
                                                  sample_step, eos_id)
            tokens_out[active, produced] = token
            logprobs_out[active, produced] = logprob
            mask_out[active, produced] = 1
            stats.steps[active] += 1
            stats.choices[("off", 0)] += 1
            elapsed = time.perf_counter() - step_start
            if hasattr(policy, "observe_time"):
                policy.observe_time(None, len(active), 0, drafters, elapsed)
            step_times.setdefault(len(active), []).append(elapsed)
            produced, last = produced + 1, token
            finished = hit_eos | (produced >= steps)
            continue
        limit = steps - produced - 1  # the step emits its drafts plus one token
        if name is not None and k > 0 and bool((limit > 0).any()):
            draft = drafters[name].propose(k, limit, streams, produced, params)
            k = draft.tokens.shape[1]
        else:
            name, k = None, 0
            draft = Draft(torch.zeros(len(active), 0, dtype=torch.long),
                          torch.zeros(len(active), dtype=torch.long), None)
        width_before = target.mask.shape[1]
        logits = target.forward(torch.cat([last[:, None], draft.tokens], 1))
        verdict = verify(logits, draft.tokens, draft.length, draft.probs, streams, produced,
                         params, sample_step)
        if k:
            target.reject(width_before, verdict.accepted + 1)
            target.drop_empty_columns()
            policy.observe(name, verdict.accepted, draft.length)
        count, hit_eos = emitted_lengths(verdict, eos_id)
        col = torch.arange(verdict.tokens.shape[1])
        emit = col[None, :] < count[:, None]
        where_rows = active[:, None].expand_as(emit)[emit]
        where_cols = (produced[:, None] + col[None, :])[emit]
        tokens_out[where_rows, where_cols] = verdict.tokens[emit]
        logprobs_out[where_rows, where_cols] = verdict.logprobs[emit]
        mask_out[where_rows, where_cols] = 1
        if drafters:
            emitted = [verdict.tokens[r, :int(count[r])].tolist() for r in range(len(active))]
            for seq, new in zip(seqs, emitted, strict=True):
                seq.extend(new)
            for other_name, drafter in drafters.items():
                drafter.commit(verdict.accepted, emitted, drafted=other_name == name)
        stats.steps[active] += 1
        stats.drafted[active] += draft.length
        stats.accepted[active] += verdict.accepted
        stats.k_sum[active] += k
        stats.choices[(name or "off", k)] += 1
        if hasattr(policy, "observe_time"):
            policy.observe_time(name, len(active), k, drafters,
                                time.perf_counter() - step_start)
        produced = produced + count
        last = verdict.tokens[torch.arange(len(active)), count - 1]
        finished = hit_eos | (produced >= steps)
        if name is None:
            step_times.setdefault(len(active), []).append(time.perf_counter() - step_start)
    if handed:
        results = handoff.gather([handle for _, handle in handed])
        for (cont, _), result in zip(handed, results, strict=True):
            if result is None:  # the peer's model moved on: finish the rows here
                result = decode(module, None, None, cont.streams, params, eos_id, pad_id,
                                sample_step, resume=cont)
                result = result[0], result[1].steps
            else:
                stats.moved[cont.rows] = 1
            out, steps_done = result
            rows = cont.rows
            tokens_out[rows] = out["response_ids"]
            logprobs_out[rows] = out["sample_logprobs"]
            mask_out[rows] = out["response_mask"]
            stats.steps[rows] = steps_done
    stats.seconds = time.perf_counter() - start_time
    return {"response_ids": tokens_out, "response_mask": mask_out,
            "sample_logprobs": logprobs_out}, stats
