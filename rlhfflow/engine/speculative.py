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
    if eos_id is not None:
        eos_id = torch.as_tensor(eos_id).flatten()  # one id or several (chat models)
    if resume is not None:
        run = _Decoding.resumed(module, resume, params, eos_id, sample_step)
        make_drafters, handoff = None, None
    else:
        run = _Decoding.started(module, prompt_ids, prompt_mask, streams, params, eos_id,
                                pad_id, sample_step)
        if run.rows == 0:
            return run.outputs(), run.stats
    run.stats.moved = torch.zeros(run.rows, dtype=torch.long)
    if make_drafters:
        # each row's tokens so far, as lists: only drafters read them (plain decoding
        # skips this per-row Python work, which at batch 64 cost more than compaction
        # saved)
        real = prompt_mask.bool()
        run.seqs = [prompt_ids[r][real[r]].tolist() + [int(run.first[r])]
                    for r in range(run.rows)]
        run.drafters = make_drafters(run.first, run.seqs)
    policy = policy or FixedPolicy(None, 0)
    if run.drafters:
        handoff = None  # drafter state (caches, n-gram indexes) does not travel
    while run.drop_finished():
        if handoff is not None and len(run.active) >= 2:
            run.offer_half(handoff)
        step_start = time.perf_counter()
        name, k = policy.choose(len(run.active), run.drafters)
        if not run.drafters:  # plain decoding: one token per row, as verify would at k = 0
            run.plain_step(policy, step_start)
        else:
            run.speculative_step(name, k, policy, step_start)
    if run.handed:
        run.merge_handed(handoff, pad_id)
    run.stats.seconds = time.perf_counter() - start_time
    return run.outputs(), run.stats


class _Decoding:
    """One decoding call between its steps: the target model's KV state, the active rows
    (``active``: their indices in the call's batch; ``produced``: tokens each has;
    ``last``: its last token; ``streams``: its random streams), the outputs of every row
    so far, the drafters and the rows handed to other workers. ``decode`` drives it, one
    method per thing a step does."""

    def __init__(self, module: torch.nn.Module, target: KVState, streams: RowStreams,
                 params, eos_id: torch.Tensor | None, sample_step, tokens: torch.Tensor,
                 logprobs: torch.Tensor, mask: torch.Tensor, stats: DecodeStats) -> None:
        self.module, self.target, self.streams = module, target, streams
        self.params, self.eos_id, self.sample_step = params, eos_id, sample_step
        self.steps = params.max_new_tokens
        self.rows = len(tokens)
        self.tokens, self.logprobs, self.mask, self.stats = tokens, logprobs, mask, stats
        self.active = torch.arange(self.rows)
        self.produced = torch.ones(self.rows, dtype=torch.long)
        self.last = torch.zeros(self.rows, dtype=torch.long)
        self.finished = torch.zeros(self.rows, dtype=torch.bool)
        self.first: torch.Tensor | None = None  # the prompt's token (a call from prompts)
        self.seqs: list[list[int]] = []  # each row's tokens, for the drafters
        self.drafters: dict = {}
        self.handed: list[tuple[Continuation, object]] = []
        self.step_times: dict[int, list[float]] = {}  # active rows -> seconds of plain steps

    @classmethod
    def started(cls, module: torch.nn.Module, prompt_ids: torch.Tensor,
                prompt_mask: torch.Tensor, streams: RowStreams, params,
                eos_id: torch.Tensor | None, pad_id: int, sample_step) -> _Decoding:
        """A call from prompts, their first token sampled from the prefill's logits (no
        rows: nothing done)."""
        rows, steps = prompt_ids.shape[0], params.max_new_tokens
        target = KVState(module, prompt_ids, prompt_mask)
        run = cls(module, target, streams, params, eos_id, sample_step,
                  torch.full((rows, steps), pad_id, dtype=torch.long),
                  torch.zeros(rows, steps), torch.zeros(rows, steps, dtype=torch.int8),
                  DecodeStats(*(torch.zeros(rows, dtype=torch.long) for _ in range(4))))
        if rows == 0:
            return run
        logits = target.prefill_logits
        first = sample_step(logits, streams.sample[:, 0], params).cpu()
        lp = torch.log_softmax(logits / params.temperature, -1).cpu()
        run.tokens[:, 0], run.mask[:, 0] = first, 1
        run.logprobs[:, 0] = lp.gather(-1, first[:, None]).squeeze(-1)
        run.first = run.last = first
        run.finished = run.produced >= steps
        if eos_id is not None:
            run.finished |= torch.isin(first, eos_id)
        return run

    @classmethod
    def resumed(cls, module: torch.nn.Module, cont: Continuation, params,
                eos_id: torch.Tensor | None, sample_step) -> _Decoding:
        """The receiving side of a hand-over: the rows of ``cont`` as they were."""
        rows = len(cont.rows)
        run = cls(module, KVState.restore(module, cont.cache), cont.streams, params, eos_id,
                  sample_step, cont.tokens.clone(), cont.logprobs.clone(), cont.mask.clone(),
                  DecodeStats(cont.steps.clone(),
                              *(torch.zeros(rows, dtype=torch.long) for _ in range(3))))
        run.produced, run.last = cont.produced.clone(), cont.last.clone()
        return run

    def drop_finished(self) -> bool:
        """Take the finished rows out of the batch; whether any row is left."""
        if bool(self.finished.any()):
            keep = (~self.finished).nonzero().squeeze(-1)
            self.stats.rows_left += int(self.finished.sum())
            if not len(keep):
                return False
            self.target.select(keep)
            for drafter in self.drafters.values():
                drafter.select(keep)
            self._keep(keep)
            if self.drafters:
                self.seqs[:] = [self.seqs[r] for r in keep.tolist()]
        return True

    def _keep(self, keep: torch.Tensor) -> None:
        self.streams, self.active, self.produced, self.last = (
            self.streams.select(keep), self.active[keep], self.produced[keep],
            self.last[keep])

    def offer_half(self, handoff) -> None:
        """Hand half the active rows to the peer ``handoff`` names, if it names one for
        the time that is predicted to save."""
        active = self.active
        saving = (self.steps - int(self.produced.min())) * \
            per_row_step_s(self.step_times) * (len(active) // 2)
        peer = handoff.peer(len(active), saving)
        if peer is None:
            return
        half = len(active) // 2
        give, keep = torch.arange(half, len(active)), torch.arange(half)
        rows = active[give]
        cont = Continuation(rows, self.target.export(give), self.streams.select(give),
                            self.produced[give], self.last[give], self.tokens[rows],
                            self.logprobs[rows], self.mask[rows], self.stats.steps[rows])
        self.handed.append((cont, handoff.send(peer, cont)))
        self.target.select(keep)
        self._keep(keep)

    def plain_step(self, policy, step_start: float) -> None:
        """One token for each active row (``_plain_step``)."""
        active, produced = self.active, self.produced
        token, logprob, hit_eos = _plain_step(self.target, self.last, self.streams, produced,
                                              self.params, self.sample_step, self.eos_id)
        self.tokens[active, produced] = token
        self.logprobs[active, produced] = logprob
        self.mask[active, produced] = 1
        self.stats.steps[active] += 1
        self.stats.choices[("off", 0)] += 1
        elapsed = time.perf_counter() - step_start
        if hasattr(policy, "observe_time"):
            policy.observe_time(None, len(active), 0, self.drafters, elapsed)
        self.step_times.setdefault(len(active), []).append(elapsed)
        self.produced, self.last = produced + 1, token
        self.finished = hit_eos | (self.produced >= self.steps)

    def speculative_step(self, name: str | None, k: int, policy, step_start: float) -> None:
        """Drafter ``name``'s ``k`` drafts (none: ``name`` None or ``k`` 0) verified in one
        forward of the target; each row emits its accepted drafts and one token more."""
        active, produced, drafters = self.active, self.produced, self.drafters
        limit = self.steps - produced - 1  # the step emits its drafts plus one token
        if name is not None and k > 0 and bool((limit > 0).any()):
            draft = drafters[name].propose(k, limit, self.streams, produced, self.params)
            k = draft.tokens.shape[1]
        else:
            name, k = None, 0
            draft = Draft(torch.zeros(len(active), 0, dtype=torch.long),
                          torch.zeros(len(active), dtype=torch.long), None)
        width_before = self.target.mask.shape[1]
        logits = self.target.forward(torch.cat([self.last[:, None], draft.tokens], 1))
        verdict = verify(logits, draft.tokens, draft.length, draft.probs, self.streams,
                         produced, self.params, self.sample_step)
        if k:
            self.target.reject(width_before, verdict.accepted + 1)
            self.target.drop_empty_columns()
            policy.observe(name, verdict.accepted, draft.length)
        count, hit_eos = emitted_lengths(verdict, self.eos_id)
        self._emit(verdict, count, name)
        stats = self.stats
        stats.steps[active] += 1
        stats.drafted[active] += draft.length
        stats.accepted[active] += verdict.accepted
        stats.k_sum[active] += k
        stats.choices[(name or "off", k)] += 1
        if hasattr(policy, "observe_time"):
            policy.observe_time(name, len(active), k, drafters,
                                time.perf_counter() - step_start)
        self.produced = produced + count
        self.last = verdict.tokens[torch.arange(len(active)), count - 1]
        self.finished = hit_eos | (self.produced >= self.steps)
        if name is None:
            self.step_times.setdefault(len(active), []).append(
                time.perf_counter() - step_start)

    def _emit(self, verdict, count: torch.Tensor, name: str | None) -> None:
        """Write each row's ``count`` emitted tokens of ``verdict`` to the outputs and
        tell the drafters (``name``'s drafted them)."""
        col = torch.arange(verdict.tokens.shape[1])
        emit = col[None, :] < count[:, None]
        where_rows = self.active[:, None].expand_as(emit)[emit]
        where_cols = (self.produced[:, None] + col[None, :])[emit]
        self.tokens[where_rows, where_cols] = verdict.tokens[emit]
        self.logprobs[where_rows, where_cols] = verdict.logprobs[emit]
        self.mask[where_rows, where_cols] = 1
        if self.drafters:
            emitted = [verdict.tokens[r, :int(count[r])].tolist()
                       for r in range(len(self.active))]
            for seq, new in zip(self.seqs, emitted, strict=True):
                seq.extend(new)
            for other_name, drafter in self.drafters.items():
                drafter.commit(verdict.accepted, emitted, drafted=other_name == name)

    def merge_handed(self, handoff, pad_id: int) -> None:
        """The rows handed to peers, back from them (or finished here, where a peer's
        model moved on)."""
        results = handoff.gather([handle for _, handle in self.handed])
        for (cont, _), result in zip(self.handed, results, strict=True):
            if result is None:  # the peer's model moved on: finish the rows here
                result = decode(self.module, None, None, cont.streams, self.params,
                                self.eos_id, pad_id, self.sample_step, resume=cont)
                result = result[0], result[1].steps
            else:
                self.stats.moved[cont.rows] = 1
            out, steps_done = result
            rows = cont.rows
            self.tokens[rows] = out["response_ids"]
            self.logprobs[rows] = out["sample_logprobs"]
            self.mask[rows] = out["response_mask"]
            self.stats.steps[rows] = steps_done

    def outputs(self) -> dict[str, torch.Tensor]:
        """The call's output: every row's tokens, mask and log-probs."""
        return {"response_ids": self.tokens, "response_mask": self.mask,
                "sample_logprobs": self.logprobs}
