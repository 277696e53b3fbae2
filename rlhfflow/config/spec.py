"""The pipeline file: YAML parsed once into typed, frozen objects.

Every error is one line: ``FILE: KEY.PATH: what was expected``. Nothing downstream of
``load_pipeline`` re-validates; it trusts these objects.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rlhfflow import ops
from rlhfflow.errors import SpecError
from rlhfflow.stages import StageParams


class Strict(BaseModel):
    """Base of every spec object: unknown keys are errors, values are frozen, no coercion
    of strings into numbers (``batch_size: "8"`` is a mistake, not 8)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
MODEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class OptimizerSpec(Strict):
    """AdamW settings of a trainable model, its learning-rate schedule, and what to do
    with a non-finite loss or gradient.

    The schedule counts optimizer steps: ``warmup_steps`` rise linearly from 0 to ``lr``,
    then ``schedule`` keeps it (``constant``) or decays it to ``min_lr_ratio * lr`` at
    ``total_steps`` (``linear``, ``cosine``). ``total_steps`` defaults to what the loop
    takes: ``iterations`` x the ``epochs * minibatches`` of every stage training the model.
    ``skip_nonfinite``: how many optimizer steps with a NaN/inf loss or gradient may be
    skipped (and counted) over the run before the stage stops; 0 stops at the first.
    ``checkpoint``: keep the optimizer state in checkpoints (default: ``checkpoint.optimizer``).
    """

    lr: PositiveFloat = 1e-5
    betas: Annotated[list[float], Field(min_length=2, max_length=2)] = [0.9, 0.999]
    weight_decay: NonNegFloat = 0.0
    eps: PositiveFloat = 1e-8
    grad_clip: PositiveFloat | None = 1.0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0
    total_steps: PositiveInt | None = None
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    skip_nonfinite: NonNegInt = 0
    checkpoint: bool | None = None


class TinyModelSpec(Strict):
    """A tiny random model built locally (character tokenizer), for demos and tests."""

    arch: Literal["llama", "gpt2"] = "llama"
    layers: PositiveInt = 2
    hidden: PositiveInt = 64
    heads: PositiveInt = 4
    max_positions: PositiveInt = 128
    seed: int | None = None


class ModelSpec(Strict):
    """A named model: where its initial weights come from, its head, whether it trains."""

    path: str | None = None
    from_: str | None = Field(default=None, alias="from")
    tiny: TinyModelSpec | None = None
    head: Literal["lm", "value"] = "lm"
    trainable: bool = False
    optimizer: OptimizerSpec = OptimizerSpec()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        sources = [k for k, v in (("path", self.path), ("from", self.from_),
                                  ("tiny", self.tiny)) if v is not None]
        if len(sources) != 1:
            got = " and ".join(sources) if sources else "none"
            raise ValueError(f"expected exactly one of 'path', 'from', 'tiny'; got {got}")
        return self


class DeepSpeedSpec(Strict):
    """DeepSpeed settings of a training stage (``backend: deepspeed``)."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    config: dict[str, Any] = {}


class StageSpec(Strict):
    """A named stage: its type, its model, its upstream stages, its parameters."""

    type: str
    model: str | None = None
    after: list[str] = []
    params: dict[str, Any] = {}
    retries: NonNegInt = 0
    backend: Literal["torch", "deepspeed"] = "torch"
    deepspeed: DeepSpeedSpec | None = None
    micro_batches: PositiveInt | None = None
    fuse: bool = True


class DataSpec(Strict):
    """Where prompts come from and how many make one iteration.

    ``prompts``: a JSONL file, a Parquet file or a saved HF ``datasets`` directory of
    records with ``prompt_field`` (text) or ``messages`` (chat turns); their other fields
    reach reward functions. ``chat_template``: ``auto`` renders ``messages`` records with
    the tokenizer's chat template, ``true`` renders every record (a plain prompt as one
    user turn) and needs a tokenizer with a template, ``false`` never renders."""

    prompts: str
    prompt_field: str = "prompt"
    batch_size: PositiveInt = 16
    samples_per_prompt: PositiveInt = 1
    micro_batches: PositiveInt = 2
    max_prompt_tokens: PositiveInt = 64
    shuffle: bool = True
    on_bad_prompt: Literal["error", "skip"] = "error"
    chat_template: Literal["auto", True, False] = "auto"


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


class AlgorithmSpec(Strict):
    """The RL algorithm: a preset ``name`` whose parts (advantage estimator, policy loss,
    reward scaling) can each be overridden, plus KL penalty, clipping and aggregation."""

    name: Literal["ppo", "grpo", "rloo", "dr_grpo"] = "ppo"
    advantage_estimator: str | None = None
    policy_loss: str = "ppo"
    scale_rewards: Literal["group", "batch", "none"] | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    kl_coef: NonNegFloat = 0.05
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_in: Literal["reward", "loss"] = "reward"
    clip_low: PositiveFloat = 0.2
    clip_high: PositiveFloat = 0.2
    dual_clip: Annotated[float, Field(gt=1)] | None = None
    value_clip: PositiveFloat | None = 0.2
    whiten_advantages: bool = True
    loss_agg: LossAgg = "token-mean"
    value_loss_agg: LossAgg = "token-mean"
    loss_scale_factor: PositiveFloat | None = None
    entropy_coef: NonNegFloat = 0.0

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
    def uses_critic(self) -> bool:
        """Whether the estimator reads a critic's values (GAE does; the group-relative
        estimators, REINFORCE++ and ReMax do not)."""
        return "values" in self.estimator_needs


class ClusterSpec(Strict):
    """The Dask cluster: an embedded LocalCluster (default) or an existing scheduler."""

    workers: PositiveInt = 2
    device: Literal["auto", "cpu", "cuda"] = "auto"
    address: str | None = None
    host: str = "127.0.0.1"
    dashboard_address: str = "127.0.0.1:8787"
    memory_limit: str = "auto"
    torch_threads: PositiveInt | None = None
    worker_timeout_s: PositiveFloat = 60.0
    max_restarts: NonNegInt = 3
    collective_timeout_s: PositiveFloat = 600.0


class CheckpointSpec(Strict):
    """When to checkpoint the trainable models (weights, optimizer state, versions).
    ``optimizer: false`` leaves the optimizer moments out (a third of the size with
    AdamW); a resume then restarts the optimizer (the learning-rate schedule goes on)."""

    every: NonNegInt = 5
    keep: NonNegInt = 2
    optimizer: bool = True


WorkerRef = str | NonNegInt | Annotated[list[NonNegInt], Field(min_length=1)]
"""Where something runs: a group's name, one worker index, or a list of worker indexes."""


class PlacementSpec(Strict):
    """How models and stages map onto the device workers (see ``rlhfflow plan``).

    ``strategy`` gives the defaults: ``auto`` (the default) lets the planner choose the
    fastest plan that fits (strategy, micro-batches, fusion, and on the embedded cluster
    workers and threads), predicted from ``profile`` or the analytic cost model;
    ``colocated`` puts every model on every worker, ``interleaved`` gives models
    exclusive worker groups, ``disaggregated`` runs generation on its own ``rollout``
    group (a shadow of the actor) and the rest on ``train``. ``groups`` names worker sets
    (indexes, or a fraction of the cluster); ``models`` and ``stages`` override the
    strategy with a group name or indexes.
    """

    strategy: Literal["auto", "colocated", "interleaved", "disaggregated"] = "auto"
    profile: str | None = None
    groups: dict[str, list[int] | float] = {}
    models: dict[str, WorkerRef] = {}
    stages: dict[str, WorkerRef] = {}

    @field_validator("groups")
    @classmethod
    def _group_sizes(cls, groups: dict[str, list[int] | float]) -> dict[str, Any]:
        for name, value in groups.items():
            bad = (not 0 < value < 1) if isinstance(value, float) else \
                (not value or any(i < 0 for i in value))
            if bad:
                raise ValueError(f"group {name!r}: expected a non-empty list of worker "
                                 f"indexes (0, 1, ...) or a fraction of the cluster between "
                                 f"0 and 1, got {value!r}")
        return groups


class OverlapSpec(Strict):
    """How much the scheduler may overlap (see ``rlhfflow plan``).

    ``max_staleness``: generation (and the actor's other inference, the behaviour
    log-probs) of iteration k may run up to N actor updates behind, i.e. before training
    on iterations k-N..k-1 finished; 0 is strictly on-policy. ``fuse``: run consecutive
    stages on the same workers as one task (micro-batch stages one per micro-batch,
    whole-batch stages such as ``advantages + train_actor`` one per iteration).
    ``sequential``: every stage waits for the whole previous stage and every iteration
    for the previous one (no streaming, fusion or overlap): the baseline the overlap is
    measured against.
    """

    max_staleness: NonNegInt = 0
    fuse: bool = True
    sequential: bool = False


class MlflowSpec(Strict):
    """Where per-iteration metrics go in MLflow: ``tracking_uri`` (default: MLflow's own,
    ``MLFLOW_TRACKING_URI`` or ``./mlruns``), the experiment (created if missing) and the
    run's name (default: the pipeline's name)."""

    tracking_uri: str | None = None
    experiment: str = "rlhfflow"
    run_name: str | None = None

    @model_validator(mode="after")
    def _installed(self) -> MlflowSpec:
        _need_package("mlflow", "mlflow")
        return self


class LoggingSpec(Strict):
    """Where per-iteration metrics go besides ``OUTPUT/metrics.jsonl``, under the names
    TRL and veRL users know (``reward``, ``kl``, ``completions/mean_length``,
    ``timing/STAGE``, ...). ``tensorboard``: a directory (relative to the pipeline file),
    or ``true`` for ``OUTPUT/tensorboard``."""

    tensorboard: str | bool = False
    mlflow: MlflowSpec | None = None

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: str | bool) -> str | bool:
        if value is not False:
            _need_package("tensorboard", "tensorboard")
        if value == "":
            raise ValueError("expected a directory or true/false, got ''")
        return value


def _need_package(module: str, extra: str) -> None:
    """A logging target whose package is missing is a mistake in the file, found before
    the run starts, not an ImportError at its first iteration."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"needs the {module!r} package, which is not installed: "
                         f"pip install 'rlhfflow[{extra}]'")


class PipelineSpec(Strict):
    """The whole pipeline file."""

    name: str | None = None
    seed: int = 0
    iterations: NonNegInt = 1
    output: str | None = None
    models: dict[str, ModelSpec] = {}
    stages: dict[str, StageSpec]
    data: DataSpec | None = None
    algorithm: AlgorithmSpec = AlgorithmSpec()
    cluster: ClusterSpec = ClusterSpec()
    placement: PlacementSpec = PlacementSpec()
    overlap: OverlapSpec = OverlapSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    logging: LoggingSpec = LoggingSpec()


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """Safe YAML (no object construction) that also reads ``1e-5`` as a float, as
    every user expects; YAML 1.1 alone would read it as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$"
               r"|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)
# ...but plain integers stay integers: the int resolver must be tried first.
_Loader.yaml_implicit_resolvers = {
    k: sorted(v, key=lambda r: r[0] != "tag:yaml.org,2002:int")
    for k, v in _Loader.yaml_implicit_resolvers.items()
}


def _check_duplicate_keys(loader: _Loader, node: yaml.MappingNode) -> None:
    """PyYAML keeps the last of two equal keys silently; in a pipeline that hides a whole
    stage or model, so it is an error (merge keys ``<<`` may repeat keys on purpose).

    Keys are compared by the value they load as, not their spelling: ``1`` and ``0x1``, or
    ``yes`` and ``true``, are one dict key and would overwrite each other just the same.
    """
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        value = key_node.value if key_node.tag == "tag:yaml.org,2002:str" else \
            loader.construct_object(key_node)
        key = value  # as a dict key: 1, 1.0 and true collide in Python too
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key_node.value!r} (first at line "
                f"{seen[key].line + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> typing.Iterator[dict]:
    _check_duplicate_keys(loader, node)
    yield from yaml.constructor.SafeConstructor.construct_yaml_map(loader, node)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)

_TYPE_NAMES = {"list": "a list", "str": "a string", "int": "a number", "float": "a number",
               "bool": "true/false"}


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: where, what, and the construct it was inside."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    tag = re.fullmatch(r"could not determine a constructor for the tag '(.*)'", problem)
    if tag:
        name = tag[1].replace("tag:yaml.org,2002:", "!!")
        return (f"{where}unsupported tag {name!r}; pipeline files hold plain data "
                f"(mappings, lists, strings, numbers)")
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark and mark and context_mark.line != mark.line:
        problem += (f" ({context} started at line {context_mark.line + 1}, "
                    f"column {context_mark.column + 1})")
    return where + problem


def read_yaml(file: Path) -> dict[str, Any]:
    """Read a YAML mapping safely; any problem is a one-line SpecError."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(file, "", "file not found") from None
    except IsADirectoryError:
        raise SpecError(file, "", "is a directory, expected a YAML file") from None
    except UnicodeDecodeError as exc:
        raise SpecError(file, "", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(file, "", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        raise SpecError(file, "", f"invalid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        raise SpecError(file, "", "the file is empty; expected a mapping with at least "
                                  "'stages'")
    if not isinstance(data, dict):
        got = _TYPE_NAMES.get(type(data).__name__, type(data).__name__)
        raise SpecError(file, "", f"expected a mapping of keys (name:, models:, stages:, ...) "
                                  f"at the top level, got {got}")
    return data


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``cluster.workers``) in a raw spec; used by CLI options."""
    data = dict(data)
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            child = node.get(key)
            child = dict(child) if isinstance(child, dict) else {}
            node[key] = child
            node = child
        node[last] = value
    return data


# --------------------------------------------------------------------------- errors


def key_path(loc: tuple[Any, ...]) -> str:
    """``('stages', 'reward', 'after', 0)`` -> ``stages.reward.after[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` when a close match exists, else ``""``."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that holds the key at ``loc`` (to suggest its fields)."""
    current: Any = root
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = next((f for n, f in current.model_fields.items()
                          if part in (n, f.alias)), None)
            if field is None:
                return None
            current = field.annotation
        elif isinstance(part, (str, int)):
            args = [a for a in typing.get_args(current) if a is not type(None)]
            current = args[-1] if args else None
        while typing.get_origin(current) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(current) if a is not type(None)]
            current = args[0] if args else None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _number_kind(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """``"an integer"`` or ``"a number"``: what the field at ``loc`` holds."""
    parent = _model_at(root, loc)
    field = next((f for n, f in parent.model_fields.items() if loc[-1] in (n, f.alias)),
                 None) if parent and loc else None
    annotation = field.annotation if field else None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return "an integer" if annotation is int else "a number"


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


def _describe(value: Any) -> str:
    text = repr(value)
    return (text[:40] + "...") if len(text) > 43 else text


def error_from_pydantic(file: Path, exc: ValidationError, root: type[BaseModel],
                        prefix: tuple[Any, ...] = ()) -> SpecError:
    """The first pydantic error as a one-line SpecError with a helpful message."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if p not in ("function-after",))
    kind, value = err["type"], err.get("input")
    ctx = err.get("ctx", {})
    if "[key]" in loc:  # a mapping key that is not a string, e.g. `5:`
        loc = loc[:loc.index("[key]") - 1]
        message = f"expected every key to be a string, got {_describe(value)}"
    elif kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        limit = ctx.get(name)
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        message = f"expected {_number_kind(root, loc)} {op} {limit}, got {_describe(value)}"
    elif kind in ("too_short", "too_long"):
        bound = (f"at least {ctx.get('min_length')}" if kind == "too_short"
                 else f"at most {ctx.get('max_length')}")
        message = f"expected {bound} items, got {ctx.get('actual_length')}: {_describe(value)}"
    elif kind == "extra_forbidden":
        parent = _model_at(root, loc)
        hint = did_you_mean(loc[-1], _field_names(parent)) if parent else ""
        allowed = f" (allowed: {', '.join(_field_names(parent))})" if parent and not hint else ""
        message = f"unknown key{hint}{allowed}"
    elif kind == "missing":
        message = "required key is missing"
    elif kind == "literal_error":
        expected = ctx.get("expected", "")
        message = f"expected one of {expected}, got {_describe(value)}"
    elif kind in ("int_type", "int_parsing", "int_from_float"):
        message = f"expected an integer, got {_describe(value)}"
    elif kind in ("float_type", "float_parsing"):
        message = f"expected a number, got {_describe(value)}"
    elif kind in ("bool_type", "bool_parsing"):
        message = f"expected true or false, got {_describe(value)}"
    elif kind in ("string_type",):
        message = f"expected a string, got {_describe(value)}"
    elif kind in ("dict_type", "model_type", "model_attributes_type"):
        message = f"expected a mapping, got {_describe(value)}"
    elif kind in ("list_type",):
        message = f"expected a list, got {_describe(value)}"
    elif kind == "value_error":
        message = str(ctx.get("error", err["msg"]))
    else:
        message = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {_describe(value)}"
    return SpecError(file, key_path(prefix + loc), message)


def parse_params(file: Path, stage: str, params_cls: type[StageParams],
                 raw: Mapping[str, Any]) -> StageParams:
    """Validate one stage's ``params`` against its stage type, strictly like the rest of
    the file (``max_new_tokens: "16"`` is a mistake, not 16)."""
    try:
        return params_cls.model_validate(dict(raw), strict=True)
    except ValidationError as exc:
        raise error_from_pydantic(file, exc, params_cls, ("stages", stage, "params")) from None


def parse_spec(file: Path, data: dict[str, Any]) -> PipelineSpec:
    """Raw YAML mapping -> PipelineSpec, or a one-line SpecError."""
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise error_from_pydantic(file, exc, PipelineSpec) from None
