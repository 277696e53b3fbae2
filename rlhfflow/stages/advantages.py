"""``advantages``: turn scores (and values, KL) into per-token advantages.

``remax_baseline``: the score of one greedy response per prompt, the baseline ReMax's
estimator reads (``baseline_scores``).

The estimator is the one ``algorithm`` names (``AlgorithmSpec.estimator``), looked up in
the ops registry (``ops.resolve_advantage_estimator``) and called with the standard inputs
its signature names (``ops.registry``): PPO's GAE over per-token rewards (KL penalty plus
the score at the last token), group-relative GRPO / RLOO / Dr. GRPO, REINFORCE++ (with
or without a group baseline), ReMax, or a user's function by import path. The KL term goes
in the reward or in the loss (``algorithm.kl_in``). The stage needs the whole batch
(whitening and groups span it).

``per_turn: true`` gives each model turn of a multi-turn episode (``rollout``) its own
credit from the rewards after it (``ops.turns``): the token-level estimators (GAE,
REINFORCE++, ReMax) get each turn's reward on its last token instead of the score at the
end; the outcome estimators (GRPO, RLOO, Dr. GRPO, REINFORCE++ with a baseline) see each
turn as a sample scored with its discounted return (``turn_gamma`` per turn), compared
with the same turn of the other episodes of its prompt.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import Field

from rlhfflow import ops
from rlhfflow.engine.batch import score_valid
from rlhfflow.engine.generation import Sampling, generate
from rlhfflow.engine.usercode import load_function
from rlhfflow.sdk import (
    Batch,
    Column,
    IterationMetric,
    Stage,
    StageContext,
    StageParams,
    register_stage,
)


def _kl_in_reward(algorithm) -> bool:
    return algorithm.kl_coef > 0 and algorithm.kl_in == "reward"


class AdvantagesParams(StageParams):
    """Per-episode (the default) or per-turn credit."""

    per_turn: bool = Field(False, description="credit each model turn of a multi-turn "
                                              "episode with the rewards after it (reads "
                                              "the rollout stage's turn_rewards); false: "
                                              "the episode's score for all its tokens")
    turn_gamma: Annotated[float, Field(
        ge=0, le=1, description="with per_turn: discount per model turn of the returns "
                                "the outcome estimators (GRPO, RLOO, ...) score turns "
                                "with")] = 1.0


@register_stage
class AdvantagesStage(Stage):
    """Advantages (and returns, for estimators with a critic) from the estimator the
    pipeline's ``algorithm`` names."""

    type_name = "advantages"
    Params = AdvantagesParams
    per_batch = True

    @classmethod
    def reads(cls, params, algorithm, has_model):
        cols = ["scores", "score_valid", "response_mask", *algorithm.estimator_needs]
        if params.per_turn:
            cols.append("turn_rewards")
        if ops.takes(ops.resolve_advantage_estimator(algorithm.estimator), "group_ids"):
            cols.append("group_ids")
        if _kl_in_reward(algorithm):
            cols += ["old_logprobs", "ref_logprobs"]
        return tuple(cols)

    @classmethod
    def writes(cls, params, algorithm, has_model):
        out = {"advantages": Column("float32", "response")}
        if algorithm.uses_critic:
            out["returns"] = Column("float32", "response")
        if _kl_in_reward(algorithm):
            out["kl"] = Column("float32", "response")
        return out

    @classmethod
    def iteration_metrics(cls, params):
        # per response token; present where the KL is in the reward (the column written)
        return (IterationMetric("kl_mean", "kl", "token_mean", over="response_mask"),)

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        algo = self.algorithm
        valid = score_valid(batch)
        mask = batch["response_mask"].float() * valid[:, None]  # skipped samples: no tokens
        out: Batch = {}
        kl = None
        if _kl_in_reward(algo):
            kl = ops.kl(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_estimator) * mask
            out["kl"] = kl
        inputs = _estimator_inputs(batch, algo, mask, kl, self.params.per_turn)
        # estimators see only the samples with a score: group statistics, whitening and
        # baselines never include a skipped sample
        rows = None if bool(valid.all()) else valid
        if rows is not None:
            inputs = {k: (v[rows] if isinstance(v, torch.Tensor) else v)
                      for k, v in inputs.items()}
        estimator = ops.resolve_advantage_estimator(algo.estimator)
        turn = {k: inputs.pop(k) for k in ("turn_rewards", "raw_scores", "kl") if k in inputs}
        if self.params.per_turn and not ops.takes(estimator, "token_rewards"):
            advantages, returns = _per_turn(estimator, inputs, turn, algo,
                                            self.params.turn_gamma), None
        else:  # per_turn for a token-level estimator is in its token_rewards
            advantages, returns = ops.call(estimator, inputs)
        expected = tuple(inputs["mask"].shape)
        if tuple(advantages.shape) != expected or (
                algo.uses_critic and (returns is None or tuple(returns.shape) != expected)):
            got = (tuple(advantages.shape), None if returns is None else tuple(returns.shape))
            raise ValueError(f"advantage estimator {algo.estimator!r} returned (advantages, "
                             f"returns) of shapes {got}; expected {expected} for both "
                             f"(returns may be None without a critic)")
        if rows is not None:
            advantages = _scatter_rows(advantages, rows, mask)
            returns = None if returns is None else _scatter_rows(returns, rows, mask)
        if algo.uses_critic:
            out["returns"] = returns
        out["advantages"] = advantages * mask
        return out


def _estimator_inputs(batch: Batch, algo, mask: torch.Tensor, kl: torch.Tensor | None,
                      per_turn: bool = False) -> dict[str, object]:
    """The standard estimator inputs (``ops.registry``) for all rows of ``batch``; with
    ``per_turn`` the turn rewards on the turns' last tokens, and what the per-turn
    returns are computed from (``turn_rewards``, ``raw_scores``, ``kl``)."""
    scores = batch["scores"].float()
    kl_term = kl if kl is not None else torch.zeros_like(mask)
    token_rewards = ops.token_rewards(scores, kl_term, mask,
                                      algo.kl_coef if kl is not None else 0.0)
    inputs: dict[str, object] = {}
    if per_turn:
        turn_rewards = batch["turn_rewards"].float()
        token_rewards = ops.per_turn_token_rewards(turn_rewards, scores, mask, kl,
                                                   algo.kl_coef)
        inputs.update(turn_rewards=turn_rewards, raw_scores=scores, kl=kl)
    if kl is not None:  # the same penalty, summed, for the outcome-level estimators
        scores = scores - algo.kl_coef * (kl * mask).sum(-1)
    inputs.update(scores=scores, token_rewards=token_rewards, mask=mask, config=algo)
    if "group_ids" in batch:  # read only when the estimator takes it (see reads)
        inputs["group_ids"] = batch["group_ids"]
    for column in algo.estimator_needs:
        inputs[column] = batch[column].float()
    return inputs


def _per_turn(estimator, inputs: dict[str, object], turn: dict[str, object], algo,
              gamma: float) -> torch.Tensor:
    """An outcome estimator's advantages with each model turn as a sample scored with its
    discounted return (``ops.call_per_turn``)."""
    rewards = ops.per_turn_rewards(turn["turn_rewards"], turn["raw_scores"], inputs["mask"],
                                   turn["kl"], algo.kl_coef)
    returns = ops.turn_returns(rewards, ops.turn_index(inputs["mask"])[1], gamma)
    return ops.call_per_turn(estimator, inputs, ops.call, returns)


def _scatter_rows(part: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (a bool [N] mask) of a zero tensor shaped ``like`` set to ``part``."""
    full = torch.zeros_like(like, dtype=part.dtype)
    full[rows] = part
    return full


class RemaxBaselineParams(StageParams):
    """The greedy response's length and the reward ``function`` that scores it (named and
    called as a ``score`` stage's: ``function(prompts, responses, **kwargs)``; give the
    same one as the pipeline's score stage, so the baseline is on the same scale)."""

    max_new_tokens: Annotated[int, Field(gt=0, description="length of the greedy "
                                                           "baseline response")] = 32
    function: str | None = Field(None, description="the reward function that scores the "
                                                   "baseline, named as a score stage's")
    kwargs: dict[str, Any] = Field({}, description="keyword arguments for function")


@register_stage
class RemaxBaselineStage(Stage):
    """ReMax's baseline (Li et al., 2023): decode one response per prompt greedily with
    the actor and score it; every sample of the prompt gets that score as
    ``baseline_scores``. A stage of its own (not a second ``generate`` + ``score``),
    because those write fixed column names that would collide with the sampled ones."""

    type_name = "remax_baseline"
    samples = True
    Params = RemaxBaselineParams
    model_head = "lm"

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        if params.function is None:
            return ("params.function", "required key is missing: the reward function "
                    "('module:function') that scores the greedy response")
        try:
            load_function(params.function, base_dir)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
            return ("params.function", str(exc).splitlines()[0])
        return None

    @classmethod
    def reads(cls, params, algorithm, has_model):
        return ("prompt_ids", "prompt_mask", "prompt_index", "prompt_text")

    @classmethod
    def writes(cls, params, algorithm, has_model):
        return {"baseline_scores": Column("float32")}

    @torch.no_grad()
    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        tok = resident.tokenizer
        # the samples of one prompt share its greedy response: decode each prompt once
        prompts, first = _first_rows(batch["prompt_index"])
        params = Sampling(max_new_tokens=self.params.max_new_tokens, greedy=True)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        unused = torch.zeros(len(first), params.max_new_tokens)  # greedy draws nothing
        with resident.generating():
            out = generate(resident.module, batch["prompt_ids"][first],
                           batch["prompt_mask"][first], unused, params, tok.eos_token_id,
                           pad_id)
        real = out["response_ids"].masked_fill(out["response_mask"] == 0, pad_id)
        responses = tok.batch_decode(real.tolist(), skip_special_tokens=True)
        fn = load_function(self.params.function, ctx.settings.base_dir)
        texts = [batch["prompt_text"][i] for i in first.tolist()]
        scores = torch.as_tensor(fn(texts, responses, **self.params.kwargs),
                                 dtype=torch.float32).flatten()
        if scores.shape[0] != len(responses):
            raise ValueError(f"stage {self.name!r}: reward returned {scores.shape[0]} scores "
                             f"for {len(responses)} responses")
        if not torch.isfinite(scores).all():  # a baseline has no sample to leave out
            raise ValueError(f"stage {self.name!r}: the reward of a greedy response is not "
                             f"finite")
        return {"baseline_scores": scores[prompts]}


def _first_rows(prompt_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``prompt_index [N]``: each row's prompt as 0..P-1, and the first row of each."""
    uniq, inverse = torch.unique(prompt_index, return_inverse=True)
    rows = torch.arange(len(prompt_index))
    first = torch.full((len(uniq),), len(prompt_index), dtype=torch.long)
    first = first.scatter_reduce(0, inverse, rows, "amin")
    return inverse, first
