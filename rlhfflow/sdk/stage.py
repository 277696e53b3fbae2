"""The stage SDK: what a stage is (``Stage``), what it is given (``StageContext``,
``RunSettings``) and what it declares (``StageParams``, ``Column``, ``PlanHints``,
``IterationMetric``).

A stage reads named columns of a batch (a ``dict`` of tensors with one row per sample),
computes, and returns new columns. It knows nothing of Dask: the executor decides where
and when it runs, and the same stage runs alone from Python::

    from rlhfflow.stages import create_stage, ModelStore, StageContext
    stage = create_stage("generate", params={"max_new_tokens": 8}, model="actor")
    out = stage.run(batch, StageContext(iteration=0, seed=0, models=store))

This module imports neither torch nor any built-in stage (a test keeps it so): a plugin
author's package depends on the SDK alone. The types it names from the engine
(``ModelStore``, ``Gang``) are for annotations only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from rlhfflow.types import Batch

if TYPE_CHECKING:
    from rlhfflow.engine.parallel import Gang
    from rlhfflow.engine.resident import ModelStore
    from rlhfflow.spec.algorithm import AlgorithmSpec


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

#: The columns a forward over the responses reads (log-probs, values, training).
RESPONSE_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


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
        iterations: the run's iterations (its last is ``iterations - 1``), or None
            outside a run.
    """

    temperature: float = 1.0
    base_dir: str = "."
    buffer: str | None = None
    device: str = "auto"
    rows_topic: str | None = None
    env_pool: str | None = None
    iterations: int | None = None

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
        ahead: for a stage that streams (``PlanHints.streams``), the source rows of the
            next iterations that its task in those iterations will get, as
            ``(iteration, batch)`` pairs (as many iterations as the run's
            ``max_staleness``, fewer at the end of the run): it may start their work
            early. Empty for every other stage.
        behind: for a stage that reorders rows (``PlanHints.reorders``), the source rows
            of the ``staleness`` iterations before, whose episodes its task may still owe:
            in a run that goes on they are under way on the worker already; after a
            resume or a recovery they start again from these.
        staleness: for a stage that reorders rows, the run's ``max_staleness``: an
            episode whose oldest token is that many versions behind the task's weights
            is taken now (trained later, it would be further behind).
        taken: for a stage that reorders rows, the episodes (``(iteration,
            prompt_index, sample_index)``) an earlier iteration took before the run went
            back to a checkpoint (read from the buffer): never played again.
        between_tasks: the runtime holds a stage's work between tasks while any task that
            writes a model's weights runs (``rlhfflow.engine.streaming.paused``), so a
            stage that streams may go on decoding when no task runs. False outside a
            run's worker (a stage run from Python or by ``stage test``).
    """

    iteration: int
    seed: int
    models: ModelStore | None = None
    algorithm: AlgorithmSpec | None = None
    settings: RunSettings = field(default_factory=RunSettings)
    gang: Gang | None = None
    peers: Any = None
    spans: Any = None
    env_executor: Any = None
    ahead: list[tuple[int, Batch]] = field(default_factory=list)
    behind: list[tuple[int, Batch]] = field(default_factory=list)
    staleness: int = 0
    taken: frozenset[tuple[int, int, int]] = frozenset()
    between_tasks: bool = False

    def __post_init__(self) -> None:
        self.settings = RunSettings.of(self.settings)


@dataclass(frozen=True)
class PlanHints:
    """What a stage tells the planner (and the runtime) beyond its columns, from its
    params (``Stage.plan_hints``).

    Attributes:
        response_tokens: a generator's most new tokens per response (the buffer's
            response width); 0 for a stage that generates nothing.
        temperature: a generator's sampling temperature, which the log-prob stages and
            training must score responses at.
        turns: a generator's model turns per response at most (a multi-turn ``rollout``'s
            ``max_turns``): each turn after the first adds a forward over the tokens
            that came between, which the cost model charges; 1 for a single response.
        env_on_pool: the stage's environment steps run as tasks of their own on the
            run's CPU pool (a ``rollout`` with ``env_placement: pool``): the planner then
            does not charge their time to the stage's model worker, and the pipeline
            needs a pool.
        every: the stage does its work in one iteration of this many (``evaluate``'s
            ``every``); the planner charges it that share of its cost per iteration.
        row_filter: the column whose nonzero rows the stage works on (a trainer that
            learns from the rows a selection marked), or None: every row. The planner
            costs such a stage on the share of rows the column's producer keeps.
        kept_per_prompt: for a stage that marks rows for others (``select``), the most
            of each prompt's samples it keeps; None for every other stage. The loader
            turns it into the share of a batch's rows kept (``StageNode.kept_share``).
        passes: the model work the stage does per token of the iteration, in forward
            passes: 1 for a forward (log-probs, values, a reward model, generation), 3
            per epoch for training (the backward costs about two forwards). What
            ``model_flops`` and MFU count (``rlhfflow.plan.flops``).
        streams: the stage keeps its work in flight across iterations (a ``rollout``
            with ``stream: true``): its tasks get the next iterations' rows
            (``StageContext.ahead``) up to ``overlap.max_staleness`` ahead, run in the
            iterations' order on fixed workers (micro-batch j always on the same one),
            and its model's other stages do not run ahead.
        reorders: a stage that streams and returns the episodes that finished first,
            not its own iteration's (a ``rollout`` with ``stream_order: finish``): its
            output rows carry their source columns, which every stage after it reads from
            it (``StageNode.reorders``), and its tasks get the rows of the
            ``max_staleness`` iterations before too (``StageContext.behind``).
    """

    response_tokens: int = 0
    temperature: float = 1.0
    turns: int = 1
    env_on_pool: bool = False
    every: int = 1
    row_filter: str | None = None
    kept_per_prompt: int | None = None
    passes: float = 1.0
    streams: bool = False
    reorders: bool = False


#: How an ``IterationMetric`` reduces its column (``IterationMetric.reduce``).
REDUCTIONS = ("mean", "sum", "ratio", "token_mean")

#: The figures of an iteration's record the runtime computes itself, which no stage may
#: declare: from the columns every pipeline has (``response_mask``) or a scorer writes
#: (``scores``, ``score_valid``, ``score_error``, ``score_retries``), the trainers'
#: statistics, the weight transfers and the task timings. (``kl_mean`` is the
#: ``advantages`` stage's, the trainer's where no stage declares it.)
RUN_METRICS = frozenset({
    "iteration", "samples", "samples_skipped", "reward_mean", "reward_std",
    "policy_loss", "value_loss", "clip_frac", "approx_kl", "clip_frac_lower", "lr",
    "response_length_mean", "tokens_generated", "staleness_mean", "staleness_max",
    "iteration_s", "stage_s", "overlap", "busy_frac", "memory_peak_mib", "realloc_bytes",
    "realloc_s", "score_errors", "score_retries", "task_retries", "model_flops", "model_flops_per_s",
    "mfu", "stage_flops", "matmul_peak_flops_per_s", "train"})


@dataclass(frozen=True)
class IterationMetric:
    """How a per-row column a stage writes becomes one figure of each iteration's record
    (``metrics.jsonl``, the live page, the trackers): ``Stage.iteration_metrics``.

    Every store task sums the columns over its rows; the coordinator adds the sums of
    the iteration's stores and then divides, so the figure is exact over all the
    iteration's rows whatever the micro-batches. A figure is in the record where the
    iteration's rows hold its columns; where the division has nothing to divide by it
    is None.

    Attributes:
        name: the key in the record (``env_reward_mean``).
        column: the per-row column reduced, one the stage writes.
        reduce: ``"mean"`` over the iteration's rows (or over those ``where`` selects);
            ``"sum"``; ``"ratio"``: the column's sum over ``over``'s sum;
            ``"token_mean"``: per token, the column (one value per response token)
            summed over the tokens the 0/1 mask ``over`` marks (``response_mask``),
            divided by their count. Sums are in float64, but a token mean's in the
            column's dtype.
        where: for ``"mean"``, a 0/1 column selecting the rows averaged (``score_valid``:
            the samples that were scored), or None: every row.
        over: the denominator of ``"ratio"``, the token mask of ``"token_mean"``.
        requires: a column whose sum must be nonzero for the figure to exist (None
            otherwise): accepted draft tokens per verification need a draft.
        digits: the decimals the figure is rounded to; 0 makes it a whole number (an
            int); None: not rounded.
    """

    name: str
    column: str
    reduce: Literal["mean", "sum", "ratio", "token_mean"] = "mean"
    where: str | None = None
    over: str | None = None
    requires: str | None = None
    digits: int | None = None

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"metric {self.name!r}: reduce must be one of "
                             f"{', '.join(REDUCTIONS)}, not {self.reduce!r}")
        if self.reduce in ("ratio", "token_mean") and self.over is None:
            raise ValueError(f"metric {self.name!r}: reduce {self.reduce!r} needs 'over'")
        if self.where is not None and self.reduce != "mean":
            raise ValueError(f"metric {self.name!r}: 'where' goes with reduce 'mean'")

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the figure needs in the iteration's rows."""
        return tuple(c for c in (self.column, self.where, self.over, self.requires)
                     if c is not None)


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
    #: how a training stage trains its model (``torch``, ``deepspeed``, ``fsdp``) and
    #: DeepSpeed's options: the stage's ``backend:`` and ``deepspeed:`` keys
    #: (``use_backend``)
    backend: str = "torch"
    deepspeed: Mapping[str, object] | None = None

    def __init__(self, name: str, params: StageParams | Mapping[str, Any] | None = None,
                 algorithm: Any = None, model: str | None = None) -> None:
        self.name = name
        self.model = model
        if not isinstance(params, StageParams):
            params = self.Params(**(params or {}))
        self.params = params
        self.algorithm = algorithm

    def use_backend(self, backend: str, deepspeed: Mapping[str, object] | None = None) -> None:
        """Train with ``backend`` and DeepSpeed's ``deepspeed`` options (the stage's keys
        of those names); ``create_stage`` calls it as the worker creates the stage, before
        its first task."""
        self.backend, self.deepspeed = backend, deepspeed

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
    def prompt_tools(cls, params: StageParams, tokenizer: Any, base_dir: Path
                     ) -> list[dict[str, object]] | None:
        """The tools a generator's prompts show the model: OpenAI function schemas
        given to the chat template as ``tools=`` when the prompts are rendered with it
        (the ``rollout`` stage's tools, when its model's template shows tools), or None.
        Asked of the pipeline's first generator."""
        return None

    @classmethod
    def auxiliary_models(cls, params: StageParams) -> dict[str, str]:
        """Models the stage uses besides its own (``{key: model name}``, e.g. a draft
        model under ``"params.draft_model"``). The loader checks each is an ``lm`` model
        with the same tokenizer as the stage's model."""
        return {}

    @classmethod
    def plan_hints(cls, params: StageParams) -> PlanHints:
        """What the planner and the runtime need to know of the stage beyond its
        columns (``PlanHints``); the defaults follow the class attributes and the
        params' ``max_new_tokens``, ``temperature`` and ``epochs`` where they exist.
        Override to change some, e.g. ``replace(super().plan_hints(params), turns=4)``."""
        return PlanHints(
            response_tokens=int(getattr(params, "max_new_tokens", 0)) if cls.generates else 0,
            temperature=float(getattr(params, "temperature", 1.0)),
            passes=3.0 * float(getattr(params, "epochs", 1)) if cls.trains else 1.0)

    @classmethod
    def iteration_metrics(cls, params: StageParams) -> tuple[IterationMetric, ...]:
        """The figures of each iteration's record that reduce the stage's per-row
        columns (``IterationMetric``), e.g. an environment's reward averaged over the
        iteration's episodes; none by default. The runtime computes them where the rows
        are stored and adds them to the record under their names, so a plugin stage's
        figure reaches ``metrics.jsonl``, the live page and the trackers."""
        return ()

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        """Compute the stage's columns for ``batch``. Returns only the new columns."""
        raise NotImplementedError
