"""Run one stage of a pipeline in process, on one iteration's batch (``rlhfflow stage
test``, like ``airflow tasks test``): no Dask, no buffer, nothing written but the tiny
models' initial weights.

The upstream stages the stage waits for run first, in process, in dependency order, on
the models' initial weights: iteration ``K`` picks the prompts and the seeds, not weights
trained for ``K`` iterations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfflow.config.loader import Pipeline
from rlhfflow.config.yamlfile import did_you_mean
from rlhfflow.data.source import PromptSource
from rlhfflow.engine.resident import ModelStore
from rlhfflow.errors import SpecError
from rlhfflow.runtime.models import model_configs
from rlhfflow.sdk import Batch, RunSettings, StageContext, create_stage


@dataclass
class StageTestResult:
    """What the stage wrote, which stages ran before it, and the batch's prompts."""

    stage: str
    iteration: int
    upstream: list[str]
    columns: Batch
    prompts: list[str] = field(default_factory=list)


def run_stage_alone(pipeline: Pipeline, stage: str, iteration: int, work_dir: Path
                    ) -> StageTestResult:
    """Run ``stage`` (and the stages it waits for) on ``iteration``'s batch in this
    process; tiny models are built under ``work_dir``. Raises ``SpecError`` for an
    unknown stage; the stage's own exceptions propagate."""
    graph = pipeline.graph
    if stage not in graph.nodes:
        raise SpecError(pipeline.source, "stages", f"no stage {stage!r}"
                        f"{did_you_mean(stage, graph.nodes)}")
    store = ModelStore(model_configs(pipeline, work_dir), device="cpu")
    spec = pipeline.spec
    node = graph.nodes[stage]
    ctx = StageContext(iteration=-1 if node.once else iteration, seed=spec.seed,
                       models=store, algorithm=spec.algorithm,
                       settings=RunSettings(temperature=pipeline.rollout_temperature,
                                            base_dir=str(pipeline.base_dir), device="cpu"))
    batch: Batch = {}
    if not node.once and spec.data is not None:
        model = graph.nodes[graph.generators()[0]].model if graph.generators() else None
        if model is not None:
            batch = PromptSource.from_pipeline(pipeline, model).batch(iteration)
    upstream = [n for n in graph.order if n in graph.upstream(stage)]
    for name in upstream + [stage]:
        batch.update(_run(pipeline, name, batch, ctx))
    out = {c: batch[c] for c in graph.nodes[stage].writes if c in batch}
    return StageTestResult(stage, iteration, upstream, out, list(batch.get("prompt_text", [])))


def _run(pipeline: Pipeline, name: str, batch: Batch, ctx: StageContext) -> Batch:
    node = pipeline.graph.nodes[name]
    stage = create_stage(node.impl or node.type, name, pipeline.params[name],
                         pipeline.spec.algorithm, node.model)
    step_ctx = StageContext(iteration=-1 if node.once else ctx.iteration, seed=ctx.seed,
                            models=ctx.models, algorithm=ctx.algorithm, settings=ctx.settings)
    return stage.run(dict(batch), step_ctx) or {}


def format_columns(result: StageTestResult) -> str:
    """The columns a stage wrote: dtype, shape and a glimpse of the values."""
    after = f"; ran first: {', '.join(result.upstream)}" if result.upstream else ""
    lines = [f"stage {result.stage} on iteration {result.iteration}{after}"]
    if not result.columns:
        lines.append("  (wrote no columns)")
    width = max((len(c) for c in result.columns), default=0)
    for name, value in result.columns.items():
        lines.append(f"  {name:<{width}}  {_describe(value)}")
    return "\n".join(lines) + "\n"


def format_episodes(result: StageTestResult, episodes: int = 3, width: int = 110) -> str:
    """The first ``episodes`` episodes of a multi-turn stage (its ``turns_json``) turn by
    turn, each under its prompt; "" for a stage that writes no episodes."""
    from rlhfflow.monitor.completions import conversation_lines, episode_turns
    from rlhfflow.monitor.report import shown_prompt

    cells = result.columns.get("turns_json")
    if not cells:
        return ""
    rewards = result.columns.get("env_reward")
    lines = [f"first {min(episodes, len(cells))} of {len(cells)} episodes, turn by turn:"]
    for row, cell in enumerate(cells[:episodes]):
        prompt = shown_prompt(result.prompts[row]) if row < len(result.prompts) else ""
        total = f", reward {float(rewards[row]):g}" if rewards is not None else ""
        turns = episode_turns(cell)
        said = sum(t.get("role") == "assistant" for t in turns)
        lines.append(f"  episode {row} ({said} model turns{total})")
        lines.append(f"    prompt: {prompt.replace(chr(10), ' ⏎ ')}"[:width])
        lines += ["    " + line for line in conversation_lines(turns, width - 4)]
    return "\n".join(lines) + "\n"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(d) for d in value.shape) or "scalar"
        head = f"{str(value.dtype).removeprefix('torch.')} [{shape}]"
        if value.numel() == 0:
            return head
        flat = value.detach().float()
        first = value[0].tolist() if value.dim() else value.item()
        if isinstance(first, list) and len(first) > 8:
            first = first[:8] + ["..."]
        return (f"{head}  mean {flat.mean().item():.4g} min {flat.min().item():.4g} "
                f"max {flat.max().item():.4g}  row 0: {first}")
    if isinstance(value, list):
        shown = repr(value[0])[:60] if value else ""
        return f"{len(value)} values  row 0: {shown}"
    return repr(value)[:80]
