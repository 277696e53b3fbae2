"""``generate``: sample responses from a causal LM with a KV cache.

Sampling is reproducible **per sample**: every row draws its random numbers from its own
generator seeded by ``(seed, iteration, prompt_index, sample_index)``, so a prompt's
response does not depend on which batch or micro-batch it lands in. Each step samples by
inverse CDF with that row's uniform draw, which is exact categorical sampling.

Rows that finished (EOS or ``max_new_tokens``) leave the decode batch and its KV cache
(``compact``, on by default; the same tokens, log-probs equal up to float rounding).
``drafter`` turns on speculative decoding (``rlhfflow.engine.speculative``): the target
distribution is kept exactly, greedy decoding gives the plain tokens, and ``adaptive``
picks the drafter and draft length per step from the workload. With ``migrate`` (plain
decoding), rows may move mid-way to an idle worker through ``StageContext.peers``
(sample reallocation, ``rlhfflow.runtime.worker.rebalance``) and come back decoded as here.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field

from rlhfflow.engine.generation import cut_at_stop, eos_ids, generate
from rlhfflow.engine.sampling import sample_step, sample_uniforms
from rlhfflow.sdk import (
    Batch,
    Column,
    IterationMetric,
    Stage,
    StageContext,
    StageParams,
    register_stage,
)

DRAFTERS = ("ngram", "layers", "model")


class GenerateParams(StageParams):
    """Sampling and decoding settings (docs/reference/stages.md, ``generate``). A
    response ends at an EOS id (the tokenizer's and the model's ``generation_config``'s)
    or right after the first of the ``stop`` strings."""

    max_new_tokens: Annotated[int, Field(
        gt=0, description="response length limit (and the buffer's response width)")] = 32
    temperature: Annotated[float, Field(
        gt=0, description="sampling temperature (also used by logprob and train_actor)")] = 1.0
    top_k: Annotated[int, Field(
        ge=0, description="keep the k most likely tokens; 0: off")] = 0
    top_p: Annotated[float, Field(
        gt=0, le=1, description="nucleus sampling; 1.0: off")] = 1.0
    greedy: bool = Field(False, description="argmax instead of sampling")
    stop: list[str] = Field([], description="end a response right after the first of these "
                                            "strings (kept in the response)")
    compact: bool = Field(True, description="rows that finished leave the decode batch and "
                                            "the KV cache (always on with a drafter)")
    drafter: Literal["none", "ngram", "layers", "model", "adaptive"] = Field(
        "none", description="speculative decoding: the drafter whose tokens the model "
                            "verifies, or adaptive (drafter and length chosen per step)")
    draft_k: Annotated[int, Field(
        ge=1, le=16, description="draft length of a fixed drafter; the longest adaptive "
                                 "tries")] = 4
    adaptive_drafters: list[Literal["ngram", "layers", "model"]] = Field(
        ["ngram", "layers"], description="the drafters adaptive chooses among")
    draft_model: str | None = Field(
        None, description="drafter model: a models.NAME with the actor's tokenizer")
    draft_layers: Annotated[int, Field(
        ge=1, description="drafter layers: how many of the actor's first decoder layers "
                          "draft")] = 4
    ngram_max: Annotated[int, Field(
        ge=1, le=8, description="drafter ngram: the longest n-gram matched")] = 4
    ngram_min: Annotated[int, Field(
        ge=1, le=8, description="drafter ngram: the shortest n-gram matched")] = 2
    ngram_history: Annotated[int, Field(
        ge=0, description="drafter ngram: earlier responses per prompt kept (per worker)")] = 4
    ngram_buffer: Annotated[int, Field(
        ge=0, description="drafter ngram: fill the history of a prompt the worker has "
                          "fewer than ngram_history responses of from the run's buffer, "
                          "its last N committed iterations; 0: off")] = 0
    migrate: bool = Field(
        True, description="sample reallocation: when this stage runs on several workers, "
                          "half the rows still decoding on one move to another that has "
                          "finished its part (plain decoding; results unchanged)")
    migrate_min_s: Annotated[float, Field(
        ge=0, description="move rows only when the remaining steps times what the "
                          "moved rows add to a step (measured as rows end) save more "
                          "than this many seconds (the handover's round trips); 0: "
                          "whenever a worker is idle")] = 0.05
    verify_cost: list[Annotated[float, Field(ge=0)]] | None = Field(
        None, description="adaptive's [seconds, seconds_per_token] of a forward; unset: "
                          "measured once per worker (sampled tokens then depend on it)")


#: Per-row decoding figures the stage writes (sum them over rows to aggregate).
METRIC_COLUMNS = {
    "gen_steps": Column("int64"),      # target forwards after the prompt the row was in
    "gen_drafted": Column("int64"),    # draft tokens proposed to the row and verified
    "gen_accepted": Column("int64"),   # of which the target accepted
    "gen_k_sum": Column("int64"),      # sum over its steps of the draft length used
    "gen_seconds": Column("float32"),  # its share of its call's wall time (call / rows)
    "gen_moved": Column("int64"),      # 1: the row finished on another worker (reallocated)
}

#: The decoding figures of an iteration's record (``Stage.iteration_metrics``): tokens/s
#: of the generate tasks, with speculative decoding the acceptance rate, accepted tokens
#: per verification and the mean draft length (None where nothing was drafted), and the
#: rows sample reallocation moved to another worker.
GENERATION_METRICS = (
    IterationMetric("gen_tokens_per_s", "response_mask", "ratio", over="gen_seconds",
                    digits=2),
    IterationMetric("gen_acceptance", "gen_accepted", "ratio", over="gen_drafted", digits=4),
    IterationMetric("gen_accepted_per_verify", "gen_accepted", "ratio", over="gen_steps",
                    requires="gen_drafted", digits=4),
    IterationMetric("gen_k_mean", "gen_k_sum", "ratio", over="gen_steps",
                    requires="gen_drafted", digits=3),
    IterationMetric("gen_rows_migrated", "gen_moved", "sum", digits=0),
)


@register_stage
class GenerateStage(Stage):
    """Sample responses from a causal LM (the actor). Writes response tokens, their mask,
    the sampling log-probs and ``policy_version``: the version of the weights that
    sampled each row (how stale it is when trained on), and per-row decoding figures
    (``METRIC_COLUMNS``). ``last_stats`` keeps the last call's ``DecodeStats`` (drafter
    and k chosen per step, rows that left the batch) for callers in the same process."""

    type_name = "generate"
    Params = GenerateParams
    model_head = "lm"
    generates = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # earlier prompt+response token sequences per prompt, for the n-gram drafter
        self.history: dict[int, deque] = {}
        # acceptance per drafter measured by earlier calls: adaptive starts from it
        self.acceptance: dict = {}
        self.last_stats = None

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("prompt_ids", "prompt_mask", "prompt_index", "sample_index")

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"response_ids": Column("int64", "response"),
                "response_mask": Column("int8", "response"),
                "sample_logprobs": Column("float32", "response"),
                "policy_version": Column("int64"),
                "response_text": Column("str"),
                **METRIC_COLUMNS}

    @classmethod
    def iteration_metrics(cls, params):
        return GENERATION_METRICS

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        uses = used_drafters(params)
        if "model" in uses and params.draft_model is None:
            key = "drafter" if params.drafter == "model" else "adaptive_drafters"
            return (f"params.{key}", "drafter 'model' needs params.draft_model "
                                     "(the name of a model in 'models')")
        if params.ngram_min > params.ngram_max:
            return ("params.ngram_min", f"must not exceed ngram_max ({params.ngram_max})")
        if params.verify_cost is not None and len(params.verify_cost) != 2:
            return ("params.verify_cost", "expected [seconds, seconds_per_token]")
        return None

    @classmethod
    def check_model(cls, params, shape):
        layers = shape.get("layers")
        if "layers" in used_drafters(params) and layers is not None and \
                params.draft_layers >= layers:
            return ("params.draft_layers", f"{params.draft_layers} must be below the "
                                           f"model's {layers} decoder layers (drafter "
                                           "'layers' drafts with the first of them)")
        return None

    @classmethod
    def auxiliary_models(cls, params) -> dict[str, str]:
        """Other models the stage uses, by key: they must be LMs with the stage model's
        tokenizer (the loader checks)."""
        if params.draft_model is not None and "model" in used_drafters(params):
            return {"params.draft_model": params.draft_model}
        return {}

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        start = time.perf_counter()
        resident = ctx.models.get(self.model)
        tok = resident.tokenizer
        params = self.params
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        eos = eos_ids(resident.module, tok)
        rows = len(batch["prompt_index"])
        handoff = ctx.peers if params.migrate and params.drafter == "none" else None
        if params.drafter == "none" and not params.compact and handoff is None:
            uniforms = sample_uniforms(ctx.seed, ctx.iteration, batch["prompt_index"],
                                       batch["sample_index"], params.max_new_tokens)
            with resident.generating():
                out = generate(resident.module, batch["prompt_ids"], batch["prompt_mask"],
                               uniforms, params, eos, pad_id)
            zeros = torch.zeros(rows, dtype=torch.long)
            out.update(gen_steps=zeros, gen_drafted=zeros, gen_accepted=zeros,
                       gen_k_sum=zeros, gen_moved=zeros)
        else:
            from rlhfflow.engine.speculative import decode

            with resident.generating():
                out, stats = decode_batch(resident, batch, ctx, params, self.history, decode,
                                          self.acceptance, eos, handoff)
            self.last_stats = stats
            out.update(gen_steps=stats.steps, gen_drafted=stats.drafted,
                       gen_accepted=stats.accepted, gen_k_sum=stats.k_sum,
                       gen_moved=stats.moved)
        if params.stop:
            cut_at_stop(out, tok, params.stop, pad_id)
        real = out["response_ids"].masked_fill(out["response_mask"] == 0, pad_id)
        out["response_text"] = tok.batch_decode(real.tolist(), skip_special_tokens=True)
        out["policy_version"] = torch.full((len(real),), resident.version, dtype=torch.long)
        seconds = time.perf_counter() - start
        out["gen_seconds"] = torch.full((rows,), seconds / max(rows, 1), dtype=torch.float32)
        return out

    def continue_rows(self, cont, ctx: StageContext) -> tuple[Batch, torch.Tensor]:
        """Finish rows another worker's call of this stage handed over (a
        ``speculative.Continuation``): ``(outputs, steps)`` for those rows, as that call
        would have computed them itself."""
        from rlhfflow.engine.speculative import decode

        resident = ctx.models.get(self.model)
        tok = resident.tokenizer
        with resident.generating():
            out, stats = decode(resident.module, None, None, cont.streams, self.params,
                                eos_ids(resident.module, tok), tok.pad_token_id or 0,
                                sample_step, resume=cont)
        return out, stats.steps


def used_drafters(params: GenerateParams) -> tuple[str, ...]:
    """The drafters a configuration may use."""
    if params.drafter == "adaptive":
        return tuple(params.adaptive_drafters)
    return () if params.drafter == "none" else (params.drafter,)


def decode_batch(resident, batch: Batch, ctx: StageContext, params: GenerateParams,
                 history: dict[int, deque], decode, acceptance: dict,
                 eos: Sequence[int] | None = None, handoff=None) -> tuple[Batch, object]:
    """Run ``speculative.decode`` on a batch with the drafters ``params`` ask for, and
    remember the responses for the n-gram drafter's history. ``acceptance`` (drafter ->
    ``Acceptance``) carries measured acceptance from call to call, halved each call."""
    from rlhfflow.engine import drafting
    from rlhfflow.engine.decoding import row_streams

    tok, module = resident.tokenizer, resident.module
    uses = used_drafters(params)
    streams = row_streams(ctx.seed, ctx.iteration, batch["prompt_index"],
                          batch["sample_index"], params.max_new_tokens, bool(uses))
    groups = batch["prompt_index"].tolist()
    if "ngram" in uses and params.ngram_history and params.ngram_buffer:
        fill_history_from_buffer(history, groups, params, ctx.settings.buffer)
    width = len(groups) * (params.draft_k + 1)

    def make_drafters(first: torch.Tensor, seqs: list[list[int]]) -> dict:
        drafters = {}
        if "ngram" in uses:
            past = {g: list(history.get(g, ())) for g in set(groups)}
            drafters["ngram"] = drafting.NgramDrafter(seqs, list(groups), past, params.ngram_max,
                                                  params.ngram_min)
        for name in ("layers", "model"):
            if name not in uses:
                continue
            if name == "layers":
                draft_module = _layers_view(module, params.draft_layers)
            else:
                draft = ctx.models.get(params.draft_model)
                check_same_vocabulary(tok, draft.tokenizer, params.draft_model)
                draft_module = draft.module
            drafters[name] = drafting.ModelDrafter(name, draft_module, batch["prompt_ids"],
                                               batch["prompt_mask"], first,
                                               drafter_cost(draft_module))
        return drafters

    def drafter_cost(draft_module: torch.nn.Module) -> drafting.ForwardCost:
        if params.drafter != "adaptive":
            return drafting.ForwardCost.linear(0.0, 0.0)  # a fixed policy never asks
        if params.verify_cost is None:
            return drafting.measure_cost(draft_module, len(groups))
        # a fixed cost model: scale the actor's by the parameters that draft
        ratio = (sum(p.numel() for p in draft_module.parameters())
                 / sum(p.numel() for p in module.parameters()))
        return drafting.ForwardCost.linear(*(c * ratio for c in params.verify_cost))

    if params.drafter == "adaptive":
        verify_cost = (drafting.ForwardCost.linear(*params.verify_cost) if params.verify_cost
                       else drafting.measure_cost(module, width))
        for known in acceptance.values():
            known.decay(0.5)  # earlier calls count, the latest most
        policy = drafting.AdaptivePolicy(verify_cost, params.draft_k, acceptance,
                                     timed=params.verify_cost is None)
    else:
        policy = drafting.FixedPolicy(None if params.drafter == "none" else params.drafter,
                                  0 if params.drafter == "none" else params.draft_k)
    out, stats = decode(module, batch["prompt_ids"], batch["prompt_mask"], streams, params,
                        eos if eos is not None else tok.eos_token_id, tok.pad_token_id or 0,
                        sample_step,
                        make_drafters if uses else None, policy, handoff)
    if "ngram" in uses and params.ngram_history:
        real = batch["prompt_mask"].bool()
        for row, group in enumerate(groups):
            seq = batch["prompt_ids"][row][real[row]].tolist()
            seq += out["response_ids"][row][out["response_mask"][row].bool()].tolist()
            past = history.setdefault(group, deque(maxlen=params.ngram_history))
            if seq not in past:  # a repeat adds nothing to look up (greedy repeats)
                past.append(seq)
    return out, stats


def fill_history_from_buffer(history: dict[int, deque], groups: list[int],
                             params: GenerateParams, buffer: str | None) -> None:
    """Complete the n-gram history of the prompts in ``groups`` that this worker holds
    fewer than ``ngram_history`` responses of (it never generated them, or restarted)
    with their responses in the run's experience buffer: older ones first, the worker's
    own after them. The in-stage history stays the fast path: full prompts read nothing."""
    from rlhfflow.storage.history import prompt_history

    short = [g for g in dict.fromkeys(groups)
             if len(history.get(g, ())) < params.ngram_history]
    if not buffer or not short:
        return
    found = prompt_history(buffer, short, params.ngram_history, params.ngram_buffer)
    for group, seqs in found.items():
        if seqs:
            own = list(history.get(group, ()))
            older = [seq for seq in seqs if seq not in own]  # its own are stored there too
            history[group] = deque([*older, *own], maxlen=params.ngram_history)


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layers_view(module: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The actor's first-layers drafter, built once per module (it shares the weights)."""
    from rlhfflow.engine.drafting import shallow_view

    views = _VIEWS.setdefault(module, {})
    if layers not in views:
        views[layers] = shallow_view(module, layers)
    return views[layers]


def check_same_vocabulary(actor_tok, draft_tok, draft_name: str) -> None:
    """A draft model must share the actor's tokenizer: token ids are compared as is."""
    if actor_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft model {draft_name!r} has another tokenizer than the actor "
                         f"({len(draft_tok)} vs {len(actor_tok)} tokens or other ids)")
