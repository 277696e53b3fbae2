"""The pipeline file: YAML parsed once into typed, frozen objects.

Every error is one line: ``FILE: KEY.PATH: what was expected``. Nothing downstream of
``load_pipeline`` re-validates; it trusts these objects.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rlhfflow.config.yamlfile import error_from_pydantic
from rlhfflow.errors import SpecError  # noqa: F401  (the pipeline file's error, where callers find it)
from rlhfflow.sdk import StageParams
from rlhfflow.spec.algorithm import AlgorithmSpec
from rlhfflow.spec.fields import (
    NonNegFloat,
    NonNegInt,
    PackageSpec,
    PositiveFloat,
    PositiveInt,
    Strict,
    need_package,
)

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

    lr: PositiveFloat = Field(1e-5, description=(
        "Learning rate (the peak, reached after `warmup_steps`)."))
    betas: Annotated[list[float], Field(min_length=2, max_length=2)] = Field(
        [0.9, 0.999], description="Adam betas.")
    weight_decay: NonNegFloat = Field(0.0, description="Decoupled weight decay.")
    eps: PositiveFloat = Field(1e-8, description="Adam epsilon.")
    grad_clip: PositiveFloat | None = Field(1.0, description=(
        "Maximum gradient norm; `null`: no clipping."))
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description=(
        "Learning rate after warmup: kept (`constant`), or decayed to `min_lr_ratio * lr` at "
        "`total_steps` (`linear`, `cosine`)."))
    warmup_steps: NonNegInt = Field(0, description=(
        "Optimizer steps of linear warmup (step i uses `lr * (i + 1) / warmup_steps`)."))
    total_steps: PositiveInt | None = Field(None, description=(
        "Where the decay ends. Default (`null`): `iterations` x the `epochs * minibatches` of "
        "every loop stage training the model. Extending a run (`--iterations`) changes a derived "
        "value: set it to keep the schedule of a run you mean to extend. Required for a decaying "
        "schedule of a model only setup stages train."))
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = Field(0.0, description=(
        "The decayed learning rate as a fraction of `lr`."))
    skip_nonfinite: NonNegInt = Field(0, description=(
        "Optimizer steps with a NaN/inf loss or gradient that may be skipped (counted as "
        "`nonfinite_steps` in the training metrics) before the stage stops; `0`: stop at the "
        "first."))
    checkpoint: bool | None = Field(None, description=(
        "Keep this model's optimizer moments in checkpoints; `null`: as `checkpoint.optimizer` "
        "says."))


class LoraSpec(Strict):
    """LoRA adapters (``peft``, the ``lora`` extra): only the adapters train, move to shadow
    copies and go into checkpoints; ``from:`` copies of the model that do not train (the
    reference) are the same resident base weights with the adapters off."""

    r: PositiveInt = Field(description="Rank of the adapters.")
    alpha: PositiveFloat | None = Field(None, description=(
        "Scaling numerator: the update is `alpha / r * B A`; `null`: `2 * r` (a scale of 2)."))
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(0.0, description=(
        "Dropout on the adapters' input while training."))
    target_modules: list[str] | Literal["all-linear"] = Field("all-linear", description=(
        "Names (or name suffixes) of the Linear layers that get adapters, e.g. `[q_proj, "
        "v_proj]`; `all-linear`: every Linear layer but the output head."))
    merge_for_generation: bool = Field(True, description=(
        "Generate (and evaluate) from merged weights `W + alpha / r * B A`, made again when "
        "the adapters change (once per update): a decode step costs what the base model's "
        "does, for one more copy of the adapted layers' weights in each worker that "
        "generates; sampled log-probs equal the adapters' up to float rounding. A training "
        "step on that worker reads the same merged weights while they match the adapters "
        "(gradients equal the adapters' path up to float rounding). `false`: the adapters' "
        "two extra products in every step. Needs the lean forward (float32 on CPU); "
        "elsewhere the adapters run as they are."))


class TinyModelSpec(Strict):
    """A tiny random model built locally (character tokenizer), for demos and tests."""

    arch: Literal["llama", "gpt2"] = Field("llama", description="Architecture.")
    layers: PositiveInt = Field(2, description="Transformer blocks.")
    hidden: PositiveInt = Field(64, description="Hidden size (Llama's MLP is 4x).")
    heads: PositiveInt = Field(4, description="Attention heads.")
    max_positions: PositiveInt = Field(128, description="Longest prompt + response, in tokens.")
    seed: int | None = Field(None, description=(
        "Seed of the weight initialisation; `null`: the pipeline's `seed`."))


class ModelSpec(Strict):
    """A named model: where its initial weights come from, its head, whether it trains."""

    path: str | None = Field(None, description=(
        "A transformers checkpoint directory (`config.json`, weights and tokenizer files), "
        "relative to the pipeline file; or, when no such directory exists, a Hugging Face Hub id "
        "`org/name[@revision]` (branch, tag or commit; default `main`) found in the local "
        "Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else "
        "`~/.cache/huggingface/hub`), never downloaded."))
    from_: str | None = Field(default=None, alias="from", description=(
        "Another model's name: start from its initial (or setup-trained) weights. A `value` "
        "model made from an `lm` model keeps the backbone and gets a zero-initialised value "
        "head."))
    tiny: TinyModelSpec | None = Field(None, description=(
        "Build a tiny random model with a character tokenizer when the run starts (for demos and "
        "tests; nothing is downloaded); `tiny: {}` takes all defaults."))
    head: Literal["lm", "value"] = Field("lm", description=(
        "`lm`: a causal LM (actors, references); `value`: one scalar per token (critics, reward "
        "models)."))
    trainable: bool = Field(False, description=(
        "Give the model an optimizer; some stage must train it, and it is saved to "
        "`OUTPUT/models/NAME/final` at the end."))
    optimizer: OptimizerSpec = Field(OptimizerSpec(), description=(
        "AdamW settings, used when `trainable`."))
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description=(
        "Compute dtype. A trainable `bfloat16` or `float16` model trains in mixed precision "
        "(fp32 master weights; `float16` with loss scaling, not under `backend: deepspeed`); a "
        "frozen one is loaded in that dtype."))
    gradient_checkpointing: bool = Field(False, description=(
        "Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them: less memory in training for ~1/3 more compute. Only on a `trainable` model."))
    attn_implementation: Literal["eager", "sdpa", "flex_attention", "flash_attention_2",
                                 "flash_attention_3", "flash_attention_4"] | None = Field(None, description=(
        "transformers' attention kernel (`eager`, `sdpa`, `flash_attention_2`, ...); `null`: "
        "transformers' default. Anything but `sdpa` or `null` keeps transformers' forward "
        "(rlhfflow's lean forward is SDPA). `flash_attention_*` needs a GPU and its package."))
    lora: LoraSpec | None = Field(None, description=(
        "Train LoRA adapters instead of every weight (needs `trainable` and the `lora` extra); "
        "see the how-to *LoRA adapters*."))

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        sources = [k for k, v in (("path", self.path), ("from", self.from_),
                                  ("tiny", self.tiny)) if v is not None]
        if len(sources) != 1:
            got = " and ".join(sources) if sources else "none"
            raise ValueError(f"expected exactly one of 'path', 'from', 'tiny'; got {got}")
        if self.gradient_checkpointing and not self.trainable:
            raise ValueError("gradient_checkpointing saves training memory; the model is "
                             "not trainable (set trainable: true or drop it)")
        return self


class DeepSpeedSpec(Strict):
    """DeepSpeed settings of a training stage (``backend: deepspeed``)."""

    zero_stage: Literal[0, 1, 2, 3] = Field(2, description=(
        "ZeRO stage (stage 2 is tested, stage 1 has run on CPU, 0 is untested; 3 is refused "
        "on a gang of two or more workers: shard with `backend: fsdp`)."))
    config: dict[str, Any] = Field({}, description=(
        "Extra DeepSpeed config; its top-level keys replace rlhfflow's "
        "(`train_micro_batch_size_per_gpu: 1`, `gradient_accumulation_steps: 1`, "
        "`zero_optimization`, `gradient_clipping` from the model's `grad_clip`, ...)."))


class StageSpec(Strict):
    """A named stage: its type, its model, its upstream stages, its parameters."""

    type: str = Field(description=(
        "A registered stage type (a built-in, or one an installed package declares in the "
        "`rlhfflow.stages` entry-point group; `rlhfflow stages` lists them), or the import path "
        "of a `Stage` subclass, `package.module:Class`."))
    model: str | None = Field(None, description=(
        "The model the stage uses; required unless the type takes none (`advantages`) or it is a "
        "`score` stage with `params.function`; its `head` must match the stage type."))
    after: list[str] = Field([], description="Stages this one waits for (and reads columns from).")
    params: dict[str, Any] = Field({}, description=(
        "The stage type's parameters (see the stage type reference); unknown params are errors."))
    retries: NonNegInt = Field(0, description=(
        "Times Dask retries a failed task of this stage (never the ranks of a data-parallel "
        "gang; a fused task: the largest `retries` of its stages)."))
    backend: Literal["torch", "deepspeed", "fsdp"] = Field("torch", description=(
        "How a `train_actor` or `train_critic` stage trains its model; `deepspeed` and `fsdp` "
        "only on those two. `fsdp`: the model's weights, gradients and AdamW state sharded over "
        "its workers (torch FSDP2; at least 2, and no other stage may use the model there: "
        "place generation on a shadow, e.g. `placement.strategy: disaggregated`); see "
        "docs/how-to/sharded-training.md."))
    deepspeed: DeepSpeedSpec | None = Field(None, description=(
        "DeepSpeed settings; only with `backend: deepspeed`."))
    micro_batches: PositiveInt | None = Field(None, description=(
        "Micro-batches (tasks) the stage splits the iteration's rows into, at most one per row; "
        "`null`: `data.micro_batches`. Only on micro-batch stages (`generate`, `score`, "
        "`logprob`, `values`): on another stage type it is an error."))
    fuse: bool = Field(True, description=(
        "`false`: never fuse this stage with others into one task."))


class SourceSpec(Strict):
    """One of several prompt sources mixed by weight (``data.sources``)."""

    prompts: str = Field(description=(
        "A local file or directory, or a Hub data set id, as `data.prompts` takes it."))
    weight: PositiveFloat = Field(1.0, description=(
        "Share of each batch's prompts taken from this source, relative to the other sources' "
        "weights (`0.7` and `0.3`: 7 of every 10 prompts)."))
    split: str | None = Field(None, description=(
        "The split of a Hub data set (or of a saved `DatasetDict`); `null`: `data.split`."))
    subset: str | None = Field(None, description=(
        "The subset (config name) of a Hub data set; `null`: `data.subset`."))
    rename: dict[str, str] = Field({}, description=(
        "Field renames of this source's records, applied after `data.rename` "
        "(`{question: prompt}`)."))


class DataSpec(Strict):
    """Where prompts come from and how many make one iteration.

    ``prompts``: a JSONL file, a Parquet file or a saved HF ``datasets`` directory of
    records with ``prompt_field`` (text) or ``messages_field`` (chat turns); or, when no
    such path exists, a Hub data set id (``openai/gsm8k``) read from the local Hugging Face
    cache with its ``subset`` and ``split``. ``sources`` mixes several by weight instead.
    ``rename`` renames record fields first. Other fields reach reward functions.
    ``chat_template``: ``auto`` renders chat records with the tokenizer's chat template,
    ``true`` renders every record (a plain prompt as one user turn) and needs a tokenizer
    with a template, ``false`` never renders."""

    prompts: str | None = Field(None, description=(
        "The prompts, relative to the pipeline file: a JSONL file, a `.parquet` file (needs "
        "`pyarrow`) or a directory saved with `datasets`' `save_to_disk` (needs `datasets`; a "
        "`DatasetDict` uses `split`). When no such path exists, a Hub data set id "
        "`org/name[@revision]` (`openai/gsm8k`) found in the local Hugging Face cache "
        "(`HF_HUB_CACHE`, else `HF_HOME/hub`), never downloaded: fetch it first with `hf "
        "download --repo-type dataset org/name`. Exactly one of `prompts` and `sources`."))
    sources: Annotated[list[SourceSpec], Field(min_length=1)] | None = Field(None, description=(
        "Several prompt sources mixed by `weight`: every batch interleaves them in proportion, "
        "in an order fixed by the position in the run (the same prompts on resume), each "
        "source shuffled by `seed`. Exactly one of `prompts` and `sources`."))
    split: str = Field("train", description=(
        "The split of a Hub data set (or of a saved `DatasetDict`)."))
    subset: str | None = Field(None, description=(
        "The subset (config name) of a Hub data set (`main` of `openai/gsm8k`); `null`: its "
        "only or default one."))
    prompt_field: str = Field("prompt", description=(
        "The field of each record that holds a plain-text prompt (a record may give "
        "`messages_field` instead)."))
    messages_field: str = Field("messages", description=(
        "The field of each record that holds a chat (a list of `{role, content}` turns)."))
    rename: dict[str, str] = Field({}, description=(
        "Field renames applied to every record before anything reads it (`{question: prompt, "
        "answer: solution}`); reward functions see the new names."))

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.prompts is None) == (self.sources is None):
            got = "both" if self.prompts is not None else "neither"
            raise ValueError(f"expected exactly one of 'prompts' and 'sources'; got {got}")
        return self

    batch_size: PositiveInt = Field(16, description="Prompts per iteration.")
    samples_per_prompt: PositiveInt = Field(1, description=(
        "Responses per prompt (rows = `batch_size * samples_per_prompt`); use more than 1 for "
        "GRPO and RLOO."))
    micro_batches: PositiveInt = Field(2, description=(
        "Micro-batches of the prompt source and of the buffer (one zarr chunk and one `store` "
        "task each), and the default of each stage's `micro_batches`."))
    max_prompt_tokens: PositiveInt = Field(64, description=(
        "A longer prompt stops the run before iteration 0, naming it (or is skipped with "
        "`on_bad_prompt: skip`)."))
    shuffle: bool = Field(True, description=(
        "A new seeded permutation of the prompts each epoch; `false`: file order."))
    on_bad_prompt: Literal["error", "skip"] = Field("error", description=(
        "A malformed line or an over-long prompt: stop the run (`error`), or leave it out, count "
        "it and list it in `OUTPUT/skipped_prompts.txt` (`skip`)."))
    chat_template: Literal["auto", True, False] = Field("auto", description=(
        "Render prompts with the tokenizer's chat template: `auto` renders `messages` records "
        "when the tokenizer has a template, `true` renders every record (a plain prompt as one "
        "user turn) and needs a template, `false` never (then a `messages` record is an error)."))


class ClusterSpec(Strict):
    """The Dask cluster: an embedded LocalCluster (default) or an existing scheduler."""

    workers: PositiveInt = Field(2, description=(
        "Workers of the embedded cluster (on GPUs: at most one per GPU)."))
    env_workers: NonNegInt = Field(0, description=(
        "Worker processes of the embedded cluster that hold no model and run environment "
        "steps (a `rollout` stage's with `params.env_placement: pool`), one step at a time "
        "each, with the Dask resource `env`; on a cluster at `address`, start such workers "
        "with `--resources env=1`."))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "`auto`: each embedded worker gets its own GPU when there are GPUs, and models run on "
        "the GPU a worker sees, else on CPU; `cuda`: the same, but a machine without a GPU is an "
        "error; `cpu`: models stay on CPU even where GPUs are visible."))
    address: str | None = Field(None, description=(
        "A running Dask scheduler (`tcp://HOST:8786`) instead of the embedded cluster; "
        "`--scheduler` sets it."))
    host: str = Field("127.0.0.1", description=(
        "Interface the embedded scheduler and workers listen on."))
    dashboard_address: str = Field("127.0.0.1:8787", description=(
        "Where the embedded scheduler serves the dashboard (a free port when this one is taken)."))
    memory_limit: str = Field("auto", description=(
        "Memory limit per embedded worker, as Dask takes it (`auto`, `16GiB`, ...); the "
        "planner's plans must fit it."))
    torch_threads: PositiveInt | None = Field(None, description=(
        "Torch threads per worker; `null` on the embedded cluster: (CPU cores - 1) / workers, at "
        "least 1, leaving one core to the coordinator and scheduler (`placement: auto` may "
        "choose otherwise)."))
    worker_timeout_s: PositiveFloat = Field(60.0, description=(
        "After a worker holding models is lost: how long to wait for workers to come back before "
        "stopping."))
    heartbeat_timeout_s: PositiveFloat = Field(900.0, description=(
        "How long an embedded worker may send the scheduler no heartbeat before it is declared "
        "lost (and restarted): a worker on a loaded machine, whose event loop waits for the "
        "cores, is late, not dead. A worker whose process dies is noticed at once whatever this "
        "is (its connection closes). On a cluster at `address` its scheduler's "
        "`distributed.scheduler.worker-ttl` decides."))
    max_restarts: NonNegInt = Field(3, description=(
        "How many times a run recovers from lost workers before it stops."))
    collective_timeout_s: PositiveFloat = Field(600.0, description=(
        "How long a data-parallel gang's collectives (the process group's rendezvous, the "
        "gradient all-reduce) wait for a peer before failing."))


class CheckpointSpec(Strict):
    """When to checkpoint the trainable models (weights, optimizer state, versions).
    ``optimizer: false`` leaves the optimizer moments out (a third of the size with
    AdamW); a resume then restarts the optimizer (the learning-rate schedule goes on)."""

    every: NonNegInt = Field(5, description=(
        "Checkpoint after every N-th iteration; `0`: only at the end or when stopped."))
    keep: NonNegInt = Field(2, description="How many checkpoints to keep; `0`: all.")
    optimizer: bool = Field(True, description=(
        "Save the optimizer moments; `false` saves only the learning-rate schedule's position, "
        "and a resume restarts AdamW (fresh moments) from the saved weights. Per model: "
        "`models.NAME.optimizer.checkpoint`."))


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

    strategy: Literal["auto", "colocated", "interleaved", "disaggregated"] = Field(
        "auto", description=(
        "`auto`: the planner chooses the strategy, the micro-batch split, fusion and (embedded "
        "cluster) workers x threads; `colocated`: every model on every worker, training as a "
        "data-parallel gang over all; `interleaved`: each model on an exclusive group of "
        "workers; `disaggregated`: generation on the `rollout` group with a shadow of the actor "
        "synced after each update, everything else on `train` (needs at least 2 workers)."))
    profile: str | None = Field(None, description=(
        "The profile `auto` predicts from (written by `rlhfflow profile`), relative to the "
        "pipeline file; `null`: `profiles/NAME.json` beside the pipeline file if it exists, else "
        "the analytic cost model."))
    groups: dict[str, list[int] | float] = Field({}, description=(
        "Named worker sets: a list of worker indexes, or a fraction of the workers (fractions "
        "are laid out one after another, in the order written). `interleaved` places models into "
        "these groups instead of its own blocks; `disaggregated` uses `rollout` (default: the "
        "first half of the workers, at least 1) and `train` (default: the rest)."))
    models: dict[str, WorkerRef] = Field({}, description=(
        "Where a model lives (and is trained): a group name, a worker index or a list of "
        "indexes, overriding the strategy."))
    stages: dict[str, WorkerRef] = Field({}, description=(
        "Where a stage runs: a group name, a worker index or a list of indexes, overriding the "
        "strategy. Outside its model's home it uses a replica (a shadow when the model is "
        "trained); not allowed for training stages or stages without a model."))

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

    max_staleness: NonNegInt = Field(0, description=(
        "How many updates behind the generating model's inference may run (`generate` and the "
        "model's other micro-batch stages, such as `old_logprob`): with N, iteration k's run "
        "with the actor after iteration k-N-1's update, submitted N iterations early; `0`: "
        "strictly on-policy. No effect when the generating model is not trainable."))
    fuse: bool = Field(True, description=(
        "Run consecutive stages on the same workers as one task (micro-batch stages one task per "
        "micro-batch, whole-batch stages such as `advantages + train_actor` one per iteration) "
        "where no other stage waits longer for it; `false`: every stage its own tasks."))
    sequential: bool = Field(False, description=(
        "Each stage waits for the whole previous stage and each iteration for the previous one: "
        "no streaming, fusion or overlap (the baseline). An error with `max_staleness` > 0."))


class MlflowSpec(PackageSpec):
    """Where per-iteration metrics go in MLflow: ``tracking_uri`` (default: MLflow's own,
    ``MLFLOW_TRACKING_URI`` or ``./mlruns``), the experiment (created if missing) and the
    run's name (default: the pipeline's name)."""

    package = "mlflow"

    tracking_uri: str | None = Field(None, description=(
        "Where MLflow stores runs (`http://HOST:5000`, `sqlite:///mlflow.db`, ...); `null`: "
        "MLflow's default (`MLFLOW_TRACKING_URI` or `./mlruns`)."))
    experiment: str = Field("rlhfflow", description="The MLflow experiment (created if missing).")
    run_name: str | None = Field(None, description=(
        "The MLflow run's name; `null`: the pipeline's name."))


class WandbSpec(PackageSpec):
    """A Weights & Biases run of the per-iteration metrics (and completions tables). The
    default ``mode: offline`` writes the run under ``dir`` and contacts nobody; ``wandb
    sync DIR/wandb/offline-run-*`` uploads it later."""

    package = "wandb"

    project: str = Field("rlhfflow", description="The W&B project.")
    mode: Literal["offline", "online", "disabled"] = Field("offline", description=(
        "`offline`: write the run locally only (upload later with `wandb sync`); `online`: "
        "stream it to the W&B server (needs `wandb login`); `disabled`: log nothing."))
    dir: str | None = Field(None, description=(
        "Where the run's `wandb/` folder goes, relative to the pipeline file's folder; "
        "`null`: the output directory."))
    entity: str | None = Field(None, description=(
        "The W&B user or team; `null`: your default."))
    run_name: str | None = Field(None, description=(
        "The W&B run's name; `null`: the pipeline's name."))
    tags: list[str] = Field([], description="Tags of the W&B run.")


class TrackioSpec(PackageSpec):
    """A Trackio run of the per-iteration metrics (and completions tables). Local by
    default: Trackio's SQLite database in ``TRACKIO_DIR`` (Trackio's own environment
    variable; default ``~/.cache/huggingface/trackio``), shown by ``trackio show
    --project PROJECT``. A resumed rlhfflow run goes on logging into its Trackio run."""

    package = "trackio"

    project: str = Field("rlhfflow", description="The Trackio project.")
    run_name: str | None = Field(None, description=(
        "The Trackio run's name; `null`: the pipeline's name."))
    group: str | None = Field(None, description=(
        "A group the dashboard can gather runs by; `null`: none."))
    space_id: str | None = Field(None, description=(
        "A Hugging Face Space (`USER/SPACE`) to log to as well (needs `hf auth login`; "
        "created if missing); `null`: this machine only."))


class LoggingSpec(Strict):
    """Where per-iteration metrics go besides ``OUTPUT/metrics.jsonl``, under the names
    TRL and veRL users know (``reward``, ``kl``, ``completions/mean_length``,
    ``timing/STAGE``, ...). ``tensorboard``: a directory (relative to the pipeline file),
    or ``true`` for ``OUTPUT/tensorboard``. ``completions_every: N``: every N-th
    iteration's samples (prompt, response, rewards, advantage) go to
    ``OUTPUT/completions.jsonl`` and as a table to the trackers that take tables."""

    tensorboard: str | bool = Field(False, description=(
        "Write each iteration's metrics as TensorBoard scalars: `true` into "
        "`OUTPUT/tensorboard`, a string into that directory (relative to the pipeline file's "
        "folder); needs the `tensorboard` extra."))
    mlflow: MlflowSpec | None = Field(None, description=(
        "Log each iteration's metrics to an MLflow run; needs the `mlflow` extra."))
    wandb: WandbSpec | None = Field(None, description=(
        "Log each iteration's metrics (and completions tables) to a Weights & Biases run, "
        "offline by default; needs the `wandb` extra."))
    trackio: TrackioSpec | None = Field(None, description=(
        "Log each iteration's metrics (and completions tables) to a Trackio run, on this "
        "machine by default; needs the `trackio` extra."))
    completions_every: NonNegInt = Field(0, description=(
        "Every N-th iteration (0, N, 2N, ...), write its samples (prompt, response, reward "
        "and each reward function's score, mean advantage) to `OUTPUT/completions.jsonl`, "
        "and as a table to W&B and Trackio (`completions`) and TensorBoard (text); `0`: never."))

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, value: str | bool) -> str | bool:
        if value is not False:
            need_package("tensorboard", "tensorboard")
        if value == "":
            raise ValueError("expected a directory or true/false, got ''")
        return value


class PipelineSpec(Strict):
    """The whole pipeline file."""

    name: str | None = Field(None, description=(
        "The pipeline's name (the default output is `runs/NAME`); `null`: the file's stem "
        "(`ppo-tiny` for `ppo-tiny.yaml`)."))
    seed: int = Field(0, description=(
        "Seeds tiny models, prompt shuffling, sampling and minibatch order."))
    iterations: NonNegInt = Field(1, description="RL iterations; `0` runs only the setup stages.")
    output: str | None = Field(None, description=(
        "Output directory, relative to the current directory; `null`: `runs/NAME`."))
    models: dict[str, ModelSpec] = Field({}, description=(
        "The named models. Names are letters, digits and underscores, not starting with a digit."))
    stages: dict[str, StageSpec] = Field(description=(
        "The named stages, at least one. Names are lowercase letters, digits and underscores, "
        "starting with a letter (the Dask dashboard groups tasks by a key's first word, the "
        "stage's name); `data` is reserved."))
    data: DataSpec | None = Field(None, description=(
        "The prompts; required when there are loop stages and `iterations > 0`."))
    algorithm: AlgorithmSpec = Field(AlgorithmSpec(), description=(
        "Advantage estimator, policy loss, KL penalty, clipping and loss aggregation."))
    cluster: ClusterSpec = Field(ClusterSpec(), description=(
        "The Dask cluster: the embedded one (2 local workers by default) or a running scheduler."))
    placement: PlacementSpec = Field(PlacementSpec(), description=(
        "Which workers hold each model and run each stage."))
    overlap: OverlapSpec = Field(OverlapSpec(), description=(
        "How much the scheduler overlaps stages and iterations (default: streaming, fused, "
        "on-policy)."))
    checkpoint: CheckpointSpec = Field(CheckpointSpec(), description=(
        "When to checkpoint the trainable models."))
    logging: LoggingSpec = Field(LoggingSpec(), description=(
        "Copies of the metrics in TensorBoard, MLflow and W&B; completions tables."))


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
