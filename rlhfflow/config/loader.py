"""``load_pipeline``: read, validate and resolve a pipeline file into a ``Pipeline``.

Checks beyond the schema (``spec.py``): names, stage types and params, models and their
heads, ``after`` references and cycles, columns a stage reads that no upstream stage
writes, trainable models nobody trains, files that do not exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

import rlhfflow.stages  # noqa: F401  (importing it registers the built-in stage types)
from rlhfflow.config.checks import (
    check_attention,
    check_auxiliary_models,
    check_files,
    check_lora_targets,
    check_model_shapes,
    check_prompts,
    check_streaming,
    check_tokenizers,
    warn_lora_below_a_tiny_head,
    warn_slow_dtypes,
)
from rlhfflow.config.graph import SOURCE, CycleError, StageGraph, StageNode
from rlhfflow.config.pipeline import Pipeline
from rlhfflow.config.spec import (
    MODEL_NAME,
    STAGE_NAME,
    ModelSpec,
    PipelineSpec,
    StageSpec,
    parse_params,
    parse_spec,
)
from rlhfflow.config.yamlfile import apply_overrides, read_yaml
from rlhfflow.errors import SpecError, did_you_mean
from rlhfflow.sdk import (
    RUN_METRICS,
    SOURCE_COLUMNS,
    Column,
    IterationMetric,
    Stage,
    StageParams,
    StageTypeError,
    resolve_stage_type,
    stage_type_path,
)


def load_pipeline(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Pipeline:
    """Read and validate a pipeline file; raise ``SpecError`` (one line) on any mistake.

    ``overrides`` maps dotted keys to values (``{"cluster.workers": 1}``) and is applied
    before validation, so overridden values are checked like the rest.
    """
    file = Path(path)
    data = read_yaml(file)
    if overrides:
        data = apply_overrides(data, {k: v for k, v in overrides.items() if v is not None})
    _check_misplaced_keys(file, data)
    spec = parse_spec(file, data)
    _check_models(file, spec)
    params, classes = _check_stages(file, spec)
    params = _resolve_params(file, spec, params, classes)
    graph = _build_graph(file, spec, params, classes)
    pipeline = Pipeline(spec=spec, source=file.resolve(), params=params, graph=graph)
    _check_training(file, pipeline)
    check_files(file, pipeline)
    check_attention(file, pipeline)
    check_streaming(file, pipeline)
    check_auxiliary_models(file, pipeline)
    check_model_shapes(file, pipeline)
    check_lora_targets(file, pipeline)
    check_tokenizers(file, pipeline)
    pipeline = replace(pipeline, spec=_resolve_optimizers(file, pipeline))
    pipeline = replace(pipeline, prompts=check_prompts(file, pipeline))
    warn_slow_dtypes(file, pipeline)
    warn_lora_below_a_tiny_head(file, pipeline)
    return pipeline


def _keys(model: type[Any]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def _stage_class(block: Any) -> type[Stage] | None:
    """The stage class a raw mapping's ``type:`` names, or None (not a stage, or a type
    that does not resolve: the schema and ``_check_stages`` say so)."""
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        return None
    try:
        return resolve_stage_type(block["type"])
    except StageTypeError:
        return None


def _check_misplaced_keys(file: Path, data: Mapping[str, Any]) -> None:
    """Blocks dedented one level too far, said as such before the schema calls them
    unknown keys: a stage's params at stage level (or a ``params:`` block read as a stage
    named ``params``), a stage at the top level."""
    stages = data.get("stages")
    if isinstance(stages, Mapping):
        names = list(stages)
        for i, (name, block) in enumerate(stages.items()):
            if name == "params" and isinstance(block, Mapping) and "type" not in block and i:
                raise SpecError(file, "stages.params", f"reads as a stage named 'params'; the "
                                f"params of stage {names[i - 1]!r}? indent them under it")
            cls = _stage_class(block)
            if cls is None:
                continue
            for key in block:
                if key not in _keys(StageSpec) and key in _keys(cls.Params):
                    raise SpecError(file, f"stages.{name}.{key}", f"{key} is a param of stage "
                                    f"type {block['type']!r}; indent it under params:")
    for key, block in data.items():
        if key not in _keys(PipelineSpec) and _stage_class(block) is not None:
            raise SpecError(file, key, f"unknown key; a stage of type {block['type']!r}? "
                                       f"indent it under stages:")


def _check_models(file: Path, spec: PipelineSpec) -> None:
    for name, model in spec.models.items():
        if not MODEL_NAME.match(name):
            raise SpecError(file, f"models.{name}", "model names are letters, digits and "
                                                    "underscores, starting with a letter")
        if model.from_ is not None:
            if model.from_ not in spec.models:
                hint = did_you_mean(model.from_, spec.models)
                raise SpecError(file, f"models.{name}.from",
                                f"unknown model {model.from_!r}{hint}")
            source = spec.models[model.from_]
            if source.head == "value" and model.head == "lm":
                raise SpecError(file, f"models.{name}.from", f"cannot make an 'lm' model from "
                                f"{model.from_!r}, which has a value head")
        if model.lora is not None:
            _check_lora(file, name, model)
    if spec.overlap.sequential and spec.overlap.max_staleness:
        raise SpecError(file, "overlap.max_staleness", "a sequential run overlaps nothing: "
                        "set max_staleness to 0 or sequential to false")
    for name in spec.placement.models:
        if name not in spec.models:
            hint = did_you_mean(name, spec.models)
            raise SpecError(file, f"placement.models.{name}", f"unknown model {name!r}{hint}")
    for name in spec.placement.stages:
        if name not in spec.stages:
            hint = did_you_mean(name, spec.stages)
            raise SpecError(file, f"placement.stages.{name}", f"unknown stage {name!r}{hint}")
    for name in spec.models:  # `from:` chains must end somewhere
        seen = [name]
        while (nxt := spec.models[seen[-1]].from_) is not None:
            if nxt in seen:
                raise SpecError(file, f"models.{name}.from",
                                f"'from' cycle: {' -> '.join(seen + [nxt])}")
            seen.append(nxt)


def _check_lora(file: Path, name: str, model: ModelSpec) -> None:
    """LoRA trains adapters: only on a trainable model, and only with peft installed."""
    import importlib.util

    if not model.trainable:
        raise SpecError(file, f"models.{name}.lora", "LoRA adapters train: set trainable: true "
                        "(a frozen copy of a LoRA model is `from:` it, without lora)")
    if importlib.util.find_spec("peft") is None:
        raise SpecError(file, f"models.{name}.lora", "needs peft: pip install 'rlhfflow[lora]'")


def _check_stages(file: Path, spec: PipelineSpec
                  ) -> tuple[dict[str, StageParams], dict[str, type[Stage]]]:
    params: dict[str, StageParams] = {}
    classes: dict[str, type[Stage]] = {}
    if not spec.stages:
        raise SpecError(file, "stages", "expected at least one stage")
    for name, stage in spec.stages.items():
        where = f"stages.{name}"
        if not STAGE_NAME.match(name):
            raise SpecError(file, where, "stage names are lowercase letters, digits and "
                            "underscores, starting with a letter")
        if name == SOURCE:
            raise SpecError(file, where, f"the stage name {SOURCE!r} is reserved for the prompt "
                            "source; rename the stage")
        try:
            cls = classes[name] = resolve_stage_type(stage.type)
        except StageTypeError as exc:
            raise SpecError(file, f"{where}.type", str(exc)) from None
        if stage.model is None and cls.model_head is not None and not cls.model_optional:
            fitting = [m for m, model in spec.models.items() if model.head == cls.model_head]
            hint = (f"; models with that head: {', '.join(fitting)}" if fitting
                    else "; no model in 'models' has that head")
            raise SpecError(file, f"{where}.model", f"required key is missing: stage type "
                            f"{stage.type!r} needs a model with head {cls.model_head!r}{hint}")
        if stage.model is not None:
            if cls.model_head is None:
                raise SpecError(file, f"{where}.model",
                                f"stage type {stage.type!r} takes no model; remove the key")
            if stage.model not in spec.models:
                hint = did_you_mean(stage.model, spec.models)
                raise SpecError(file, f"{where}.model", f"unknown model {stage.model!r}{hint}")
            head = spec.models[stage.model].head
            if head != cls.model_head:
                raise SpecError(file, f"{where}.model", f"stage type {stage.type!r} needs a "
                                f"model with head {cls.model_head!r}; model {stage.model!r} "
                                f"has head {head!r}")
        for i, parent in enumerate(stage.after):
            if parent == name:
                raise SpecError(file, f"{where}.after[{i}]", "a stage cannot run after itself")
            if parent not in spec.stages:
                hint = did_you_mean(parent, spec.stages)
                raise SpecError(file, f"{where}.after[{i}]", f"unknown stage {parent!r}{hint}")
        if stage.backend != "torch" and (not cls.trains or cls.once):
            raise SpecError(file, f"{where}.backend", f"{stage.backend!r} trains in the loop: "
                            f"only train_actor and train_critic stages take it, not "
                            f"{stage.type!r}")
        if stage.deepspeed is not None and stage.backend != "deepspeed":
            raise SpecError(file, f"{where}.deepspeed", "DeepSpeed settings need "
                                                        "'backend: deepspeed' on the stage")
        if stage.micro_batches is not None and (cls.per_batch or cls.once):
            raise SpecError(file, f"{where}.micro_batches", f"stage type {stage.type!r} works "
                            f"on the whole batch; only micro-batch stages (generate, score, "
                            f"logprob, values) take micro_batches")
        params[name] = parse_params(file, name, cls.Params, stage.params)
        problem = _plugin_call(file, where, cls.check_params, params[name],
                               stage.model is not None, file.resolve().parent)
        if problem:
            raise SpecError(file, f"{where}.{problem[0]}", problem[1])
        if spec.cluster.address is None and spec.cluster.env_workers == 0 and \
                _plugin_call(file, where, cls.plan_hints, params[name]).env_on_pool:
            raise SpecError(file, f"{where}.params.env_placement",
                            "'pool' runs environment steps on the CPU pool, and the embedded "
                            "cluster has none: set cluster.env_workers (1 or more)")
    return params, classes


def _resolve_params(file: Path, spec: PipelineSpec, params: dict[str, StageParams],
                    classes: dict[str, type[Stage]]) -> dict[str, StageParams]:
    """Each stage's params with its ``auto`` choices settled (``Stage.resolve_params``),
    given what the other stages write."""
    written: dict[str, dict[str, list[str | None]]] = {}
    for name, stage in spec.stages.items():
        columns = _plugin_call(file, f"stages.{name}.type", classes[name].writes,
                               params[name], spec.algorithm, stage.model is not None)
        written[name] = {column: [stage.model] for column in columns} \
            if isinstance(columns, Mapping) else {}
    settled = {}
    for name, stage in spec.stages.items():
        writers: dict[str, tuple[str | None, ...]] = {}
        for other, columns in written.items():
            if other != name:
                for column, models in columns.items():
                    writers[column] = (*writers.get(column, ()), *models)
        settled[name] = _plugin_call(file, f"stages.{name}.params",
                                     classes[name].resolve_params, params[name],
                                     stage.model, writers)
        if not isinstance(settled[name], classes[name].Params):
            raise SpecError(file, f"stages.{name}.type",
                            f"{stage_type_path(classes[name])}.resolve_params() must "
                            f"return its Params, got {type(settled[name]).__name__}")
    return settled


def _plugin_call(file: Path, where: str, method: Any, *args: Any) -> Any:
    """Call a stage class's hook; a plugin's exception becomes a one-line SpecError."""
    try:
        return method(*args)
    except Exception as exc:  # noqa: BLE001  (plugin code: report it, never crash)
        owner = getattr(method, "__self__", None)
        path = stage_type_path(owner) if isinstance(owner, type) else "the stage type"
        text = str(exc).strip().splitlines()
        cause = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
        raise SpecError(file, where, f"{path}.{method.__name__}() raised {cause}") from None


def _stage_columns(file: Path, where: str, cls: type[Stage], params: StageParams,
                   algorithm: Any, has_model: bool) -> tuple[tuple[str, ...], dict[str, Column]]:
    """What a stage reads and writes, checked: a plugin that declares a column badly is
    stopped here, not when the buffer is created on the cluster."""
    reads = _plugin_call(file, where, cls.reads, params, algorithm, has_model)
    writes = _plugin_call(file, where, cls.writes, params, algorithm, has_model)
    path = stage_type_path(cls)
    if not isinstance(reads, tuple | list) or not all(isinstance(c, str) for c in reads):
        raise SpecError(file, where, f"{path}.reads() must return column names (str), "
                                     f"got {reads!r}")
    if not isinstance(writes, Mapping):
        raise SpecError(file, where, f"{path}.writes() must return a dict of column name "
                                     f"-> Column, got {type(writes).__name__}")
    for column, col in writes.items():
        problem = column_problem(column, col)
        if problem:
            raise SpecError(file, where, f"{path}.writes() declares column {column!r} "
                                         f"badly: {problem}")
    return tuple(reads), dict(writes)


def _stage_metrics(file: Path, stage: str, cls: type[Stage], params: StageParams,
                   declared: dict[str, str]) -> tuple[IterationMetric, ...]:
    """The figures a stage declares for the iteration's record, checked: a bad
    declaration, or a name another stage declares, is one line here, not a crash in the
    coordinator's record. ``declared`` (name -> stage) is updated."""
    where = f"stages.{stage}.type"
    metrics = _plugin_call(file, where, cls.iteration_metrics, params)
    path = stage_type_path(cls)
    if not isinstance(metrics, tuple | list) or \
            not all(isinstance(m, IterationMetric) for m in metrics):
        raise SpecError(file, where, f"{path}.iteration_metrics() must return a tuple of "
                                     f"rlhfflow.sdk.IterationMetric, got {metrics!r}")
    for m in metrics:
        if m.name in RUN_METRICS:
            raise SpecError(file, where, f"{path}.iteration_metrics() declares "
                            f"{m.name!r}, a figure the runtime computes itself; give it "
                            f"another name")
        if m.name in declared:
            raise SpecError(file, where, f"{path}.iteration_metrics() declares "
                            f"{m.name!r}, which stage {declared[m.name]!r} declares too")
        declared[m.name] = stage
    return tuple(metrics)


def column_problem(name: Any, col: Any) -> str | None:
    """Why ``name: col`` is not a column the experience buffer can store, or None."""
    if not isinstance(name, str) or not name.isidentifier():
        return "column names are letters, digits and underscores, not starting with a digit"
    if name in SOURCE_COLUMNS:
        return "the data source writes it"
    if not isinstance(col, Column):
        return f"expected rlhfflow.stages.Column, got {type(col).__name__}"
    if col.length not in (None, "prompt", "response"):
        return f"length must be 'prompt', 'response' or None, not {col.length!r}"
    if col.dtype == "str":
        return None if col.length is None else "a 'str' column holds one value per row"
    try:
        kind = np.dtype(col.dtype).kind
    except TypeError:
        kind = None
    if kind is None or kind not in "biuf":
        return f"dtype must be 'str' or a bool/int/float numpy dtype, not {col.dtype!r}"
    return None


def _build_graph(file: Path, spec: PipelineSpec, params: dict[str, StageParams],
                 classes: dict[str, type[Stage]]) -> StageGraph:
    nodes = {}
    samples = spec.data.samples_per_prompt if spec.data is not None else 1
    declared: dict[str, str] = {}  # metric name -> the stage declaring it
    for name, stage in spec.stages.items():
        cls = classes[name]
        reads, writes = _stage_columns(file, f"stages.{name}.type", cls, params[name],
                                       spec.algorithm, stage.model is not None)
        hints = _plugin_call(file, f"stages.{name}.params", cls.plan_hints, params[name])
        kept = hints.kept_per_prompt
        nodes[name] = StageNode(
            name=name, type=stage.type, model=stage.model, after=tuple(stage.after),
            reads=reads, writes=writes, trains=cls.trains, once=cls.once,
            per_batch=cls.per_batch, generates=cls.generates, scores=cls.scores,
            reports=cls.reports, samples=cls.samples or cls.generates,
            response_tokens=hints.response_tokens, temperature=hints.temperature,
            turns=hints.turns, env_on_pool=bool(hints.env_on_pool),
            impl=stage_type_path(cls),
            uses=tuple(dict.fromkeys(cls.auxiliary_models(params[name]).values())),
            row_filter=hints.row_filter,
            kept_share=1.0 if kept is None else min(kept, samples) / max(samples, 1),
            every=max(1, int(hints.every)), passes=float(hints.passes),
            streams=bool(hints.streams), reorders=bool(hints.reorders),
            metrics=_stage_metrics(file, name, cls, params[name], declared))
    try:
        graph = StageGraph(nodes)
    except CycleError as exc:
        raise SpecError(file, f"stages.{exc.cycle[0]}.after", f"the 'after' lists form a "
                        f"cycle: {' -> '.join(exc.cycle)}") from None
    for name in graph.order:
        node = graph.nodes[name]
        for i, parent in enumerate(node.after):
            if graph.nodes[parent].once is False and node.once:
                raise SpecError(file, f"stages.{name}.after[{i}]", f"stage type {node.type!r} "
                                f"runs once before the loop and cannot wait for loop stage "
                                f"{parent!r}")
        for column in node.reads:
            if graph.producer(column, name) is None:
                writers = graph.writers(column)
                hint = (f"; add stage {writers[0]!r} to stages.{name}.after" if writers
                        else "; no stage in the pipeline writes it")
                raise SpecError(file, f"stages.{name}", f"reads column {column!r}, which no "
                                f"upstream stage writes{hint}")
    for column in graph.columns():
        writers = [w for w in graph.writers(column) if not graph.nodes[w].once]
        if len(writers) > 1:
            raise SpecError(file, f"stages.{writers[1]}", f"writes column {column!r}, "
                            f"which stage {writers[0]!r} writes too")
    return graph


def _check_training(file: Path, pipeline: Pipeline) -> None:
    spec, graph = pipeline.spec, pipeline.graph
    for name, model in spec.models.items():
        trainers = graph.trainers(name)
        deepspeed = [t for t in trainers if spec.stages[t].backend == "deepspeed"]
        if model.dtype == "float16" and deepspeed:
            # our fp16 loss scaler wraps the torch optimizer step, which DeepSpeed replaces;
            # without scaling fp16 AdamW turned every weight to NaN (measured)
            raise SpecError(file, f"models.{name}.dtype", f"float16 training has no loss "
                            f"scaling under backend: deepspeed (stage {deepspeed[0]!r}); use "
                            f"bfloat16 or float32, or backend: torch")
        sharded = [t for t in trainers if spec.stages[t].backend == "fsdp"]
        if sharded and model.dtype == "float16":
            raise SpecError(file, f"models.{name}.dtype", f"float16 training has no loss "
                            f"scaling under backend: fsdp (stage {sharded[0]!r}); use "
                            f"bfloat16 or float32, or backend: torch")
        if model.trainable and not trainers:
            raise SpecError(file, f"models.{name}.trainable", "the model is trainable but no "
                            "stage trains it; add a training stage or set trainable: false")
        if trainers and not model.trainable:
            raise SpecError(file, f"stages.{trainers[0]}.model", f"stage trains {name!r}, which "
                            f"is not trainable; set models.{name}.trainable: true")
    for name in graph.loop_stages:  # a rollout's agent episodes own whole runs of rows
        per = int(getattr(pipeline.params[name], "agent_samples", 1))
        if per > 1 and spec.data is not None and spec.data.samples_per_prompt % per:
            raise SpecError(file, f"stages.{name}.params.agent_samples", f"each agent "
                            f"episode makes up to {per} samples of its prompt, and "
                            f"data.samples_per_prompt ({spec.data.samples_per_prompt}) is "
                            f"not a multiple of {per}")
    readers = [n for n in graph.loop_stages if "group_ids" in graph.nodes[n].reads]
    if readers and spec.data is not None and spec.data.samples_per_prompt == 1 \
            and spec.algorithm.grouped:
        raise SpecError(file, "data.samples_per_prompt", f"the {spec.algorithm.estimator!r} "
                        f"estimator compares the responses to one prompt: with 1 per prompt "
                        f"every advantage is 0 and nothing is learned (stage {readers[0]!r}); "
                        f"set samples_per_prompt to 2 or more (e.g. 8)")
    if graph.loop_stages and spec.data is None and spec.iterations > 0:
        raise SpecError(file, "data", "the pipeline has stages that run every iteration, "
                                      "so it needs a 'data' section with a prompts file")


class _TrainerParams(Protocol):
    """The params every training stage has: its passes over a batch."""

    epochs: int
    minibatches: int


def _trainer_params(params: StageParams) -> _TrainerParams:
    """``params`` of a stage that trains: its optimizer steps per iteration are counted from
    its ``epochs`` and ``minibatches``."""
    return cast(_TrainerParams, params)


def _resolve_optimizers(file: Path, pipeline: Pipeline) -> PipelineSpec:
    """The spec with each trainable model's ``optimizer.total_steps`` (for a decaying
    schedule) and ``optimizer.checkpoint`` filled in, so the workers need nothing else."""
    spec, graph = pipeline.spec, pipeline.graph
    models = dict(spec.models)
    for name, model in spec.models.items():
        if not model.trainable:
            continue
        opt = model.optimizer
        updates: dict[str, Any] = {}
        if opt.checkpoint is None:
            updates["checkpoint"] = spec.checkpoint.optimizer
        if opt.total_steps is None and opt.schedule != "constant":
            per_iteration = sum(
                _trainer_params(pipeline.params[t]).epochs
                * _trainer_params(pipeline.params[t]).minibatches
                for t in graph.trainers(name) if not graph.nodes[t].once)
            if per_iteration == 0 or spec.iterations == 0:
                raise SpecError(file, f"models.{name}.optimizer.total_steps", f"schedule "
                                f"{opt.schedule!r} needs total_steps: no loop stage trains "
                                f"{name!r}, so it cannot be derived from the iterations")
            updates["total_steps"] = spec.iterations * per_iteration
        if opt.total_steps is not None and opt.warmup_steps > opt.total_steps:
            raise SpecError(file, f"models.{name}.optimizer.warmup_steps", f"{opt.warmup_steps} "
                            f"warmup steps exceed total_steps={opt.total_steps}")
        if updates:
            models[name] = model.model_copy(update={"optimizer": opt.model_copy(update=updates)})
    return spec.model_copy(update={"models": models})

