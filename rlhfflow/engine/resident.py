"""Resident models: loaded once per process, kept with their optimizer and a version.

``ModelStore`` knows nothing of Dask; the executor's WorkerPlugin owns one per worker so
models stay in worker memory between tasks. Used alone, it serves stages run from Python.

Precision: a trainable model with ``dtype: bfloat16`` trains in mixed precision: fp32
master weights and AdamW state, forward passes under bf16 autocast (measured on
SmolLM2-135M: pure bf16 kept only 3.45% of the updates after 6 steps, the rounding of
lr-sized steps to bf16 drops them). ``float16`` does the same with dynamic loss scaling
(fp16 gradients underflow without it; pure fp16 AdamW turned every weight to NaN).
Frozen models load in their dtype as they are.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfflow.engine import lean, lora, recompute
from rlhfflow.errors import RlhfflowError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what an optimizer file holds since schedules and the skip budget were added
_OPTIMIZER_FORMAT = 2


class NonFiniteError(RlhfflowError, RuntimeError):
    """A NaN or infinite loss or gradient in a training step: names the model and step."""


def lr_factor(step: int, schedule: str = "constant", warmup_steps: int = 0,
              total_steps: int | None = None, min_lr_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``lr``:
    linear warmup over ``warmup_steps``, then constant, or a ``linear``/``cosine`` decay
    reaching ``min_lr_ratio`` at ``total_steps`` (and staying there)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or not total_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def autocast_forward(module: torch.nn.Module, device: str, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under autocast to ``dtype`` with fp32 logits out (as
    accelerate's mixed precision does), so every stage calling it computes in ``dtype``
    while the parameters, their gradients and the optimizer stay fp32."""
    forward = module.forward
    device_type = torch.device(device).type

    @functools.wraps(forward)
    def mixed(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        logits = getattr(out, "logits", None)
        if logits is not None and logits.dtype != torch.float32:
            out.logits = logits.float()  # log-softmax over a vocabulary wants fp32
        return out

    module.forward = mixed


@dataclass(frozen=True)
class ModelConfig:
    """Everything a process needs to load and train a model (resolved by the pipeline).

    Attributes:
        name: the model's name in the pipeline.
        head: ``"lm"`` (causal LM) or ``"value"`` (a scalar per token).
        init_path: transformers-format directory of the initial weights.
        trainable: whether an optimizer is kept with it.
        optimizer: AdamW settings (``lr``, ``betas``, ``weight_decay``, ``eps``, ``grad_clip``)
            and ``OptimizerSpec``'s schedule, ``skip_nonfinite`` and ``checkpoint`` keys.
        dtype: parameter dtype name; for a trainable ``bfloat16`` model the compute dtype
            (mixed precision, fp32 parameters).
        optimizer_state: a ``torch.save``-d optimizer state to start from (a checkpoint).
        version: the version of the weights at ``init_path`` (training tasks applied).
        gradient_checkpointing: recompute the layers' activations in the backward pass
            (``rlhfflow.engine.recompute``).
        attn_implementation: transformers' attention kernel, or None for its default.
        lora: ``models.NAME.lora`` (``r``, ``alpha``, ``dropout``, ``target_modules``):
            train LoRA adapters on the weights of ``init_path`` (``engine.lora``).
        adapter_path: a checkpoint's adapters to start from (with ``lora``).
        base_of: a LoRA model whose resident base weights this frozen model is (a
            reference ``from:`` it): no copy of its own.
    """

    name: str
    head: str
    init_path: str
    trainable: bool = False
    optimizer: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    optimizer_state: str | None = None
    version: int = 0
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None
    lora: Mapping[str, Any] | None = None
    adapter_path: str | None = None
    base_of: str | None = None


class ResidentModel:
    """A loaded model, its tokenizer, its optimizer (created on first training step)
    and ``version``, the number of training tasks applied to it so far (one per training
    stage run, whatever its number of optimizer steps)."""

    def __init__(self, config: ModelConfig, module: torch.nn.Module, tokenizer: Any,
                 device: str) -> None:
        self.config = config
        self.module = module
        self.tokenizer = tokenizer
        self.device = device
        self.version = config.version
        self._optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.skipped_steps = 0  # non-finite steps skipped (optimizer.skip_nonfinite)
        self.last_lr = 0.0  # the learning rate of the last optimizer step taken
        # fp16 mixed precision: the loss scaler, and the steps it skipped on overflow
        self.scaler: torch.amp.GradScaler | None = None
        self.overflow_steps = 0
        self.engine = None  # a DeepSpeed engine, when a stage trains it with DeepSpeed
        # sharded over a gang (FSDP2, ``use_fsdp``): this process's rank, else None
        self.shard_rank: int | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters with its learning-rate schedule, created on
        first use; from a checkpoint's state when there is one (a checkpoint saved without
        the optimizer restores the schedule's position and a fresh AdamW)."""
        if self._optimizer is None:
            if not self.config.trainable:
                raise RuntimeError(f"model {self.config.name!r} is not trainable")
            opt = dict(self.config.optimizer)
            params = [p for p in self.module.parameters() if p.requires_grad]
            # torch's fused kernel: one pass over each tensor instead of a dozen ops per
            # tensor. Measured per step on one CPU thread: 0.69 -> 0.20 ms (the 2-layer
            # tiny model), 23.6 -> 5.7 ms (6 layers, 256 wide); same update up to float
            # rounding. CPU and CUDA have it.
            fused = torch.device(self.device).type in ("cpu", "cuda") and all(
                p.is_floating_point() for p in params)
            self._optimizer = torch.optim.AdamW(
                params, lr=opt.get("lr", 1e-5), betas=tuple(opt.get("betas", (0.9, 0.999))),
                weight_decay=opt.get("weight_decay", 0.0), eps=opt.get("eps", 1e-8),
                fused=fused or None)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self._optimizer, functools.partial(
                    lr_factor, schedule=opt.get("schedule", "constant"),
                    warmup_steps=opt.get("warmup_steps", 0),
                    total_steps=opt.get("total_steps"),
                    min_lr_ratio=opt.get("min_lr_ratio", 0.0)))
            if self.config.dtype == "float16":
                self.scaler = torch.amp.GradScaler(torch.device(self.device).type)
            saved = self.config.optimizer_state
            if saved and self.shard_rank is not None:  # each rank its own part
                saved = str(zero_shard_path(saved, self.shard_rank))
            if saved and Path(saved).is_file():  # resuming: moments and steps as saved
                state = torch.load(saved, map_location=self.device, weights_only=True)
                if state.get("format") != _OPTIMIZER_FORMAT:  # a bare AdamW state
                    state = {"optimizer": state, "scheduler": None, "skipped_steps": 0}
                if state["optimizer"] is not None:
                    self._optimizer.load_state_dict(state["optimizer"])
                if state["scheduler"] is not None:
                    self.scheduler.load_state_dict(state["scheduler"])
                if state.get("scaler") and self.scaler is not None:
                    self.scaler.load_state_dict(state["scaler"])
                self.skipped_steps = int(state.get("skipped_steps", 0))
                if self.shard_rank is not None:
                    self._shard_moments()
        return self._optimizer

    def _shard_moments(self) -> None:
        """A sharded model's loaded AdamW moments (saved as this rank's parts) laid out
        as its parameters again."""
        from rlhfflow.engine.parallel import like_shard

        for param, state in self._optimizer.state.items():
            for key, value in state.items():
                state[key] = like_shard(value, param)

    @property
    def sharded(self) -> bool:
        """Whether the weights, gradients and optimizer state are sharded over a gang."""
        return self.shard_rank is not None

    def use_fsdp(self, gang) -> None:
        """Shard the weights (and from now on the gradients and optimizer state) over
        ``gang`` with FSDP2 (``engine.parallel.shard_module``); a checkpoint's optimizer
        part of this rank is loaded when there is one. Every rank calls it at once."""
        from rlhfflow.engine.parallel import shard_module

        if self._optimizer is not None:
            raise RuntimeError(f"model {self.config.name!r} took steps unsharded")
        # FSDP gathers a layer's weights in hooks around the module calls, which the
        # lean forward's loop skips: the model goes back to transformers' forward
        lean.disable(self.module)
        shard_module(self.module, gang)
        self.shard_rank = gang.rank
        self.optimizer  # noqa: B018 - created on the shards (and loaded) now
    def _nonfinite(self, what: str) -> None:
        """Count a step with a non-finite ``what`` (the caller skips it); raise once the
        budget ``optimizer.skip_nonfinite`` is spent."""
        self.skipped_steps += 1
        budget = int(self.config.optimizer.get("skip_nonfinite", 0))
        if self.skipped_steps > budget:
            step = self.scheduler.last_epoch if self.scheduler is not None else 0
            raise NonFiniteError(
                f"model {self.config.name!r}: {what} at optimizer step {step} (non-finite "
                f"steps so far: {self.skipped_steps}, optimizer.skip_nonfinite: {budget}); "
                f"lower optimizer.lr, or let optimizer.skip_nonfinite skip such steps")

    def use_deepspeed(self, zero_stage: int, extra: Mapping[str, Any], rank: int) -> None:
        """Train from now on through a DeepSpeed engine (ZeRO ``zero_stage``) wrapping
        the module and its AdamW, on this process's gang; a checkpoint's ZeRO optimizer
        shard of ``rank`` is loaded when there is one."""
        from rlhfflow.engine.parallel import deepspeed_engine

        self.engine = deepspeed_engine(self.module, self.optimizer, zero_stage,
                                       self.config.optimizer.get("grad_clip"), dict(extra),
                                       self.device)
        shard = self.config.optimizer_state and zero_shard_path(self.config.optimizer_state,
                                                                rank)
        if shard and shard.is_file():
            state = torch.load(shard, map_location=self.device, weights_only=False)
            if isinstance(state, dict) and state.get("format") == _OPTIMIZER_FORMAT:
                if state["scheduler"] is not None:
                    self.scheduler.load_state_dict(state["scheduler"])
                state = state["optimizer"]
            self.engine.optimizer.load_state_dict(state)

    def step(self, loss: torch.Tensor, gang=None) -> float:
        """Backward, (all-reduce gradients over ``gang``,) clip gradients, one optimizer
        step; returns the gradient norm. ``loss`` is this rank's share of the batch loss,
        so the gang's gradients add up to the whole batch's."""
        optimizer = self.optimizer  # created (with its schedule) before the first step
        if self.sharded:
            return self._sharded_step(loss, gang, optimizer)
        bad = float(not torch.isfinite(loss.detach()).all())
        ganged = gang is not None and gang.size > 1
        # the ranks of a gang must skip (or stop) together: one rank leaving the step
        # alone would leave the others waiting in the gradient all-reduce. Without
        # DeepSpeed the flag rides in that all-reduce (below); DeepSpeed's engine
        # reduces the gradients itself, so the flag gets a collective of its own first
        with_gradients = ganged and self.engine is None
        if ganged and not with_gradients:
            from rlhfflow.engine.parallel import allreduce_sum

            bad = allreduce_sum([bad], gang)[0]
        if bad and not with_gradients:
            self._nonfinite(f"loss is {float(loss.detach().float().sum())}")
            return float("nan")
        if self.engine is not None:
            # DeepSpeed averages gradients over the gang; the shares are meant to be summed
            self.engine.backward(loss * (gang.size if gang else 1))
            self.last_lr = optimizer.param_groups[0]["lr"]
            self.engine.step()
            self.scheduler.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        optimizer.zero_grad(set_to_none=True)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        clip = self.config.optimizer.get("grad_clip")
        if with_gradients:
            from rlhfflow.engine.parallel import allreduce_gradients

            params = [p for p in self.module.parameters() if p.requires_grad]
            # one collective per step, not two (each waits for the slowest rank)
            [bad_ranks] = allreduce_gradients(params, gang, [bad])
            if bad_ranks:  # every rank skips (or stops) together
                optimizer.zero_grad(set_to_none=True)
                self._nonfinite(f"loss is {float(loss.detach().float().sum())}" if bad else
                                "loss is not finite on another rank of the gang")
                return float("nan")
        else:
            params = [p for p in self.module.parameters() if p.grad is not None]
        if self.scaler is not None:  # after the all-reduce: every rank sees the same infs
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
        if not torch.isfinite(norm):
            if self.scaler is not None:
                return self._overflow(optimizer, norm)
            optimizer.zero_grad(set_to_none=True)
            self._nonfinite(f"gradient norm is {float(norm)}")
            return float("nan")
        self.last_lr = optimizer.param_groups[0]["lr"]
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        self.scheduler.step()
        return float(norm)

    def _sharded_step(self, loss: torch.Tensor, gang, optimizer: torch.optim.Optimizer
                      ) -> float:
        """``step`` of a sharded model: FSDP reduce-scatters the gradients in the backward
        pass, each rank clips and updates its parts of the parameters."""
        from rlhfflow.engine.parallel import allreduce_sum, gathered

        # the ranks skip (or stop) together, before the backward pass's collectives
        if allreduce_sum([float(not torch.isfinite(loss.detach()).all())], gang)[0]:
            self._nonfinite(f"loss is {float(loss.detach().float().sum())}")
            return float("nan")
        optimizer.zero_grad(set_to_none=True)
        # FSDP averages the ranks' gradients; the shares are meant to be summed
        (loss * gang.size).backward()
        clip = self.config.optimizer.get("grad_clip")
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = gathered(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf")))
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            self._nonfinite(f"gradient norm is {float(norm)}")
            return float("nan")
        self.last_lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        self.scheduler.step()
        # the gradients' shards go now, not when the next step's backward begins: the
        # next forward's activations would otherwise come on top of them
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _overflow(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> float:
        """fp16: the gradients overflowed at this loss scale. The scaler skips the step
        and halves the scale (counted in ``overflow_steps``, the usual price of dynamic
        scaling); once the scale is below 1 they overflow at any scale, and that is a
        non-finite gradient like any other."""
        self.scaler.step(optimizer)  # a no-op: unscale_ found the infs
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        self.overflow_steps += 1
        if self.scaler.get_scale() < 1.0:
            self._nonfinite(f"gradient norm is {float(norm)} even at loss scale "
                            f"{self.scaler.get_scale()}")
        return float("nan")

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Where the model samples responses: no gradients, the lean forward's products
        through oneDNN, and a LoRA model with ``lora.merge_for_generation`` computes its
        adapted layers from merged weights (``lean.sampling``)."""
        with torch.no_grad(), lean.sampling(self.module, merge=self._merges()):
            yield

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Where the model takes a training step (its forward and backward passes): a
        LoRA model computes its frozen products through oneDNN and, with
        ``lora.merge_for_generation``, its adapted layers from the merged weights its
        sampling made, where they still match the adapters (``lean.training``; a model
        without adapters computes as outside)."""
        with lean.training(self.module, merged=self._merges()):
            yield

    def _merges(self) -> bool:
        """Whether this is a LoRA model that merges its adapters where it samples."""
        return self.config.lora is not None and \
            self.config.lora.get("merge_for_generation", True)

    def state_for_transfer(self) -> dict[str, torch.Tensor]:
        """The weights as CPU tensors, to send to another worker's copy (a LoRA model's
        adapters only: the base is the same everywhere); a sharded model's parts on this
        rank (``install_parts`` puts the ranks' parts together)."""
        from rlhfflow.engine.parallel import aliases, local_part

        if self.config.lora is not None:
            return lora.adapter_state(self.module)
        state = self.module.state_dict()
        tied = aliases(state)  # sent once: the receiver's copy ties them as this one does
        return {k: local_part(v).detach().to("cpu", copy=True)
                for k, v in state.items() if k not in tied}

    def install(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights with ``weights`` received from the model's home; they are
        version ``version``."""
        from rlhfflow.engine.parallel import aliases

        if self.config.lora is not None:
            lora.install_adapter_state(self.module, weights)
        else:
            own = self.module.state_dict()
            # a tied weight (an LM head that is the embedding) comes once, under the
            # first of its names: the copy here is tied the same way
            full = {**{k: weights[src] for k, src in aliases(own).items()
                       if k not in weights and src in weights}, **weights}
            with torch.no_grad():
                self.module.load_state_dict(full, strict=True)
        self.version = version

    def install_parts(self, parts: list[Mapping[str, torch.Tensor]], version: int) -> None:
        """Replace the weights with those of a model sharded over ``len(parts)`` ranks,
        ``parts[r]`` rank r's (``state_for_transfer``), one tensor put together at a
        time: no second whole copy of the weights is made here."""
        from rlhfflow.engine.parallel import aliases, assemble

        if self.config.lora is not None:  # the adapters' parts, a few MB
            return self.install({k: assemble([p[k] for p in parts]) for k in parts[0]}, version)
        own = self.module.state_dict()
        tied = aliases(own)  # put together once, under the first of their names
        if set(own) - set(tied) != set(parts[0]):
            missing = sorted((set(own) - set(tied)) ^ set(parts[0]))
            raise KeyError(f"model {self.config.name!r}: sharded weights do not match the "
                           f"copy here ({', '.join(missing[:3])} ...)")
        with torch.no_grad():
            for name, target in own.items():
                if name not in tied:
                    target.copy_(assemble([p[name] for p in parts]))
        self.version = version

    def save(self, path: str | Path) -> None:
        """Save what a checkpoint keeps (atomically): weights and tokenizer in
        transformers format, or a LoRA model's adapters in peft's format."""
        if self.config.lora is not None:
            lora.save_adapter(self.module, self.tokenizer, path, sharded=self.sharded)
        else:
            self.export(path)

    def export(self, path: str | Path) -> None:
        """Save the model as users deploy it, in transformers format (atomically): a
        LoRA model with its adapters merged into a copy of the weights. A sharded model
        is gathered one tensor at a time on every rank (each rank calls this at once)
        and rank 0 saves it; a sharded LoRA model's adapters are gathered and merged into
        the base weights reloaded on rank 0 (``lora.export_sharded``)."""
        from rlhfflow.engine.models import save_model

        if self.sharded and self.config.lora is not None:
            return lora.export_sharded(self.module, self.tokenizer, path, self.config,
                                       self.device)
        if self.sharded:
            state = self._gathered_state()
            if self.shard_rank == 0:
                save_model(self.module, self.tokenizer, path, state_dict=state)
            return
        module = self.module
        if self.config.lora is not None:
            module = lora.merged_copy(self.module)
        save_model(module, self.tokenizer, path)

    def _gathered_state(self) -> dict[str, torch.Tensor]:
        """A sharded model's whole weights on rank 0 (CPU tensors; tied weights one
        tensor, as transformers saves them), empty on the other ranks."""
        from rlhfflow.engine.parallel import gathered

        whole: dict[int, torch.Tensor] = {}
        state = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if id(tensor) not in whole:
                full = gathered(tensor.detach())
                whole[id(tensor)] = full.cpu() if self.shard_rank == 0 else full[:0]
            state[name] = whole[id(tensor)]
        return state if self.shard_rank == 0 else {}

    def save_optimizer(self, path: str | Path, rank: int = 0) -> None:
        """Save the optimizer state (created now if no step was taken yet) with the
        schedule's position; a DeepSpeed engine's ZeRO shard of ``rank``, or a sharded
        model's part of the moments on ``rank``, goes to ``zero_shard_path(path, rank)``. With ``optimizer.checkpoint: false`` only the
        schedule's position and the skip count are saved (a few bytes)."""
        path = Path(path)
        keep = self.config.optimizer.get("checkpoint", True) is not False
        moments = None
        if self.engine is not None:
            if keep:
                path, moments = zero_shard_path(path, rank), self.engine.optimizer.state_dict()
            elif rank != 0:
                return
        elif self.sharded:
            if keep:
                path, moments = zero_shard_path(path, rank), self._local_moments()
            elif rank != 0:
                return
        elif keep:
            moments = self.optimizer.state_dict()
        self.optimizer  # noqa: B018 - creates the schedule when no step was taken yet
        state = {"format": _OPTIMIZER_FORMAT, "optimizer": moments,
                 "scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps,
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        staged = path.with_name(path.name + ".tmp")
        try:
            torch.save(state, staged)
        except RuntimeError:
            # torch's zip writer reports a full disk as a RuntimeError about positions
            if shutil.disk_usage(path.parent).free < 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device", str(staged)) from None
            raise
        staged.replace(path)


    def _local_moments(self) -> dict[str, Any]:
        """A sharded model's AdamW state with this rank's parts of the moments."""
        from rlhfflow.engine.parallel import local_part

        state = self.optimizer.state_dict()
        state["state"] = {i: {k: local_part(v) for k, v in s.items()}
                          for i, s in state["state"].items()}
        return state


def zero_shard_path(path: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its ZeRO optimizer shard next to ``path``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.zero-rank{rank}{path.suffix}")


class ModelStore:
    """The models of one process, loaded lazily by name and never reloaded.

    ``loads`` counts loads per model so tests (and the dashboard) can check residency.
    """

    def __init__(self, configs: Mapping[str, ModelConfig], device: str = "cpu") -> None:
        self.configs = dict(configs)
        self.device = device
        self.models: dict[str, ResidentModel] = {}
        self.loads: dict[str, int] = {}
        self.load_seconds: dict[str, float] = {}
        # reentrant: loading a base view gets the LoRA model it shares first
        self._lock = threading.RLock()

    def get(self, name: str) -> ResidentModel:
        """The resident model ``name``, loading it from ``init_path`` on first use."""
        with self._lock:
            if name not in self.models:
                if name not in self.configs:
                    raise KeyError(f"unknown model {name!r}; known: {', '.join(self.configs)}")
                self.models[name] = self._load(self.configs[name])
            return self.models[name]

    def _load(self, config: ModelConfig) -> ResidentModel:
        from rlhfflow.engine.models import load_model  # transformers: only when loading

        start = time.perf_counter()
        if config.base_of is not None:
            return self._base_view(config, start)
        mixed = config.trainable and config.dtype != "float32"
        module, tokenizer = load_model(config.init_path, config.head, device=self.device,
                                       torch_dtype=torch.float32 if mixed
                                       else DTYPES[config.dtype],
                                       attn_implementation=config.attn_implementation)
        if config.lora is not None:  # before lean: peft's layers replace the Linears
            for p in module.parameters():
                p.requires_grad_(False)
            module = lora.apply_lora(module, config.lora, config.head, config.name)
            if config.adapter_path:
                lora.load_adapter(module, config.adapter_path)
        if mixed:  # fp32 master weights, computing in the configured dtype
            autocast_forward(module, self.device, DTYPES[config.dtype])
        else:  # the same arithmetic without transformers' per-call Python
            lean.enable(module)
        if config.gradient_checkpointing:
            recompute.enable(module)
        module.train(False)
        if config.lora is None:
            for p in module.parameters():
                p.requires_grad_(config.trainable)
        self.loads[config.name] = self.loads.get(config.name, 0) + 1
        self.load_seconds[config.name] = time.perf_counter() - start
        return ResidentModel(config, module, tokenizer, self.device)

    def _base_view(self, config: ModelConfig, start: float) -> ResidentModel:
        """A frozen model that is LoRA model ``config.base_of``'s base weights with the
        adapters off: a view of its resident copy (``lora.base_view``), no weights of
        its own; it is loaded here first if it is not yet."""
        owner = self.get(config.base_of)
        module = lora.base_view(owner.module)
        if config.dtype != "float32":  # the owner's fp32 master weights, autocast
            autocast_forward(module, self.device, DTYPES[config.dtype])
        else:
            lean.enable(module)
        self.loads[config.name] = self.loads.get(config.name, 0) + 1
        self.load_seconds[config.name] = time.perf_counter() - start
        return ResidentModel(config, module, owner.tokenizer, self.device)

    def update_config(self, config: ModelConfig) -> None:
        """Replace a model's config; a loaded copy with other weights (``init_path``,
        ``adapter_path``) is dropped, and with it the base views made of it."""
        with self._lock:
            old = self.configs.get(config.name)
            self.configs[config.name] = config
            if old is not None and (old.init_path, old.adapter_path) != (
                    config.init_path, config.adapter_path):
                self.models.pop(config.name, None)
                for name, other in self.configs.items():
                    if other.base_of == config.name:
                        self.models.pop(name, None)

    def loaded(self) -> dict[str, int]:
        """Versions of the models loaded in this process."""
        return {name: m.version for name, m in self.models.items()}
