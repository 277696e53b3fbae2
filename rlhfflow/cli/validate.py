"""``rlhfflow validate FILE``: check a pipeline file and summarise it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from rlhfflow.cli.common import (
    OVERRIDES_ARGUMENT,
    SET_OPTION,
    load,
    parse_sets,
    pipeline_errors,
    table,
)

if TYPE_CHECKING:
    from rlhfflow.config.loader import Pipeline


def _model_source(pipeline: Pipeline, spec: Any) -> str:
    if spec.path is not None:
        return f"path {pipeline.model_dir(spec.path)}"
    if spec.from_ is not None:
        return f"from {spec.from_}"
    tiny = spec.tiny
    return f"tiny {tiny.arch} ({tiny.layers} layers, hidden {tiny.hidden})"


def _training(pipeline: Pipeline, name: str, spec: Any) -> str:
    if spec.lora is not None:
        return f"trainable (LoRA r={spec.lora.r})"
    if pipeline.lora_base(name) is not None:
        return f"frozen ({spec.from_}'s base, no copy)"
    return "trainable" if spec.trainable else "frozen"


def summary(pipeline: Pipeline) -> str:
    """A short description of a validated pipeline, for ``rlhfflow validate``."""
    spec, graph = pipeline.spec, pipeline.graph
    lines = [f"{pipeline.source}: valid", f"name: {pipeline.name}"]
    if spec.models:
        lines.append("models:")
        lines += table([(name, m.head, _training(pipeline, name, m),
                          _model_source(pipeline, m)) for name, m in spec.models.items()])
    lines.append("stages (in order):")
    lines += table([(name, graph.nodes[name].type, f"@{graph.nodes[name].model}"
                      if graph.nodes[name].model else "-",
                      "once, before the loop" if graph.nodes[name].once else "")
                     for name in graph.order])
    lines.append(f"iterations: {spec.iterations}")
    if spec.data is not None:
        data = spec.data
        local = pipeline.prompts_path
        what = (str(local) if local is not None and local.exists() else data.prompts) \
            if data.prompts else ", ".join(f"{s.prompts} (weight {s.weight:g})"
                                           for s in data.sources)
        lines.append(f"data: {what}, {data.batch_size} prompts x "
                     f"{data.samples_per_prompt} samples per prompt = "
                     f"{data.batch_size * data.samples_per_prompt} rows per iteration")
    cluster = spec.cluster
    lines.append(f"cluster: scheduler {cluster.address}" if cluster.address else
                 f"cluster: {cluster.workers} local workers (device {cluster.device})" +
                 (f" and {cluster.env_workers} for environment steps" if cluster.env_workers
                  else ""))
    lines.append(f"output: {pipeline.output_dir}")
    return "\n".join(lines)


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@OVERRIDES_ARGUMENT
@SET_OPTION
def validate(file: str, overrides: tuple[str, ...], sets: tuple[str, ...]) -> None:
    """Check a pipeline FILE and print a summary of it.

    Exits 0 when the file is valid. Otherwise prints one line naming the file,
    the key and what was expected, and exits 2. KEY=VALUE arguments after FILE
    override keys of the file, like --set. With 'cluster.memory_limit' set, the
    plan must fit it, as 'rlhfflow run' checks before starting a cluster (under
    strategy auto: some plan, sharded or checkpointed ones included).

    \b
    Example:
      rlhfflow validate configs/ppo-tiny.yaml
      rlhfflow validate configs/grpo-tiny.yaml algorithm.kl_coef=0.1
    """
    pipeline = load(file, parse_sets(sets, overrides))
    check_memory(pipeline)
    click.echo(summary(pipeline))


def check_memory(pipeline: Pipeline) -> None:
    """Refuse (one line, exit 2) a pipeline that no plan fits in its
    ``cluster.memory_limit``, planned as ``rlhfflow run`` plans it (on the GPUs there
    are, for a GPU run under ``auto``); nothing is started."""
    spec = pipeline.spec
    if spec.cluster.memory_limit in ("auto", "0", 0) or spec.data is None:
        return
    from rlhfflow.plan.auto.planner import check_fits, load_profile

    workers = None
    if spec.placement.strategy == "auto" and spec.cluster.device != "cpu":
        from rlhfflow.runtime.cluster import cuda_count

        gpus = cuda_count()
        workers = min(spec.cluster.workers, gpus) if gpus else None
    with pipeline_errors():
        check_fits(pipeline, load_profile(pipeline, quiet=True), workers)
