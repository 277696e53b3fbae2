"""Registries of advantage estimators and policy losses: the path a config takes.

An estimator or a policy loss is one decorated function. ``algorithm.advantage_estimator``
and ``algorithm.policy_loss`` name a registered function, or a user's function by import
path ``package.module:function`` (``resolve``). The ``advantages`` and ``train_actor``
stages look the function up here and call it with keyword arguments (``call``), passing
only the inputs its signature names, so a user function takes just what it needs::

    @ops.register_advantage_estimator("my_rloo")
    def my_rloo(scores, group_ids, mask, **_):
        adv = scores - ...
        return adv[:, None] * mask, None

Estimator inputs (``ESTIMATOR_INPUTS``; only samples with a valid score are passed):
    scores: (N,) the sequence score (minus ``kl_coef * sum(kl)`` when the KL is in the reward)
    token_rewards: (N, T) ``token_rewards(...)``: KL penalty per token, score at the last one
    mask: (N, T) 1 on valid response tokens
    group_ids: (N,) samples with the same id answer the same prompt
    values: (N, T) the critic's values, for estimators registered with ``needs=("values",)``
    baseline_scores: (N,) a baseline's score per sample (e.g. ReMax's greedy response), for
        estimators registered with ``needs=("baseline_scores",)``
    config: the pipeline's ``algorithm`` settings (gamma, lam, scale_rewards, ...)
and it returns ``(advantages (N, T), returns (N, T) or None)``.

Policy-loss inputs (``POLICY_LOSS_INPUTS``): ``logprobs``, ``old_logprobs``,
``advantages``, ``mask`` (B, T); ``agg`` and ``count`` (see ``aggregate_loss``); ``config``;
``weights`` (B, T), an off-policy correction's importance weights (``ops.offpolicy``,
1 everywhere without one), which a loss must take for ``algorithm.off_policy`` to apply.
It returns ``(loss scalar, stats: dict of python floats)``; every stat is logged.

This module imports no torch: a config names its estimator and loss, and is checked
against these registries (``rlhfflow.spec``), where torch is not needed, on the
coordinator, by ``rlhfflow plan`` and ``validate``. The built-ins below take the math
from the torch modules when they are called (with tensors, so torch is loaded by then).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

ESTIMATOR_INPUTS = ("scores", "token_rewards", "mask", "group_ids", "values",
                    "baseline_scores", "config")
# Inputs an estimator must declare in ``needs``: each is a column an upstream stage writes.
ESTIMATOR_NEEDS = ("values", "baseline_scores")
POLICY_LOSS_INPUTS = ("logprobs", "old_logprobs", "advantages", "mask", "agg", "count",
                      "config", "weights")

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


def _register(registry: dict[str, Callable[..., Any]], kind: str, name: str,
              fn: Callable[..., Any]) -> None:
    # Re-registering a name with another function raises, so two modules cannot silently
    # shadow each other; re-importing the same module is fine.
    existing = registry.get(name)
    if existing is not None and existing is not fn:
        raise ValueError(f"{kind} {name!r} is already registered: {existing}")
    registry[name] = fn


def register_advantage_estimator(
    name: str, needs: tuple[str, ...] = (), grouped: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that registers an advantage estimator under ``name``.

    ``needs`` lists the optional inputs the estimator reads (``"values"``: it needs a
    critic; ``"baseline_scores"``: a baseline's scores); the ``advantages`` stage then
    reads those columns, and the pipeline checks that an upstream stage writes them.
    ``grouped``: the estimator compares the responses to one prompt with each other, so
    with one response per prompt every advantage is 0 (the pipeline refuses that).
    """
    unknown = set(needs) - set(ESTIMATOR_NEEDS)
    if unknown:
        raise ValueError(f"unknown needs {sorted(unknown)}; expected some of {ESTIMATOR_NEEDS}")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name, fn)
        # function attributes, read back by estimator_needs and estimator_grouped
        vars(fn).update(needs=tuple(needs), grouped=grouped)
        return fn

    return decorator


def register_policy_loss(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that registers a policy loss under ``name`` (see the module docstring)."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        _register(POLICY_LOSSES, "policy loss", name, fn)
        return fn

    return decorator


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    """Return the estimator registered under ``name``; ValueError listing known names if none."""
    return _get(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """Return the policy loss registered under ``name``; ValueError listing known names."""
    return _get(POLICY_LOSSES, "policy loss", name)


def _get(registry: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None


def load_callable(ref: str) -> Callable[..., Any]:
    """Import ``package.module:function``; ValueError (one line) if it does not resolve."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected a registered name or 'package.module:function', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r}: {exc}") from None
    fn: object = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no callable {attr!r}")
    return fn


def resolve_advantage_estimator(ref: str) -> Callable[..., Any]:
    """The estimator ``ref`` names: a registered name or an import path ``mod:fn``."""
    return load_callable(ref) if ":" in ref else get_advantage_estimator(ref)


def resolve_policy_loss(ref: str) -> Callable[..., Any]:
    """The policy loss ``ref`` names: a registered name or an import path ``mod:fn``."""
    return load_callable(ref) if ":" in ref else get_policy_loss(ref)


def estimator_needs(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The optional inputs an estimator declared (``register_advantage_estimator``); a
    plain function found by import path declares none."""
    return tuple(getattr(fn, "needs", ()))


def estimator_grouped(fn: Callable[..., Any]) -> bool:
    """Whether an estimator declared itself group-relative (``grouped=True``); a plain
    function found by import path is not known to be."""
    return bool(getattr(fn, "grouped", False))


def signature_problem(fn: Callable[..., Any], provided: tuple[str, ...]) -> str | None:
    """Why ``call(fn, ...)`` with the keyword arguments ``provided`` would fail, or None:
    a required parameter that is not provided, or one that cannot be passed by keyword."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # builtins without a signature: find out when called
    for p in params:
        required = p.default is inspect.Parameter.empty
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            return f"its parameter {p.name!r} is positional-only; take keyword arguments"
        if (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and required
                and p.name not in provided):
            return (f"it takes parameter {p.name!r}, which is not provided (provided: "
                    f"{', '.join(provided)})")
    return None


def takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``call`` passes the input ``name`` to ``fn`` (named, or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def call(fn: Callable[..., Any], inputs: Mapping[str, Any]) -> Any:
    """Call ``fn`` with the keyword ``inputs`` its signature names (all of them if it
    takes ``**kwargs``), so registered functions take only what they use."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(**inputs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn(**inputs)
    names = {p.name for p in params}
    return fn(**{k: v for k, v in inputs.items() if k in names})


# --- built-in advantage estimators -----------------------------------------------------
# Each takes its math from the torch modules when called (see the module docstring).


class _AlgorithmConfig(Protocol):
    """The fields of the ``algorithm:`` section the built-ins read (ops imports nothing of
    the config layer, so this names them)."""

    @property
    def gamma(self) -> float: ...
    @property
    def lam(self) -> float: ...
    @property
    def whiten_advantages(self) -> bool: ...
    @property
    def clip_low(self) -> float: ...
    @property
    def clip_high(self) -> float: ...
    @property
    def dual_clip(self) -> float | None: ...


def _broadcast(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) outcome advantages -> (N, T) on the valid tokens."""
    return seq_adv[:, None] * mask


@register_advantage_estimator("gae", needs=("values",))
def _gae_estimator(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   config: _AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: ``gae`` over the per-token rewards, whitened over the batch's valid tokens
    when ``config.whiten_advantages``; returns are the critic's targets."""
    from rlhfflow.ops.advantages import gae
    from rlhfflow.ops.core import masked_whiten

    advantages, returns = gae(token_rewards, values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _scale(config: object, default: str) -> str:
    scale: str | None = getattr(config, "scale_rewards", None)
    return scale or default


@register_advantage_estimator("grpo", grouped=True)
def _grpo_estimator(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                    config: object = None) -> tuple[torch.Tensor, None]:
    """``group_advantages(mode="grpo")``, scaled per ``config.scale_rewards`` (default
    ``group``), broadcast to the tokens."""
    from rlhfflow.ops.advantages import group_advantages

    scale = _scale(config, "group")
    return _broadcast(group_advantages(scores, group_ids, "grpo", scale=scale), mask), None


@register_advantage_estimator("rloo", grouped=True)
def _rloo_estimator(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, None]:
    """``group_advantages(mode="rloo")`` broadcast to the tokens."""
    from rlhfflow.ops.advantages import group_advantages

    return _broadcast(group_advantages(scores, group_ids, "rloo"), mask), None


@register_advantage_estimator("dr_grpo", grouped=True)
def _dr_grpo_estimator(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                       config: object = None) -> tuple[torch.Tensor, None]:
    """``group_advantages(mode="dr_grpo")`` (GRPO without the std) broadcast to the
    tokens; ``config.scale_rewards`` may still ask for a ``group`` or ``batch`` std."""
    from rlhfflow.ops.advantages import group_advantages

    scale = _scale(config, "none")
    mode = "dr_grpo" if scale == "none" else "grpo"
    return _broadcast(group_advantages(scores, group_ids, mode, scale=scale), mask), None


@register_advantage_estimator("reinforce_plus_plus")
def _reinforce_pp_estimator(token_rewards: torch.Tensor, mask: torch.Tensor,
                            config: _AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``reinforce_plus_plus`` with ``config.gamma``."""
    from rlhfflow.ops.advantages import reinforce_plus_plus

    return reinforce_plus_plus(token_rewards, mask, config.gamma)


@register_advantage_estimator("reinforce_plus_plus_baseline", grouped=True)
def _reinforce_pp_baseline_estimator(scores: torch.Tensor, group_ids: torch.Tensor,
                                     mask: torch.Tensor) -> tuple[torch.Tensor, None]:
    """``reinforce_plus_plus_baseline``: group-mean baseline, whitened over the batch."""
    from rlhfflow.ops.advantages import reinforce_plus_plus_baseline

    return reinforce_plus_plus_baseline(scores, group_ids, mask), None


@register_advantage_estimator("remax", needs=("baseline_scores",))
def _remax_estimator(token_rewards: torch.Tensor, baseline_scores: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``remax``: reward-to-go minus the greedy response's score."""
    from rlhfflow.ops.advantages import remax

    return remax(token_rewards, baseline_scores, mask)


# --- built-in policy losses -------------------------------------------------------------


@register_policy_loss("ppo")
def _ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     advantages: torch.Tensor, mask: torch.Tensor, agg: str,
                     count: float | None, config: _AlgorithmConfig,
                     weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """``policy_loss`` with the config's clip range, dual clip and importance-sampling
    level (``sequence`` is GSPO), and an off-policy correction's ``weights``."""
    from rlhfflow.ops.losses import policy_loss

    return policy_loss(logprobs, old_logprobs, advantages, mask, config.clip_low,
                       config.clip_high, config.dual_clip, agg, count,
                       getattr(config, "importance_sampling_level", "token"), weights)
