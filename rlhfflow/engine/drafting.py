"""Drafters and the adaptive drafting policy of speculative decoding.

Drafters propose up to ``k`` tokens per active row; :func:`rlhfflow.engine.decoding.verify`
keeps the target's distribution whatever they propose, so a drafter only changes speed:

* :class:`NgramDrafter` (``ngram``): model-free lookup of the row's last n tokens in the
  prompt, in the other samples of the same prompt in this batch, and in earlier responses
  to the same prompt (RL revisits prompts and its responses repeat).
* :class:`ModelDrafter` with a separate draft model (``model``, same tokenizer as the
  actor), or with the actor's own first layers and its LM head (``layers``: no extra
  weights, and it follows the actor as it trains because it shares its modules).

:class:`AdaptivePolicy` (RLHFSpec) picks the drafter and ``k`` at every step from the
number of active rows, the acceptance measured so far and a measured cost of a forward
pass (:class:`ForwardCost`), maximising expected emitted tokens per second; ``k = 0``
(plain decoding) when nothing pays, e.g. at large batch on CPU where a forward costs in
proportion to the tokens it scores.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from rlhfflow import ops
from rlhfflow.engine.decoding import KVState, RowStreams
from rlhfflow.engine.sampling import filter_logits, inverse_cdf


# --------------------------------------------------------------------------- cost model
class ForwardCost:
    """Seconds of one forward pass scoring ``n`` tokens (``rows * width``), interpolated
    piecewise-linearly in ``n`` from a table measured on the model itself.

    ``fixed`` (``(seconds, seconds_per_token)``) replaces the measurement: decisions, and
    hence sampled tokens, then repeat exactly from run to run.
    """

    def __init__(self, points: list[tuple[int, float]]) -> None:
        self.points = sorted(points)

    @classmethod
    def linear(cls, fixed: float, per_token: float) -> ForwardCost:
        """A cost of ``fixed + per_token * n``."""
        return cls([(1, fixed + per_token), (1 << 20, fixed + per_token * (1 << 20))])

    def __call__(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, c0), (n1, c1) in zip(pts, pts[1:], strict=False):
            if tokens <= n1:
                return c0 + (c1 - c0) * (tokens - n0) / (n1 - n0)
        (n0, c0), (n1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) * (tokens - n1) / (n1 - n0)


_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wait_for(device: torch.device) -> None:
    """Wait until ``device`` has run what was queued on it: a CUDA call returns before its
    kernels ran, so a clock read after it alone measures the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_cost(module: torch.nn.Module, max_tokens: int, context: int = 48) -> ForwardCost:
    """Time forwards of ``n = 1, 2, 4 .. max_tokens`` new tokens after a ``context``-token
    cache (best of 2 each); cached per module for the life of the process."""
    known = _MEASURED.get(module)
    if known is not None and known.points[-1][0] >= max_tokens:
        return known
    device = next(module.parameters()).device
    vocab = module.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    points, n = [], 1
    while True:
        rows = max(1, n // 8)  # shapes like verification: several rows, a few tokens each
        width = n // rows
        ids = torch.randint(4, vocab, (rows, context + width), generator=gen).to(device)
        best = float("inf")
        for _ in range(2):
            mask = torch.ones(rows, context, dtype=torch.long, device=device)
            state = KVState(module, ids[:, :context], mask)
            wait_for(device)
            start = time.perf_counter()
            state.forward(ids[:, context:])
            wait_for(device)
            best = min(best, time.perf_counter() - start)
        points.append((rows * width, best))
        if n >= max_tokens:
            break
        n = min(2 * n, max_tokens)
    _MEASURED[module] = ForwardCost(points)
    return _MEASURED[module]


# --------------------------------------------------------------------------- drafters
@dataclass
class Draft:
    """Proposals for the active rows: ``tokens [B, k]``, ``length [B]`` real ones per row,
    ``probs [B, k, V]`` the drafter's distributions (None: deterministic, one-hot)."""

    tokens: torch.Tensor
    length: torch.Tensor
    probs: torch.Tensor | None


class NgramDrafter:
    """Prompt / same-group / earlier-response n-gram lookup (no model).

    Each prompt group has an index ``ngram -> (sequence, position after it)`` over the
    prompt and every sample's tokens so far, plus ``history`` (earlier prompt+response
    sequences of the same prompt). The longest n-gram (``max_n`` down to ``min_n``) that
    ends the row and was seen before proposes what followed it, most recent first.
    """

    name = "ngram"

    def __init__(self, seqs: list[list[int]], groups: list[int],
                 history: dict[int, list[list[int]]], max_n: int, min_n: int) -> None:
        self.seqs, self.groups, self.max_n, self.min_n = seqs, groups, max_n, min_n
        self.index: dict[int, dict[tuple[int, ...], tuple[list[int], int]]] = {}
        for group in dict.fromkeys(groups):
            self.index[group] = {}
            for old in history.get(group, []):
                self._add(self.index[group], old, 0)
        self.indexed = [0] * len(seqs)
        for row in range(len(seqs)):
            self._catch_up(row)

    def _add(self, index: dict, seq: list[int], start: int) -> None:
        for i in range(max(start, 1), len(seq)):
            for n in range(self.min_n, min(self.max_n, i) + 1):
                index[tuple(seq[i - n:i])] = (seq, i)

    def _catch_up(self, row: int) -> None:
        seq = self.seqs[row]
        self._add(self.index[self.groups[row]], seq, self.indexed[row])
        self.indexed[row] = len(seq)

    def propose(self, k: int, limit: torch.Tensor, streams: RowStreams,
                produced: torch.Tensor, params) -> Draft:
        """Up to ``min(k, limit[row])`` tokens per row from the longest matching n-gram."""
        rows = len(self.seqs)
        tokens = torch.zeros(rows, k, dtype=torch.long)
        length = torch.zeros(rows, dtype=torch.long)
        for row, seq in enumerate(self.seqs):
            self._catch_up(row)
            cap = min(k, int(limit[row]))
            if cap <= 0:
                continue
            index = self.index[self.groups[row]]
            for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
                hit = index.get(tuple(seq[-n:]))
                if hit is not None:
                    source, at = hit
                    follow = source[at:at + cap]
                    tokens[row, :len(follow)] = torch.tensor(follow, dtype=torch.long)
                    length[row] = len(follow)
                    break
        return Draft(tokens, length, None)

    def commit(self, accepted: torch.Tensor, emitted: list[list[int]], drafted: bool) -> None:
        """Nothing to undo: the index catches up from the sequences lazily."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep the state of ``rows`` only (the loop keeps ``seqs`` itself)."""
        keep = rows.tolist()
        self.groups = [self.groups[r] for r in keep]
        self.indexed = [self.indexed[r] for r in keep]

    def cost(self, rows: int, k: int) -> float:
        """A dictionary look-up per row: nothing next to a forward pass."""
        return 0.0


class ModelDrafter:
    """Autoregressive drafting with a small causal LM that shares the actor's tokenizer
    (a draft model, or the actor's first layers: :func:`shallow_view`). It keeps a KV
    cache of its own; tokens the target emitted that it has not seen yet are fed first."""

    def __init__(self, name: str, module: torch.nn.Module, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor, first: torch.Tensor, cost: ForwardCost) -> None:
        self.name, self.cost_model, self.module = name, cost, module
        self._prompt: tuple[torch.Tensor, torch.Tensor] | None = (prompt_ids, prompt_mask)
        self._state: KVState | None = None
        self.pending = [[t] for t in first.tolist()]
        self._start, self._k = 0, 0

    @property
    def state(self) -> KVState:
        """The draft's cache, prefilled on first use: adaptive drafting may never choose
        this drafter, and a prefill of the first 6 of 30 layers is ~7% of the work of a
        batch-16, 64-token call on SmolLM2 by FLOP count (the tokens emitted meanwhile
        wait in ``pending``)."""
        if self._state is None:
            self._state = KVState(self.module, *self._prompt)
            self._prompt = None
        return self._state

    def propose(self, k: int, limit: torch.Tensor, streams: RowStreams,
                produced: torch.Tensor, params) -> Draft:
        """Sample (or take the argmax of) ``k`` tokens per row from the draft model."""

        width = max(len(p) for p in self.pending)
        ids = torch.zeros(len(self.pending), width, dtype=torch.long)
        fed = torch.zeros(len(self.pending), width, dtype=torch.bool)
        for row, tokens in enumerate(self.pending):  # holes first, real tokens last
            ids[row, width - len(tokens):] = torch.tensor(tokens)
            fed[row, width - len(tokens):] = True
        logits = self.state.forward(ids, fed)[:, -1]
        self._start, self._k = self.state.mask.shape[1], k
        steps = streams.draft.shape[1]
        drafts, probs = [], []
        for i in range(k):
            if params.greedy:
                token = logits.argmax(-1)
            else:
                filtered = filter_logits(ops.tempered(logits, params.temperature), params.top_k,
                                         params.top_p)
                q = torch.softmax(filtered, -1)
                probs.append(q)
                u = streams.draft[torch.arange(len(produced)), (produced + i).clamp(max=steps - 1)]
                token = inverse_cdf(q.double(), u)
            drafts.append(token.cpu())
            if i < k - 1:
                logits = self.state.forward(token[:, None])[:, -1]
        length = torch.minimum(torch.full_like(limit, k), limit.clamp(min=0))
        return Draft(torch.stack(drafts, 1), length, torch.stack(probs, 1) if probs else None)

    def commit(self, accepted: torch.Tensor, emitted: list[list[int]], drafted: bool) -> None:
        """Holes for the rejected drafts in the cache; the rest of ``emitted`` is pending."""
        if not drafted:
            for row, tokens in enumerate(emitted):
                self.pending[row].extend(tokens)
            return
        kept = accepted.clamp(max=self._k - 1)  # d_k itself was never fed
        self.state.reject(self._start, kept)
        self.state.drop_empty_columns()
        self.pending = [tokens[int(n):] for tokens, n in zip(emitted, kept, strict=True)]

    def select(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` only."""
        if self._state is None:
            ids, mask = self._prompt
            self._prompt = (ids[rows], mask[rows])
        else:
            self._state.select(rows)
        self.pending = [self.pending[r] for r in rows.tolist()]

    def cost(self, rows: int, k: int) -> float:
        """``k`` sequential forwards of the draft model over ``rows`` tokens."""
        return k * self.cost_model(rows)


def shallow_view(module: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The actor's first ``layers`` decoder layers with its final norm and LM head, as a
    model of its own that shares (not copies) those modules: self-speculation costs no
    memory and follows the actor's weights as it trains. Llama-style models only
    (``module.model.layers``), which covers SmolLM2, Llama, Qwen and Mistral."""
    inner = getattr(module, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ValueError(f"drafter 'layers' needs a Llama-style model (model.layers); "
                         f"{type(module).__name__} has none")
    total = len(inner.layers)
    if layers >= total:
        raise ValueError(f"draft_layers {layers} must be below the actor's {total} layers")
    config = copy.deepcopy(module.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    view_inner = copy.copy(inner)
    # copy.copy shares the _modules dict: give the views dicts of their own
    view_inner._modules = dict(inner._modules)
    view_inner.layers = torch.nn.ModuleList(list(inner.layers)[:layers])
    view_inner.config = config
    view = copy.copy(module)
    view._modules = dict(module._modules)
    view.model = view_inner
    view.config = config
    return view


# --------------------------------------------------------------------------- policy
@dataclass
class Acceptance:
    """Draft tokens the target evaluated and accepted, and rows that got any draft."""

    accepted: float = 0
    evaluated: float = 0
    covered: float = 0
    offered: float = 0

    def rate(self) -> float:
        """Per-token acceptance, with a pessimistic Beta(1, 9) prior: an untrained drafter
        is nearly useless (1-2% on SmolLM2-135M at temperature 1), and an optimistic
        prior paid for finding that out on many steps. ``AdaptivePolicy`` probes a
        drafter it knows too little of on a few cheap steps instead."""
        return (self.accepted + 1) / (self.evaluated + 10)

    def decay(self, keep: float) -> None:
        """Forget the past by a factor (the actor drifts between iterations)."""
        self.accepted, self.evaluated = self.accepted * keep, self.evaluated * keep
        self.covered, self.offered = self.covered * keep, self.offered * keep

    def coverage(self) -> float:
        """Fraction of rows that received a draft (an n-gram may find none)."""
        return (self.covered + 1) / (self.offered + 1)


@dataclass
class FixedPolicy:
    """Always the same drafter and ``k`` (``None, 0``: plain decoding)."""

    drafter: str | None
    k: int
    stats: dict[str, Acceptance] = field(default_factory=dict)

    def choose(self, rows: int, drafters: dict) -> tuple[str | None, int]:
        """The configured choice."""
        return self.drafter, self.k

    def observe(self, name: str, verdict_accepted: torch.Tensor, draft_len: torch.Tensor
                ) -> None:
        """Record acceptance (for metrics only)."""
        observe(self.stats.setdefault(name, Acceptance()), verdict_accepted, draft_len)


def observe(acc: Acceptance, accepted: torch.Tensor, draft_len: torch.Tensor) -> None:
    """Add one verification's outcome: a row evaluated its accepted drafts plus the one
    it rejected (if any), so ``accepted / evaluated`` estimates per-token acceptance."""
    acc.accepted += int(accepted.sum())
    acc.evaluated += int((accepted + (accepted < draft_len).long()).sum())
    acc.covered += int((draft_len > 0).sum())
    acc.offered += len(draft_len)


@dataclass
class AdaptivePolicy:
    """RLHFSpec's workload-aware choice, made at every step.

    For each drafter and ``k``, expected tokens per row per step with per-token acceptance
    ``a`` are ``c * (1 - a^(k+1)) / (1 - a) + (1 - c)`` (``c``: fraction of rows that get
    a draft); time is the verification forward over ``rows * (k + 1)`` tokens plus the
    drafter's cost. The choice with the most tokens per second wins, ``k = 0`` included.

    With ``timed`` (a measured cost model), the wall time of every step corrects the
    prediction of its kind (``off`` or the drafter): a running ratio of measured to
    predicted seconds. That catches what the forward's table leaves out (drafter
    bookkeeping, the acceptance test over the vocabulary, a machine busier than when
    measured), so a choice that does not pay in practice is dropped.
    """

    verify_cost: ForwardCost
    k_max: int
    stats: dict[str, Acceptance] = field(default_factory=dict)
    timed: bool = False
    correction: dict[str, float] = field(default_factory=dict)
    #: a drafter with fewer evaluated draft tokens than this is probed with ``k = 1`` on
    #: up to ``probe_steps`` steps of a call, where such a step is predicted to cost at
    #: most ``probe_cost`` times a plain one (never at large batch on a CPU)
    probe_tokens: float = 8.0
    probe_steps: int = 2
    probe_cost: float = 1.3
    probed: Counter = field(default_factory=Counter)

    def predict(self, name: str | None, rows: int, k: int, drafters: dict) -> float:
        """Predicted seconds of a step, corrected by the measured ratio of its kind."""
        seconds = self.verify_cost(rows * (k + 1))
        if name is not None:
            seconds += drafters[name].cost(rows, k)
        return seconds * self.correction.get(name or "off", 1.0)

    def choose(self, rows: int, drafters: dict) -> tuple[str | None, int]:
        """``(drafter, k)`` of the best expected throughput; ``(None, 0)`` for plain."""
        best, best_rate = (None, 0), rows / self.predict(None, rows, 0, drafters)
        for name in drafters:
            acc = self.stats.setdefault(name, Acceptance())
            a, c = min(acc.rate(), 0.999), acc.coverage()
            for k in range(1, self.k_max + 1):
                tokens = c * (1 - a ** (k + 1)) / (1 - a) + (1 - c)
                rate = rows * tokens / self.predict(name, rows, k, drafters)
                if rate > best_rate * 1.02:  # ties go to the simpler
                    best, best_rate = (name, k), rate
        return best if best[0] is not None else self._probe(rows, drafters)

    def _probe(self, rows: int, drafters: dict) -> tuple[str | None, int]:
        """``(drafter, 1)`` for a drafter whose acceptance is still unknown, when a probe
        is cheap here and this call has probes left; else plain ``(None, 0)``."""
        plain = self.predict(None, rows, 0, drafters)
        for name in drafters:
            if (self.stats[name].evaluated < self.probe_tokens
                    and self.probed[name] < self.probe_steps
                    and self.predict(name, rows, 1, drafters) <= self.probe_cost * plain):
                self.probed[name] += 1
                return name, 1
        return None, 0

    def observe_time(self, name: str | None, rows: int, k: int, drafters: dict,
                     seconds: float) -> None:
        """Fold a step's measured wall time into its kind's correction."""
        if not self.timed:
            return
        kind = name or "off"
        old = self.correction.get(kind, 1.0)
        predicted = self.predict(name, rows, k, drafters) / old
        if predicted > 0:
            self.correction[kind] = 0.7 * old + 0.3 * seconds / predicted

    def observe(self, name: str, accepted: torch.Tensor, draft_len: torch.Tensor) -> None:
        """Update the acceptance of ``name``."""
        observe(self.stats.setdefault(name, Acceptance()), accepted, draft_len)
