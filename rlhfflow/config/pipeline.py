"""``Pipeline``: a validated pipeline file, as every later phase sees it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhfflow.config.graph import StageGraph
from rlhfflow.config.spec import PipelineSpec
from rlhfflow.sdk import StageParams, resolve_stage_type

if TYPE_CHECKING:
    from rlhfflow.data.source import PromptSource


@dataclass(frozen=True)
class Pipeline:
    """A validated pipeline: the spec, each stage's typed params, the graph, and paths
    resolved against the pipeline file's folder."""

    spec: PipelineSpec
    source: Path
    params: Mapping[str, StageParams]
    graph: StageGraph
    #: the prompts as validation read and tokenized them (``check_prompts``), which the
    #: run takes instead of reading them again when its pipeline asks for the same ones
    #: (``PromptSource.from_pipeline``'s ``kept``); None: not read
    prompts: PromptSource | None = field(default=None, compare=False, repr=False)

    @property
    def base_dir(self) -> Path:
        """Relative model and data paths are relative to the pipeline file's folder."""
        return self.source.parent

    @property
    def name(self) -> str:
        """The pipeline's name: ``name:`` or the file's stem."""
        return self.spec.name or self.source.stem

    def resolve(self, path: str) -> Path:
        """A path from the file, relative to the file's folder unless absolute."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else (self.base_dir / p).resolve()

    def model_dir(self, path: str) -> Path:
        """A model's ``path:`` on this machine: a directory relative to the file, or else,
        for a Hub id (``org/name[@revision]``), its snapshot in the local Hugging Face
        cache (``ModelNotCachedError`` when it is not there)."""
        from rlhfflow.engine.hub import hub_snapshot, is_hub_id

        local = self.resolve(path)
        return local if local.exists() or not is_hub_id(path) else hub_snapshot(path)

    def model_source(self, path: str) -> str:
        """What workers load for a model's ``path:``: the absolute directory, or the Hub
        id itself, which each worker finds in its own cache (a cluster's machines may keep
        theirs in other places)."""
        from rlhfflow.engine.hub import is_hub_id

        local = self.resolve(path)
        return str(local) if local.exists() or not is_hub_id(path) else path

    @property
    def output_dir(self) -> Path:
        """``output:`` (relative to the current directory), default ``runs/NAME``."""
        return Path(self.spec.output or f"runs/{self.name}").expanduser().resolve()

    @property
    def prompts_path(self) -> Path | None:
        """The prompts file, if the pipeline has a data section naming one (a path that
        does not exist where ``prompts`` is a Hub data set id)."""
        data = self.spec.data
        return self.resolve(data.prompts) if data and data.prompts else None

    def model_root(self, name: str) -> str:
        """The model whose initial weights ``name`` ends up copying through ``from:``."""
        seen = [name]
        while (source := self.spec.models[seen[-1]].from_) is not None:
            seen.append(source)
        return seen[-1]

    def trains_sharded(self, model: str) -> bool:
        """Whether a stage trains ``model`` sharded over its workers (``backend: fsdp``)."""
        return any(self.spec.stages[t].backend == "fsdp" for t in self.graph.trainers(model))

    def lora_base(self, name: str) -> str | None:
        """The LoRA model whose resident base weights frozen model ``name`` is (a
        reference ``from:`` it, with its head and dtype), or None: it has weights of its
        own."""
        model = self.spec.models[name]
        source = self.spec.models.get(model.from_) if model.from_ is not None else None
        if (source is None or source.lora is None or model.trainable
                or (model.head, model.dtype) != (source.head, source.dtype)):
            return None
        return model.from_

    def prompt_tools(self, tokenizer: Any) -> list[dict[str, object]] | None:
        """The tool schemas the prompts show the model through the chat template's
        ``tools=`` (``Stage.prompt_tools`` of the first generator), or None."""
        generates = self.graph.generators()
        if not generates:
            return None
        name = generates[0]
        cls = resolve_stage_type(self.spec.stages[name].type)
        return cls.prompt_tools(self.params[name], tokenizer, self.base_dir)

    @property
    def rollout_temperature(self) -> float:
        """The sampling temperature of the first generator (log-probs must match it)."""
        generates = self.graph.generators()
        return self.graph.nodes[generates[0]].temperature if generates else 1.0


def derive(pipeline: Pipeline, updates: Mapping[str, Any]) -> Pipeline:
    """``pipeline`` with dotted keys of its spec replaced (``{"cluster.workers": 1,
    "stages.values.micro_batches": 4}``), for settings that change where and how the
    stages run but not what they compute (placement, overlap, cluster, output): the
    params and graph are kept, nothing is revalidated (the prompts validation read too:
    ``PromptSource.from_pipeline`` reads them again if they no longer apply)."""
    spec = pipeline.spec
    for key, value in updates.items():
        spec = _set(spec, key.split("."), value)
    return replace(pipeline, spec=spec)


def _set(node: Any, path: list[str], value: Any) -> Any:
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        current = node[head]
        return {**node, head: _set(current, rest, value) if rest else value}
    current = getattr(node, head)
    return node.model_copy(update={head: _set(current, rest, value) if rest else value})
