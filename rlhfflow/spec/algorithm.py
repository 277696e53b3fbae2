"""The ``algorithm:`` section: the estimator, the policy loss and their settings, with the
presets (``name: ppo`` / ``grpo`` / ...) resolved through the ops registries."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from rlhfflow import ops
from rlhfflow.errors import did_you_mean
from rlhfflow.spec.fields import NonNegFloat, PositiveFloat, Strict

LossAgg = Literal["token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"]
# The estimator each preset ``name`` uses unless ``advantage_estimator`` says otherwise.
PRESET_ESTIMATORS = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo", "dr_grpo": "dr_grpo"}
# Built-in estimators that read ``scale_rewards``; a user's function gets the config too.
_SCALED_ESTIMATORS = ("grpo", "dr_grpo")


def _resolve_problem(ref: str, kind: str, registry: Mapping[str, Any],
                     resolve: typing.Callable[[str], Any], provided: tuple[str, ...]) -> str | None:
    """Why ``ref`` (a registered name or ``module:function``) is not usable, or None."""
    if ":" not in ref and ref not in registry:
        hint = did_you_mean(ref, registry) or f"; known: {', '.join(sorted(registry))}"
        return (f"unknown {kind} {ref!r}{hint} (or give an import path "
                f"'package.module:function')")
    try:
        fn = resolve(ref)
    except ValueError as exc:
        return str(exc).splitlines()[0]
    problem = ops.signature_problem(fn, provided)
    return f"{kind} {ref!r}: {problem}" if problem else None


class OffPolicySpec(Strict):
    """How the actor's loss corrects for tokens sampled by another policy than the one the
    update is measured against (``rlhfflow.ops.offpolicy``): asynchronous rollouts
    (``overlap.max_staleness``), or a sampler whose numerics differ from the trainer's.
    The proximal log-probs cost the trainer one forward pass over the batch, without
    gradients, before its first step; none when the iteration takes one step (one epoch
    of one minibatch, no dropout): the step's own forward gives them."""

    correction: Literal["none", "tis", "mis", "decoupled"] = Field("none", description=(
        "`none`: the PPO ratio divides by the behaviour policy's log-probs (`train_actor`'s "
        "`old_logprobs` column) as they are. Otherwise the trainer recomputes the proximal "
        "policy's (the actor before the iteration's first step), takes the ratio against "
        "them and weights each token's loss by `w = pi_prox / pi_behaviour`: `tis` "
        "(truncated IS) by `min(w, cap)`; `mis` (masked IS) by `w` where it lies in "
        "`[low, high]`, else 0; `decoupled` (AReaL's decoupled PPO) by `w`, 0 above `cap`."))
    level: Literal["token", "sequence", "geometric"] = Field("token", description=(
        "What one weight covers: each `token`, the whole `sequence` (the product of its "
        "tokens' ratios) or its `geometric` mean (a length-independent sequence weight)."))
    cap: PositiveFloat = Field(2.0, description=(
        "`tis`: the weights' truncation; `decoupled`: the weight above which a token "
        "leaves the loss."))
    low: PositiveFloat = Field(0.5, description="`mis`: the lowest weight kept.")
    high: PositiveFloat = Field(2.0, description="`mis`: the highest weight kept.")

    @model_validator(mode="after")
    def _bounds(self) -> OffPolicySpec:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.correction in ("tis", "decoupled") and self.cap < 1.0:
            raise ValueError(f"cap {self.cap} is below 1: on-policy tokens (weight 1) "
                             f"would be cut; use 1 or more")
        if self.correction == "mis" and not self.low <= 1.0 <= self.high:
            raise ValueError(f"[low, high] = [{self.low}, {self.high}] leaves out "
                             f"on-policy tokens (weight 1); it must contain 1")
        return self

    @property
    def on(self) -> bool:
        """Whether a correction applies."""
        return self.correction != "none"


class AlgorithmSpec(Strict):
    """The RL algorithm: a preset ``name`` whose parts (advantage estimator, policy loss,
    reward scaling) can each be overridden, plus KL penalty, clipping and aggregation."""

    name: Literal["ppo", "grpo", "rloo", "dr_grpo"] = Field("ppo", description=(
        "The preset: its advantage estimator (`ppo` -> `gae`, the others -> the estimator of the "
        "same name)."))
    advantage_estimator: str | None = Field(None, description=(
        "A registered estimator (`gae`, `grpo`, `rloo`, `dr_grpo`, `reinforce_plus_plus`, "
        "`reinforce_plus_plus_baseline`, `remax`) or your own as `package.module:function`; "
        "`null`: the preset's. Whether the pipeline needs a critic follows the estimator."))
    policy_loss: str = Field("ppo", description=(
        "A registered policy loss or `package.module:function`; `ppo` is the clipped surrogate "
        "(GSPO with `importance_sampling_level: sequence`)."))
    scale_rewards: Literal["group", "batch", "none"] | None = Field(None, description=(
        "GRPO's std normalisation (TRL's `scale_rewards`): divide the centred score by the std "
        "of its `group`, of the whole `batch`, or by nothing (`none`, Dr. GRPO). `null`: `group` "
        "for `grpo`, `none` for `dr_grpo`. Only the `grpo` and `dr_grpo` estimators (and your "
        "own, which get the config) read it."))
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description=(
        "`sequence`: every token uses its sequence's ratio `exp(mean log(pi/pi_old))` (GSPO), "
        "clipped as a whole; pair it with `loss_agg: seq-mean-token-mean` and a small clip range "
        "for GSPO's objective."))
    gamma: Annotated[float, Field(ge=0, le=1)] = Field(1.0, description=(
        "Discount (`gae`, `reinforce_plus_plus`)."))
    lam: Annotated[float, Field(ge=0, le=1)] = Field(0.95, description="GAE lambda.")
    kl_coef: NonNegFloat = Field(0.05, description=(
        "Weight of the KL penalty to the reference; `0` turns it off."))
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description=(
        "Per-token KL estimator: `k1 = log(pi/ref)`, `k2 = 0.5 log(pi/ref)^2`, `k3 = ref/pi - 1 "
        "- log(ref/pi)`."))
    kl_in: Literal["reward", "loss"] = Field("reward", description=(
        "Where the penalty goes: into the rewards (`reward`: the `advantages` stage reads both "
        "log-prob columns) or into the actor's loss (`loss`: `train_actor` reads "
        "`ref_logprobs`), aggregated with `loss_agg`."))
    clip_low: PositiveFloat = Field(0.2, description=(
        "Lower PPO ratio clip: the ratio is clipped to `[1 - clip_low, 1 + clip_high]`."))
    clip_high: PositiveFloat = Field(0.2, description=(
        "Upper PPO ratio clip: the ratio is clipped to `[1 - clip_low, 1 + clip_high]`."))
    dual_clip: Annotated[float, Field(gt=1)] | None = Field(None, description=(
        "Dual-clip PPO bound for negative advantages (adds the `clip_frac_lower` metric); "
        "`null`: off."))
    value_clip: PositiveFloat | None = Field(0.2, description=(
        "Critic value clip: the loss takes the larger of the errors of `v` and of `v` clamped to "
        "`[old - value_clip, old + value_clip]`; `null`: unclipped."))
    whiten_advantages: bool = Field(True, description=(
        "Normalise `gae` advantages over the batch's response tokens (`reinforce_plus_plus*` "
        "always whiten, as in veRL)."))
    loss_agg: LossAgg = Field("token-mean", description=(
        "How the actor's per-token losses become one number: the policy term and the KL and "
        "entropy terms alike (veRL's `loss_agg_mode`)."))
    value_loss_agg: LossAgg = Field("token-mean", description=(
        "How the critic's per-token value losses become one number."))
    loss_scale_factor: PositiveFloat | None = Field(None, description=(
        "The constant divisor of `seq-mean-token-sum-norm`; `null`: the response length "
        "(`max_new_tokens` of the generate stage)."))
    entropy_coef: NonNegFloat = Field(0.0, description=(
        "Weight of the entropy bonus in the actor loss."))
    off_policy: OffPolicySpec = Field(default_factory=OffPolicySpec, description=(
        "Off-policy correction of the actor's loss (`correction`, `level`, `cap`, `low`, "
        "`high`); off by default."))

    @field_validator("advantage_estimator")
    @classmethod
    def _known_estimator(cls, ref: str | None) -> str | None:
        if ref is not None:
            problem = _resolve_problem(ref, "advantage estimator", ops.ADVANTAGE_ESTIMATORS,
                                       ops.resolve_advantage_estimator, ops.ESTIMATOR_INPUTS)
            if problem:
                raise ValueError(problem)
        return ref

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, ref: str) -> str:
        problem = _resolve_problem(ref, "policy loss", ops.POLICY_LOSSES,
                                   ops.resolve_policy_loss, ops.POLICY_LOSS_INPUTS)
        if problem:
            raise ValueError(problem)
        return ref

    @model_validator(mode="after")
    def _options_that_apply(self) -> AlgorithmSpec:
        if self.scale_rewards is not None and self.estimator in ops.ADVANTAGE_ESTIMATORS \
                and self.estimator not in _SCALED_ESTIMATORS:
            raise ValueError(f"scale_rewards applies to the grpo and dr_grpo estimators, not "
                             f"{self.estimator!r}; remove it")
        if self.off_policy.on and not ops.takes(ops.resolve_policy_loss(self.policy_loss),
                                                "weights"):
            raise ValueError(f"off_policy.correction {self.off_policy.correction!r} weights "
                             f"the policy loss, and {self.policy_loss!r} takes no 'weights' "
                             f"input; add a weights=None parameter that multiplies each "
                             f"token's loss")
        norm = "seq-mean-token-sum-norm"
        if self.loss_scale_factor is not None and norm not in (self.loss_agg,
                                                               self.value_loss_agg):
            raise ValueError(f"loss_scale_factor is the divisor of loss_agg {norm!r}; "
                             f"set loss_agg (or value_loss_agg) to it or remove the factor")
        return self

    @property
    def estimator(self) -> str:
        """The advantage estimator: ``advantage_estimator``, or the preset's."""
        return self.advantage_estimator or PRESET_ESTIMATORS[self.name]

    @property
    def estimator_needs(self) -> tuple[str, ...]:
        """Optional inputs the estimator reads (``"values"``, ``"baseline_scores"``)."""
        return ops.estimator_needs(ops.resolve_advantage_estimator(self.estimator))

    @property
    def grouped(self) -> bool:
        """Whether the estimator compares the responses to one prompt (GRPO, RLOO,
        Dr. GRPO, REINFORCE++ with a group baseline): it needs several per prompt."""
        return ops.estimator_grouped(ops.resolve_advantage_estimator(self.estimator))

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator reads a critic's values (GAE does; the group-relative
        estimators, REINFORCE++ and ReMax do not)."""
        return "values" in self.estimator_needs
