"""The stage abstraction: a reusable unit with declared inputs, outputs and parameters.

A stage reads named columns of a batch (a ``dict`` of tensors with one row per sample),
computes, and returns new columns. It knows nothing of Dask: the executor decides where
and when it runs, and the same stage runs alone from Python::

    from rlhfflow.stages import create_stage, ModelStore, StageContext
    stage = create_stage("generate", params={"max_new_tokens": 8}, model="actor")
    out = stage.run(batch, StageContext(iteration=0, seed=0, models=store))

Stage types are found three ways, all through ``resolve_stage_type``: the built-ins
register themselves when ``rlhfflow.stages`` is imported (so they work even where the
package's metadata is stale), installed packages contribute types through the
``rlhfflow.stages`` entry-point group (the built-ins are declared there too), and a
pipeline may name any ``Stage`` subclass by import path (``mypkg.stages:CodeReward``).
Workers create stages by import path (``stage_type_path``), so a plugin type needs only
to be importable on the workers, not registered there.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from rlhfflow.engine.batch import Batch
from rlhfflow.engine.parallel import Gang
from rlhfflow.engine.resident import ModelStore
from rlhfflow.errors import UserError


class StageParams(BaseModel):
    """Base class of every stage's ``params``: strict, frozen, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Column:
    """A column a stage writes: dtype and per-row trailing shape.

    ``length`` is ``"prompt"``, ``"response"`` or ``None`` (one value per row); the
    executor resolves it to the prompt/response token length of the iteration.
    """

    dtype: str
    length: str | None = None


# Columns the data source provides for every row of every iteration.
SOURCE_COLUMNS: dict[str, Column] = {
    "prompt_ids": Column("int64", "prompt"),
    "prompt_mask": Column("int8", "prompt"),
    "prompt_index": Column("int64"),
    "sample_index": Column("int64"),
    "group_ids": Column("int64"),
    "prompt_text": Column("str"),
    # the record's other fields (answer, tests, ...) as a JSON object, for reward functions
    "prompt_fields": Column("str"),
}


@dataclass(frozen=True)
class RunSettings:
    """What the pipeline resolves for its stages, the same on every worker.

    Attributes:
        temperature: the rollout temperature; log-probs and training score responses at
            the temperature they were sampled with.
        base_dir: the pipeline file's directory: relative paths in params (a reward
            function's file, a data set) are resolved against it.
        buffer: the run's experience buffer (a stage may read earlier iterations), or
            None outside a run.
        device: ``cluster.device``: ``auto``, ``cpu`` or ``cuda``.
        rows_topic: the event topic of sample reallocation between the workers of a
            generating stage (``rlhfflow.runtime.worker.rebalance``), or None.
        env_pool: the Dask resource that marks the CPU pool's workers for environment
            steps (``env``), or None when the run has no pool.
    """

    temperature: float = 1.0
    base_dir: str = "."
    buffer: str | None = None
    device: str = "auto"
    rows_topic: str | None = None
    env_pool: str | None = None

    @classmethod
    def of(cls, settings: RunSettings | Mapping[str, Any] | None) -> RunSettings:
        """``settings`` as ``RunSettings`` (a mapping of its fields is accepted, as a
        stage's own tests write it)."""
        if isinstance(settings, RunSettings):
            return settings
        return cls(**dict(settings or {}))


@dataclass
class StageContext:
    """What a running stage may know about its surroundings.

    Attributes:
        iteration: the RLHF iteration (0-based); -1 for setup stages run once.
        seed: the pipeline seed; stages derive their randomness from it.
        models: where the stage finds resident models by name
            (``rlhfflow.engine.resident.ModelStore``).
        algorithm: the pipeline's algorithm settings (``AlgorithmSpec``), or None.
        settings: what the pipeline resolves for stages (``RunSettings``; a mapping of
            its fields is turned into one).
        gang: the data-parallel gang (``rlhfflow.engine.parallel.Gang``) a training stage
            runs in, or None when it trains alone.
        peers: for a generating stage that runs on several workers, the other workers
            it may hand rows to (``rlhfflow.runtime.worker.rebalance.RowExchange``: ``peer``,
            ``send``, ``gather``), or None. Stages stay Dask-free: they see this hook only.
        spans: ``spans(part, start, stop)`` records work of the task that ran beside its
            model (a rollout's environment steps; ``time.time()`` seconds) for the task
            timeline of the report, or None where nothing records them.
        env_executor: a ``concurrent.futures.Executor`` whose calls run in other
            processes, on the run's CPU pool for environment steps (``cluster.env_workers``),
            or None where the run has no pool. Stages stay Dask-free: they see only this.
    """

    iteration: int
    seed: int
    models: ModelStore | None = None
    algorithm: Any = None
    settings: RunSettings = field(default_factory=RunSettings)
    gang: Gang | None = None
    peers: Any = None
    spans: Any = None
    env_executor: Any = None

    def __post_init__(self) -> None:
        self.settings = RunSettings.of(self.settings)


class Stage:
    """Base class of stages. Subclasses set the class attributes and implement ``run``.

    Class attributes:
        type_name: the registry name used in YAML (``type: generate``).
        Params: the pydantic model of ``params``.
        model_head: the head the stage's model must have (``"lm"``, ``"value"``), or
            None when the stage takes no model; ``model_optional`` allows either.
        trains: whether the stage updates its model's weights.
        once: whether the stage runs once before the iteration loop (SFT, reward model).
        per_batch: whether the stage needs the whole batch at once (advantages,
            training) rather than one micro-batch at a time.
        generates: whether the stage samples responses from its (``lm``) model. The
            runtime asks this instead of the type's name: a generator defines the
            response length (``response_tokens``) and the sampling temperature the
            log-prob stages must match (``sampling_temperature``), its model's tokenizer
            encodes the prompts, it runs ahead under ``overlap.max_staleness``, and it
            goes to the rollout group when placement is disaggregated.
        scores: whether the stage is a scorer: it writes ``scores`` with reward functions
            that ``params.reward_functions()`` lists (entries with ``function`` and
            ``kwargs``) and may skip failing samples under ``params.on_error``. The loader
            checks that the prompt records carry the fields those functions take, and the
            coordinator keeps the run within the scorer's error budget (``max_errors``).
        reports: whether the stage returns metrics for the iteration's record (under
            their own names, e.g. ``eval/reward_mean``) instead of columns, as an
            evaluation does; a training stage's metrics go under ``train`` instead.
        samples: whether the stage decodes from its model for its own use (an
            evaluation, a greedy baseline) without being a generator; a generator
            samples too. Where it runs, a LoRA model holds its merged weights
            (``ResidentModel.generating``), which the planner's memory counts.
    """

    type_name: ClassVar[str] = ""
    Params: ClassVar[type[StageParams]] = StageParams
    model_head: ClassVar[str | None] = None
    model_optional: ClassVar[bool] = False
    trains: ClassVar[bool] = False
    once: ClassVar[bool] = False
    per_batch: ClassVar[bool] = False
    generates: ClassVar[bool] = False
    scores: ClassVar[bool] = False
    reports: ClassVar[bool] = False
    samples: ClassVar[bool] = False

    def __init__(self, name: str, params: StageParams | Mapping[str, Any] | None = None,
                 algorithm: Any = None, model: str | None = None) -> None:
        self.name = name
        self.model = model
        if not isinstance(params, StageParams):
            params = self.Params(**(params or {}))
        self.params = params
        self.algorithm = algorithm

    @classmethod
    def reads(cls, params: StageParams, algorithm: Any, has_model: bool) -> tuple[str, ...]:
        """Columns the stage needs from upstream stages (or the data source)."""
        return ()

    @classmethod
    def writes(cls, params: StageParams, algorithm: Any, has_model: bool) -> dict[str, Column]:
        """Columns the stage adds to the batch, with their dtypes and shapes."""
        return {}

    @classmethod
    def resolve_params(cls, params: StageParams, model: str | None,
                       writers: Mapping[str, tuple[str | None, ...]]) -> StageParams:
        """Settle params whose value depends on the rest of the pipeline (an ``auto``
        choice), before ``reads``/``writes`` are asked. ``model`` is the stage's model;
        ``writers`` maps each column the other stages write to the models of the stages
        writing it (None for a stage without one). Returns the params to run with."""
        return params

    @classmethod
    def check_params(cls, params: StageParams, has_model: bool, base_dir: Path
                     ) -> tuple[str, str] | None:
        """Checks that need more than the params schema (files, imports, the model).

        Returns ``(key, message)`` for the first problem (``key`` relative to the stage,
        e.g. ``"params.function"``), or None.
        """
        return None

    @classmethod
    def check_model(cls, params: StageParams, shape: Mapping[str, int]
                    ) -> tuple[str, str] | None:
        """Checks of the params against the stage model's shape: ``layers`` (decoder
        layers) and ``positions``, where the loader knows them (``tiny:`` or the model's
        config.json). ``(key, message)`` for the first problem, or None."""
        return None

    @classmethod
    def check_tokenizer(cls, params: StageParams, tokenizer: Any, base_dir: Path
                        ) -> tuple[str, str] | None:
        """Checks of the params against the stage model's tokenizer (its chat template),
        made at validation when prompts may be rendered with the template; the loader
        loads the tokenizer only for stage types that override this. ``(key, message)``
        for the first problem, or None."""
        return None

    @classmethod
    def auxiliary_models(cls, params: StageParams) -> dict[str, str]:
        """Models the stage uses besides its own (``{key: model name}``, e.g. a draft
        model under ``"params.draft_model"``). The loader checks each is an ``lm`` model
        with the same tokenizer as the stage's model."""
        return {}

    @classmethod
    def response_tokens(cls, params: StageParams) -> int:
        """A generator's most new tokens per response (``params.max_new_tokens`` unless
        overridden); 0 for a stage that generates nothing."""
        return int(getattr(params, "max_new_tokens", 0)) if cls.generates else 0

    @classmethod
    def model_turns(cls, params: StageParams) -> int:
        """A generator's model turns per response at most (a multi-turn ``rollout``'s
        ``max_turns``): each turn after the first adds a forward over the tokens that came
        between (the planner's cost model charges them); 1 for a single response."""
        return 1

    @classmethod
    def env_on_pool(cls, params: StageParams) -> bool:
        """Whether the stage's environment steps run as tasks of their own on the run's
        CPU pool (a ``rollout`` with ``env_placement: pool``): the planner then does not
        charge their time to the stage's model worker, and the pipeline needs a pool."""
        return False

    @classmethod
    def runs_every(cls, params: StageParams) -> int:
        """The stage does its work in one iteration of this many (``evaluate``'s
        ``every``); the planner charges it that share of its cost per iteration."""
        return 1

    @classmethod
    def row_filter(cls, params: StageParams) -> str | None:
        """The column whose nonzero rows the stage works on (a trainer that learns from
        the rows a selection marked), or None: every row. The planner costs such a stage
        on the share of rows the column's producer keeps (``kept_share``)."""
        return None

    @classmethod
    def kept_share(cls, params: StageParams, samples_per_prompt: int) -> float:
        """For a stage that marks rows for others (``select``): the most of a batch's
        rows it keeps, as a share; 1 for every other stage."""
        return 1.0

    @classmethod
    def model_passes(cls, params: StageParams) -> float:
        """The model work the stage does per token of the iteration, in forward passes:
        1 for a forward (log-probs, values, a reward model, generation: a prefill and one
        step per new token), 3 per epoch for training (the backward pass costs about two
        forwards). What ``model_flops`` and MFU count (``rlhfflow.plan.flops``)."""
        return 3.0 * float(getattr(params, "epochs", 1)) if cls.trains else 1.0

    @classmethod
    def sampling_temperature(cls, params: StageParams) -> float:
        """A generator's sampling temperature (``params.temperature``, default 1)."""
        return float(getattr(params, "temperature", 1.0))

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        """Compute the stage's columns for ``batch``. Returns only the new columns."""
        raise NotImplementedError


STAGE_TYPES: dict[str, type[Stage]] = {}
"""Registered stage types by name: the built-ins and the installed plugins that loaded."""

ENTRY_POINT_GROUP = "rlhfflow.stages"
BROKEN_PLUGINS: dict[str, str] = {}
"""Entry-point names whose plugin failed to load, with the cause (one line)."""
PLUGIN_SOURCES: dict[str, str] = {}
"""Registered name -> the distribution that declared it (``rlhfflow`` for built-ins)."""

_plugins_loaded = False
_plugins_lock = threading.Lock()


class StageTypeError(UserError, ValueError):
    """A stage type that cannot be used: unknown, not importable, or not a ``Stage``."""


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Class decorator: make a stage type available to pipelines by its ``type_name``."""
    if not cls.type_name:
        raise ValueError(f"{cls.__name__} has no type_name")
    if cls.type_name in STAGE_TYPES and STAGE_TYPES[cls.type_name] is not cls:
        raise ValueError(f"stage type {cls.type_name!r} is registered twice")
    STAGE_TYPES[cls.type_name] = cls
    # a plugin may register by decorator too; only our own modules are "built-in"
    PLUGIN_SOURCES.setdefault(cls.type_name, cls.__module__.partition(".")[0])
    return cls


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_plugins() -> None:
    """Register the stage types of the ``rlhfflow.stages`` entry-point group (once).

    A plugin that fails to import, or names something that is not a ``Stage``, is kept
    in ``BROKEN_PLUGINS`` with its cause instead of raising, so one broken package does
    not hide the other types; a pipeline that uses it gets that cause as its error.
    """
    global _plugins_loaded
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            try:
                cls = ep.load()
            except Exception as exc:  # noqa: BLE001  (any import error is the plugin's)
                BROKEN_PLUGINS[ep.name] = f"{ep.value} ({dist}) failed to import: " \
                                          f"{_one_line(exc)}"
                continue
            if not (isinstance(cls, type) and issubclass(cls, Stage)):
                BROKEN_PLUGINS[ep.name] = f"{ep.value} ({dist}) is not a Stage subclass"
                continue
            existing = STAGE_TYPES.get(ep.name)
            if existing is cls and PLUGIN_SOURCES.get(ep.name) != "rlhfflow":
                PLUGIN_SOURCES[ep.name] = dist  # registered on import, declared here too
            if existing is not None and existing is not cls:
                # stale metadata of an editable install can point at the same class by
                # another route; only a different class under one name is a conflict
                if stage_type_path(existing) != stage_type_path(cls):
                    BROKEN_PLUGINS[ep.name] = (f"{ep.value} ({dist}) clashes with "
                                               f"{stage_type_path(existing)}, registered "
                                               f"under the same name")
                continue
            STAGE_TYPES[ep.name] = cls
            PLUGIN_SOURCES[ep.name] = dist


def known_stage_types() -> dict[str, type[Stage]]:
    """Every registered stage type (built-ins and installed plugins), by name."""
    load_plugins()
    return dict(STAGE_TYPES)


def stage_type_path(cls: type[Stage]) -> str:
    """The import path ``module:Class`` that workers use to create a stage of ``cls``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_stage_type(ref: str) -> type[Stage]:
    """The stage class ``ref`` names: a registered name (built-in or entry point) or an
    import path ``package.module:Class``. ``StageTypeError`` (one line) otherwise."""
    if ":" in ref:
        return _import_stage(ref)
    if ref in STAGE_TYPES:  # a built-in (or loaded) type: no need to import every plugin
        return STAGE_TYPES[ref]
    load_plugins()
    if ref in STAGE_TYPES:
        return STAGE_TYPES[ref]
    if ref in BROKEN_PLUGINS:
        raise StageTypeError(f"plugin stage type {ref!r}: {BROKEN_PLUGINS[ref]}")
    match = difflib.get_close_matches(ref, list(STAGE_TYPES), n=1, cutoff=0.6)
    hint = (f"; did you mean {match[0]!r}?" if match
            else f"; known: {', '.join(sorted(STAGE_TYPES))}")
    raise StageTypeError(f"unknown stage type {ref!r}{hint}")


def _import_stage(ref: str) -> type[Stage]:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise StageTypeError(f"expected a registered name or 'package.module:Class', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001  (a plugin's import error is reported, not raised)
        raise StageTypeError(f"cannot import module {module_name!r}: {_one_line(exc)}") \
            from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise StageTypeError(f"module {module_name!r} has no {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, Stage)):
        raise StageTypeError(f"{ref!r} is not a subclass of rlhfflow.stages.Stage")
    return obj


def get_stage_type(type_name: str) -> type[Stage]:
    """The stage class ``type_name`` names (see ``resolve_stage_type``); KeyError if none."""
    try:
        return resolve_stage_type(type_name)
    except StageTypeError as exc:
        raise KeyError(str(exc)) from None


def create_stage(type_name: str, name: str | None = None,
                 params: Mapping[str, Any] | None = None, algorithm: Any = None,
                 model: str | None = None) -> Stage:
    """Instantiate a stage by registered name or import path, validating ``params``."""
    cls = get_stage_type(type_name)
    return cls(name or cls.type_name or type_name, params, algorithm, model)
