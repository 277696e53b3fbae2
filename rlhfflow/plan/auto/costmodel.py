"""The planner's cost model: how long a task takes and how much memory a plan needs.

Two sources, the second refining the first:

- an **analytic model** from the work itself: floating-point operations of the forward
  and backward passes (parameters x tokens; with gradient checkpointing, the decoder
  layers' forward once more in the backward), per-step and per-layer overheads of
  generation, optimizer steps, all-reduces (ring, ``2 (n-1)/n`` of the gradient bytes),
  and Dask's per-task latency and transfer bandwidth; its constants describe a device
  (CPU core or GPU) and are measured by ``rlhfflow profile``; a rollout's environment
  steps, which no FLOP count sees, are added by ``envtime``;
- a **profile** of the pipeline's own stages: task intervals (stage, rows, threads,
  gang size, seconds) recorded by real runs (``OUTPUT/tasks.jsonl``). Where a stage was
  measured, its time is fitted as ``a + b * rows`` per thread count; where it was not
  (another thread count, gang size or row count), the analytic model's shape is scaled
  by the measured ratio.

A profile records the machine and the model shapes it was measured on; a profile of
other shapes is ignored with a warning (the analytic model is used), and a file that is
not a profile is a one-line ``ProfileError``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhfflow.config.shapes import ModelShape, model_shapes
from rlhfflow.errors import UserError
from rlhfflow.plan.auto import envtime
from rlhfflow.plan.auto.memory import (
    WORKER_PROCESS,
    rank_saves,
    train_task_bytes,
    trainer_state,
)

if TYPE_CHECKING:
    from rlhfflow.config.pipeline import Pipeline
    from rlhfflow.plan.placement import ExecutionPlan

FORMAT = "rlhfflow-profile/1"

# Analytic constants of one CPU core, fitted to the stages of configs/grpo-tiny, ppo-tiny,
# remax-tiny and grpo-small measured under every layout of the 2-core development machines
# (``python benchmarks/calibrate.py``; refitted when forward passes began to run each
# distinct prompt once and responses cut to their length, median error of a task 39%
# before, 15% after; again when layouts leaving a core to the coordinator were measured
# apart, fitting ``contention``: median 18%; and again when Llama models got the lean
# forward (``rlhfflow.engine.lean``), which took a third off the small ops of the tiny
# models: the old constants' median error had grown to 36% and worst to 223%, the refit's
# are 13% and 109%). The machine's noise between two profiles of 4 iterations is of the
# order of the median. Responses are counted at ``max_new_tokens``; their measured work is
# less (rows ending at EOS run cut to their length), which these constants absorb on
# average. ``rlhfflow profile`` measures the machine's own.
CPU_DEVICE = {
    "flops_per_s": 5.56e10,      # dense matmul throughput of one thread
    "thread_efficiency": 0.917,  # share of a task's work that scales with threads
    "step_s": 0.0,               # per forward call besides its layers (wrappers, masks)
    "layer_s": 4.06e-4,          # per layer per forward (small ops, Python, kernel launches)
    "row_step_s": 5.77e-5,       # per row of a decoding step (sampling, bookkeeping)
    "train_step_s": 0.00848,     # per optimizer step: loss, clipping, AdamW's Python
    "train_factor": 2.11,        # a training step's work / a forward's (backward ~2x)
    "task_s": 2.92e-3,           # per task of a stage with a model (batch plumbing)
    "light_s": 3.0e-4,           # per task of a model-free stage (rewards, advantages)
    "light_token_s": 2.5e-7,     # ... per token of its rows (Python per row, tensor ops)
    "latency_s": 6.0e-3,         # Dask: from a task's end to its dependent's start
    "bytes_per_s": 5.0e8,        # Dask transfers between workers
    "allreduce_bytes_per_s": 3.0e8,
    "allreduce_latency_s": 2.0e-3,
    "finish_s": 0.03,            # coordinator: commit, gather, log one iteration
    "checkpoint_s": 5.0e-3,      # saving a model and its optimizer: per checkpoint task
    "save_bytes_per_s": 2.0e9,   # ... per byte of weights, gradients-sized moments
    "contention": 0.113,         # a task's slowdown when the workers' threads fill every
                                 # core: the coordinator (scheduler, client) runs on them
}


class ProfileError(UserError):
    """A profile file that cannot be used: one line naming the file and the problem."""


@dataclass(frozen=True)
class Observation:
    """One measured task: a stage on a batch of ``rows`` rows, ``threads`` torch threads,
    as one rank of a gang of ``gang`` (1: alone), took ``seconds``, on an embedded
    cluster, while ``workers`` workers were busy as it started, itself included (what
    decides whether it shared its cores with the coordinator; 0: not recorded, profiles
    made before it was; profiles made before it counted busy workers hold the
    cluster's). ``tokens``: the mean response length of its iteration (0: not
    recorded). Recorded, not yet used: measured on grpo-small, stage times grew with it
    far less than the analytic model's dependence on it, and costing a profile at
    ``max_new_tokens`` that way over-predicted by 13-25%. ``env``: the seconds of the
    task in which its environment stepped in its own process (a rollout's ``STAGE/env``
    spans), which a stage whose steps go to the CPU pool does not spend on its model
    worker."""

    stage: str
    rows: int
    threads: int
    gang: int
    seconds: float
    workers: int = 0
    tokens: float = 0.0
    env: float = 0.0


@dataclass
class Profile:
    """Measured costs of one pipeline's stages on one machine."""

    pipeline: str
    machine: dict[str, Any]
    shapes: dict[str, dict[str, int]]
    device: dict[str, float] = field(default_factory=lambda: dict(CPU_DEVICE))
    observations: list[Observation] = field(default_factory=list)

    def save(self, path: Path) -> None:
        """Write the profile as JSON (atomically)."""
        data = {"format": FORMAT, "pipeline": self.pipeline, "machine": self.machine,
                "shapes": self.shapes, "device": self.device,
                "observations": [asdict(o) for o in self.observations]}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Profile:
        """Read a profile; anything else is a ``ProfileError``."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ProfileError(f"{path}: profile file not found (make one with "
                               f"`rlhfflow profile PIPELINE`)") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ProfileError(f"{path}: not a readable profile ({_first_line(exc)})"
                               ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f"{path}: not an rlhfflow profile (expected \"format\": "
                               f"\"{FORMAT}\")")
        try:
            observations = [Observation(str(o["stage"]), int(o["rows"]), int(o["threads"]),
                                        int(o["gang"]), float(o["seconds"]),
                                        int(o.get("workers", 0)), float(o.get("tokens", 0)),
                                        float(o.get("env", 0)))
                            for o in data["observations"]]
            device = {**CPU_DEVICE, **{k: float(v) for k, v in data["device"].items()}}
            return cls(str(data["pipeline"]), dict(data["machine"]),
                       {m: dict(s) for m, s in data["shapes"].items()}, device, observations)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{path}: malformed profile ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def machine_info() -> dict[str, Any]:
    """The machine a profile is measured on: CPU model, cores, accelerator, torch."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    memory = torch.cuda.get_device_properties(0).total_memory if gpu else None
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "gpu": gpu, "gpu_memory": memory,
            "torch": torch.__version__, "system": platform.system()}


def prompt_tokens(pipeline: Pipeline) -> int:
    """How many prompt tokens a batch carries (it is left-padded to its longest prompt):
    the longest prompt of the file as the run will tokenize it, else
    ``data.max_prompt_tokens``."""
    data = pipeline.spec.data
    if data is None:
        return 0
    generators = pipeline.graph.generators()
    if not generators:
        return data.max_prompt_tokens
    try:
        from rlhfflow.data.source import PromptSource

        source = PromptSource.from_pipeline(pipeline, pipeline.graph.model_of(generators[0]),
                                            kept=pipeline.prompts)
        if source.token_ids:
            return max(len(ids) for ids in source.token_ids)
    except Exception:  # noqa: BLE001 - an estimate: the run reports a bad file itself
        pass
    return data.max_prompt_tokens


class CostModel:
    """Task durations and memory of a pipeline's plans.

    ``profile`` (optional) refines the analytic model with measured stage times; one
    whose model shapes differ from the pipeline's is ignored (``warning`` says why).
    ``cores``: of the machine the cluster runs on (default: the profile's, else this
    one's), which decides where workers share cores with the coordinator.
    """

    def __init__(self, pipeline: Pipeline, profile: Profile | None = None,
                 shapes: Mapping[str, ModelShape] | None = None,
                 cores: int | None = None) -> None:
        self.pipeline = pipeline
        self.graph = pipeline.graph
        self.shapes = dict(shapes) if shapes is not None else model_shapes(pipeline)
        self.warning: str | None = None
        self.device = dict(CPU_DEVICE)
        self.cores = int(cores or (profile.machine.get("cores") if profile else None)
                         or os.cpu_count() or 1)
        self.gpu = bool(profile and profile.machine.get("gpu"))  # workers on GPUs
        # per (stage, threads, gang, contended; None: not known, profiles made before)
        self._fits: dict[tuple[str, int, int, bool | None], tuple[float, float]] = {}
        self._ratios: dict[str, list[float]] = defaultdict(list)
        self._env_step: dict[str, float] = {}  # per rollout stage, measured (_fit)
        self.prompt_tokens = prompt_tokens(pipeline)
        self.response_tokens = self.graph.response_tokens
        if profile is not None:
            self.device.update(profile.device)
            mismatch = self._shape_mismatch(profile)
            if mismatch:
                self.warning = (f"the profile was measured on other model shapes "
                                f"({mismatch}); using the analytic cost model")
            else:
                self._fit(profile.observations)
        self.profiled = profile is not None and self.warning is None

    def unmeasured(self) -> list[str]:
        """The loop stages with a model that the profile holds no measurement of: their
        time is the analytic model's (with no profile, every such stage)."""
        return [name for name in self.graph.loop_stages
                if self.graph.nodes[name].model is not None and name not in self._ratios]

    def source(self) -> str:
        """Where the predictions come from, in a few words, for the plan's line: the
        profile, saying which stages it did not measure, or the analytic model."""
        if not self.profiled:
            return "analytic cost model, no profile of this machine"
        missing = self.unmeasured()
        if not missing:
            return "profile"
        return f"profile; analytic for {', '.join(missing)}, which it did not measure"

    def _shape_mismatch(self, profile: Profile) -> str | None:
        for name, shape in self.shapes.items():
            theirs = profile.shapes.get(name)
            if theirs is None:
                return f"no model {name!r}"
            ours = asdict(shape)
            for key in ("params", "layers", "hidden"):
                if int(theirs.get(key, -1)) != ours[key]:
                    return f"{name}.{key} {theirs.get(key)} vs {ours[key]}"
        return None

    # ----------------------------------------------------------------- fitting
    def contended(self, workers: int, threads: int) -> bool:
        """Whether an embedded cluster of ``workers`` x ``threads`` on this machine's
        cores leaves no core to the coordinator (Dask's scheduler and client, the
        buffer's metadata), which then runs on the workers' cores."""
        return not self.gpu and workers * threads >= self.cores

    def _fit(self, observations: list[Observation]) -> None:
        """Per (stage, threads, gang, contended): ``a + b * rows`` by least squares over
        the observations (a >= 0, b >= 0); and per stage, measured / analytic ratios. A
        stage whose environment steps run on the CPU pool is fitted to its tasks' time
        less the environment's steps they ran in their own process (measured with
        ``env_placement: task``): the steps leave the model worker, and the rows of
        the others decode meanwhile (assumed: fully)."""
        groups: dict[tuple[str, int, int, bool | None], list[Observation]] = defaultdict(list)
        for o in observations:
            if o.stage in self.graph.nodes or o.stage == "store":
                contended = self.contended(o.workers, o.threads) if o.workers else None
                groups[(o.stage, o.threads, o.gang, contended)].append(o)
        self._fit_env_steps(groups)
        for key, obs in groups.items():
            stage, threads, gang, contended = key
            node = self.graph.nodes.get(stage)
            pooled = node is not None and node.env_on_pool
            xs = [o.rows for o in obs]
            ys = [max(0.0, o.seconds - o.env) if pooled else o.seconds for o in obs]
            for o, y in zip(obs, ys, strict=True):
                analytic = self.analytic(stage, o.rows, threads, gang, bool(contended))
                if analytic > 0:
                    self._ratios[stage].append(y / analytic)
            if len(set(xs)) < 2:
                continue
            n = len(xs)
            mx, my = sum(xs) / n, sum(ys) / n
            sxx = sum((x - mx) ** 2 for x in xs)
            b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
            a = max(0.0, my - b * mx)
            self._fits[key] = (a, b)

    def _fit_env_steps(self, groups: Mapping[Any, list[Observation]]) -> None:
        """Per rollout stage stepping in its own tasks, the mean step time its tasks'
        measured environment seconds imply (``envtime.step_from``; their median)."""
        steps: dict[str, list[float]] = defaultdict(list)
        for (stage, *_), obs in groups.items():
            node = self.graph.nodes.get(stage)
            if node is None or not node.generates or node.env_on_pool:
                continue
            workers = int(getattr(self.pipeline.params[stage], "env_workers", 0) or 0)
            steps[stage] += [envtime.step_from(o.env, o.rows, node.turns, workers)
                             for o in obs if o.env > 0]
        self._env_step = {s: sorted(v)[len(v) // 2] for s, v in steps.items() if v}

    def env_seconds(self, stage: str, rows: int, streaming: bool = False) -> float:
        """Seconds a task of ``stage`` on ``rows`` episodes spends in environment
        steps beyond its model's work (``envtime``): at the step time a profile measured,
        else the declared ``params.env_step_s``, else none; a synchronous task's slowest
        episode, or a streaming one's mean (``streaming``). 0 for a stage whose steps run
        on the CPU pool."""
        node = self.graph.nodes.get(stage)
        if node is None or not node.generates or node.env_on_pool:
            return 0.0
        params = self.pipeline.params[stage]
        step = self._env_step.get(stage) or float(getattr(params, "env_step_s", 0) or 0)
        workers = int(getattr(params, "env_workers", 0) or 0)
        in_flight = getattr(params, "stream_in_flight", None)
        if streaming and node.reorders:
            return envtime.finish_seconds(step, rows, node.turns, workers, in_flight,
                                          self.pipeline.spec.overlap.max_staleness)
        if streaming:
            return envtime.stream_seconds(step, rows, node.turns, workers, in_flight)
        return envtime.sync_seconds(step, rows, node.turns, workers)

    # ----------------------------------------------------------------- durations
    def stage_seconds(self, stage: str, rows: int, threads: int, gang: int = 1,
                      contended: bool = False) -> float:
        """Seconds one task of ``stage`` takes on a batch of ``rows`` rows with
        ``threads`` torch threads (as one rank of a gang of ``gang``: each rank computes
        on ``rows / gang`` of them), on cores it shares with the coordinator
        (``contended``, see :meth:`contended`) or not. A streaming rollout's task
        (``stream: true``) has its slowest episode's environment time replaced by the
        mean episode's (:meth:`env_seconds`)."""
        seconds = self._stage_seconds(stage, rows, threads, gang, contended)
        node = self.graph.nodes.get(stage)
        if node is not None and node.streams and rows > 0:
            seconds = max(0.0, seconds - self.env_seconds(stage, rows)) \
                + self.env_seconds(stage, rows, streaming=True)
        return seconds

    def _stage_seconds(self, stage: str, rows: int, threads: int, gang: int,
                       contended: bool) -> float:
        if rows <= 0:
            return self.device["task_s"]
        slower = 1.0 + self.device["contention"]
        for flag, scale in ((contended, 1.0), (None, 1.0),
                            (not contended, slower if contended else 1 / slower)):
            fit = self._fits.get((stage, threads, gang, flag))
            if fit is not None:
                a, b = fit
                return (a + b * rows) * scale
        analytic = self.analytic(stage, rows, threads, gang, contended)
        ratios = self._ratios.get(stage)
        if ratios:  # measured elsewhere: the analytic shape at the measured scale
            return analytic * sorted(ratios)[len(ratios) // 2]
        return analytic

    def analytic(self, stage: str, rows: int, threads: int, gang: int = 1,
                 contended: bool = False) -> float:
        """The analytic estimate of a task (see the module docstring); a stage that works
        in one iteration of ``every`` (an evaluation) costs that share of it; a task on
        cores shared with the coordinator is ``contention`` slower; a rollout's
        environment steps add their time (:meth:`env_seconds`, synchronous)."""
        node = self.graph.nodes.get(stage)
        work = self._analytic(stage, rows, threads, gang)
        if node is not None and node.every > 1:
            work = self.device["task_s"] + (work - self.device["task_s"]) / node.every
        if contended:
            work *= 1.0 + self.device["contention"]
        return work + self.env_seconds(stage, rows)

    def _analytic(self, stage: str, rows: float, threads: int, gang: int = 1) -> float:
        d = self.device
        speed = d["flops_per_s"] / ((1 - d["thread_efficiency"])
                                    + d["thread_efficiency"] / max(1, threads))
        if stage == "store":
            return d["task_s"] + rows * (self.prompt_tokens + self.response_tokens) * 40 \
                / d["bytes_per_s"]
        node = self.graph.nodes[stage]
        params = self.pipeline.params[stage]
        shape = self.shapes.get(node.model) if node.model else None
        tokens: float = self.prompt_tokens + self.response_tokens
        if shape is None or shape.params == 0:
            # model-free stages: rewards are Python per row, advantages are tensor ops;
            # measured 0.3-0.7 ms for 4-64 rows of 77 tokens (1.6 ms for GAE)
            return d["light_s"] + rows * tokens * d["light_token_s"]
        flops_token = 2.0 * shape.params
        call = d["step_s"] + shape.layers * d["layer_s"]  # one forward's fixed cost
        # a forward runs a prompt once for the rows that share it (stages.common), so a
        # row carries only its share of the prompt's tokens (_prompt_share below)
        # a stage that decodes without sampling (ReMax's greedy baseline) costs the same
        decodes = node.response_tokens or int(getattr(params, "max_new_tokens", 0) or 0)
        if node.generates or decodes:
            steps = decodes or self.response_tokens
            prefill = call + rows * self._prompt_share(1) * self.prompt_tokens * \
                flops_token / speed
            decode = steps * (call + rows * d["row_step_s"] + rows * flops_token / speed)
            # a multi-turn rollout: each turn after the first feeds what came between
            # (the environment's answer, its share of the response) on the kept cache in
            # one forward; the environment's own time is added by analytic (env_seconds)
            joins = (node.turns - 1) * (call + rows * steps / (2 * node.turns) *
                                        flops_token / speed)
            return d["task_s"] + prefill + decode + joins
        if node.trains:
            share = self._row_share(stage)
            rows = rows * share
            epochs = int(getattr(params, "epochs", 1))
            minibatches = int(getattr(params, "minibatches", 1))
            steps = epochs * minibatches
            tokens = self.prompt_tokens * self._prompt_share(minibatches, share) + \
                self.response_tokens
            factor = d["train_factor"]
            if shape.adapters is not None:  # LoRA: the backward computes no gradients
                factor = 1.0 + (factor - 1.0) / 2  # of the frozen weights, half its work
            # gradient checkpointing: the backward runs the decoder layers' forward again
            work = factor * flops_token + 2.0 * self.recomputed_weights(self.graph.model_of(stage))
            compute = epochs * rows / gang * tokens * work / speed
            overhead = steps * (d["train_step_s"] + 3 * call + 16 * shape.trained / speed)
            allreduce = 0.0
            if gang > 1:
                ring = 2 * (gang - 1) / gang * shape.trained * 4
                allreduce = steps * (ring / d["allreduce_bytes_per_s"]
                                     + math.log2(gang) * d["allreduce_latency_s"])
            return d["task_s"] + compute + overhead + allreduce
        # one forward pass: log-probs, values, a reward model; a reward model's sequence
        # scores still run every row's prompt (stages.models.sequence_scores)
        if not node.scores:
            tokens = self.prompt_tokens * self._prompt_share(1) + self.response_tokens
        return d["task_s"] + call + rows * tokens * flops_token / speed

    def recomputed_weights(self, model: str) -> int:
        """The matrix weights whose products gradient checkpointing
        (``models.NAME.gradient_checkpointing``) runs a second time per token in a
        training step of ``model``: the checkpointed decoder layers' (every matrix weight
        but the output head's; ``engine.recompute``); 0 without it."""
        shape = self.shapes.get(model)
        if not self.pipeline.spec.models[model].gradient_checkpointing or shape is None:
            return 0
        head = shape.hidden * (shape.vocab if self.pipeline.spec.models[model].head == "lm"
                               else 1)
        return max(0, shape.matmul_params - head)

    def _row_share(self, stage: str) -> float:
        """The share of the batch's rows ``stage`` works on: those its ``row_filter``
        column marks, at most the producer's ``kept_share`` (best-of-N fine-tuning
        trains on ``top_k`` of each prompt's samples)."""
        column = self.graph.nodes[stage].row_filter
        producer = self.graph.producer(column, stage) if column else None
        node = self.graph.nodes.get(producer) if producer else None
        return node.kept_share if node is not None else 1.0

    def _prompt_share(self, minibatches: int, row_share: float = 1.0) -> float:
        """The share of a row's prompt tokens a forward runs when each
        distinct prompt runs once: ``1/G`` for ``G`` samples per prompt in contiguous
        rows (micro-batches); for a minibatch of a shuffled batch's rows (a trainer's
        ``minibatches``), the expected distinct prompts in it per row. ``row_share``:
        the stage keeps that share of each prompt's samples (``_row_share``)."""
        data = self.pipeline.spec.data
        group = data.samples_per_prompt if data is not None else 1
        group = max(1, round(group * row_share))
        if group <= 1:
            return 1.0
        if minibatches <= 1:
            return 1.0 / group
        fraction = 1.0 / minibatches  # each row of a prompt is in the minibatch w.p. f
        return (1.0 - (1.0 - fraction) ** group) / (fraction * group)

    def transfer_seconds(self, nbytes: float) -> float:
        """Moving ``nbytes`` between two workers (Dask, or a weight reallocation)."""
        return self.device["latency_s"] + nbytes / self.device["bytes_per_s"]

    def checkpoint_seconds(self, model: str) -> float:
        """Saving ``model`` into a checkpoint: its weights (transformers format) and its
        optimizer state (two AdamW moments, the weights' size each). Measured on one CPU
        core: 6 ms for the 0.55 MB tiny model, 43 ms for grpo-small's 25 MB. A LoRA
        model saves its adapters and their moments only."""
        shape = self.shapes.get(model)
        nbytes = shape.moved_bytes * 3 if shape else 0
        return self.device["checkpoint_s"] + nbytes / self.device["save_bytes_per_s"]

    def result_bytes(self, rows: int) -> float:
        """Bytes of a micro-batch's results (a few token-length columns)."""
        return rows * (self.prompt_tokens + self.response_tokens) * 4 * 4

    # ----------------------------------------------------------------- memory
    def with_pipeline(self, pipeline: Pipeline) -> CostModel:
        """This cost model (its shapes, device, profile fits, token counts) for
        ``pipeline``, one derived from its own with other memory settings (a trainer's
        backend, gradient checkpointing, the rows' split)."""
        other = copy.copy(self)
        other.pipeline, other.graph = pipeline, pipeline.graph
        return other

    def sharded(self, model: str) -> bool:
        """Whether ``model`` trains sharded over its home's workers (a trainer of it has
        ``backend: fsdp``)."""
        return self.pipeline.trains_sharded(model)

    def memory(self, plan: ExecutionPlan, rows_per_task: Mapping[str, int]) -> list[float]:
        """Estimated peak bytes per worker of ``plan`` (:meth:`memory_parts`, summed)."""
        return [sum(parts.values()) for parts in self.memory_parts(plan, rows_per_task)]

    def memory_parts(self, plan: ExecutionPlan, rows_per_task: Mapping[str, int]
                     ) -> list[dict[str, float]]:
        """Estimated peak bytes per worker of ``plan``, by what holds them: ``process``,
        the worker process itself (``WORKER_PROCESS``); ``weights``,
        every model copy's (a frozen view of a LoRA model's base nothing where that model
        is; a LoRA model's merged weights where it samples); ``trainer``, at a trained
        model's home, its gradients and AdamW state (fp32, two moments; a LoRA model's:
        of its adapters), sharded over the home's workers under ``backend: fsdp``
        (:func:`trainer_state`, its weights' share replacing the whole copy); ``incoming``,
        on a shadow of a trained model, the new weights in flight beside its own (the
        model's size, a LoRA model's adapters; a sharded model's ranks' parts: as much),
        held until the install has copied them in; ``work``, the largest KV cache or activation footprint of a
        task on that worker (:meth:`task_bytes`), or of loading or saving a sharded
        model there (``trainer_state``'s ``transient``)."""
        parts = [{"process": float(WORKER_PROCESS), "weights": 0.0, "trainer": 0.0,
                  "incoming": 0.0, "work": 0.0} for _ in range(plan.n_workers)]
        transient = [0.0] * plan.n_workers
        for model, workers in plan.replicas.items():
            shape = self.shapes.get(model)
            if shape is None:
                continue
            trained = self.pipeline.spec.models[model].trainable
            home = plan.homes.get(model, ())
            sharded = trained and self.sharded(model) and len(home) > 1
            for w in workers:
                if shape.base_of is not None and w in plan.replicas.get(shape.base_of, ()):
                    continue  # the LoRA model's resident base, no copy of its own
                if trained and w in home:
                    state = trainer_state(shape, len(home) if sharded else 1, self.head(model),
                                          saves=rank_saves(w, home))
                    parts[w]["trainer"] += state["trained"]
                    parts[w]["weights"] += state["weights"]
                    transient[w] = max(transient[w], state["transient"])
                else:
                    parts[w]["weights"] += shape.nbytes
                    if trained:  # a shadow: the new weights arrive beside its own
                        parts[w]["incoming"] += shape.moved_bytes
        merged: set[tuple[str, int]] = set()
        for name, sp in plan.stages.items():
            node = self.graph.nodes[name]
            if node.samples and node.model is not None:
                merged.update((node.model, w) for w in sp.workers)
        for model, w in merged:
            shape = self.shapes.get(model)
            if shape is not None:
                parts[w]["weights"] += shape.merged * shape.bytes_per_param
        for name, sp in plan.stages.items():
            work = self.task_bytes(name, rows_per_task.get(name, 0),
                                   len(sp.workers) if sp.gang else 1)
            for w in sp.workers:
                parts[w]["work"] = max(parts[w]["work"], work)
        for w, extra in enumerate(transient):  # loading or saving a sharded model
            parts[w]["work"] = max(parts[w]["work"], extra)
        return parts

    def head(self, model: str) -> str:
        """The model's head (``models.NAME.head``: ``lm`` or a value head)."""
        return str(self.pipeline.spec.models[model].head)

    def task_bytes(self, stage: str, rows: int, gang: int = 1) -> float:
        """Peak bytes of one task of ``stage`` on ``rows`` rows besides the weights and
        optimizer state: a trainer's activations (:func:`activation_bytes`; a gang's
        rank holds those of its share only), else the KV cache (keys and values per
        layer) and the logits of a forward."""
        node = self.graph.nodes[stage]
        shape = self.shapes.get(node.model) if node.model else None
        if shape is None:
            return 0.0
        tokens = self.prompt_tokens + self.response_tokens
        if node.trains:
            mb = int(getattr(self.pipeline.params[stage], "minibatches", 1))
            model = self.graph.model_of(stage)
            return train_task_bytes(shape, rows / max(1, mb) / gang, tokens, gang,
                                    self.pipeline.spec.stages[stage].backend,
                                    self.pipeline.spec.models[model].gradient_checkpointing,
                                    self.response_tokens)
        return rows * tokens * (2 * shape.layers * shape.hidden + shape.vocab) * 4
