"""Resident models: loaded once per process, kept with their optimizer and a version.

``ModelStore`` knows nothing of Dask; the executor's WorkerPlugin owns one per worker so
models stay in worker memory between tasks. Used alone, it serves stages run from Python.
"""

from __future__ import annotations

import errno
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Everything a process needs to load and train a model (resolved by the pipeline).

    Attributes:
        name: the model's name in the pipeline.
        head: ``"lm"`` (causal LM) or ``"value"`` (a scalar per token).
        init_path: transformers-format directory of the initial weights.
        trainable: whether an optimizer is kept with it.
        optimizer: AdamW settings (``lr``, ``betas``, ``weight_decay``, ``eps``, ``grad_clip``).
        dtype: parameter dtype name.
        optimizer_state: a ``torch.save``-d optimizer state to start from (a checkpoint).
        version: the version of the weights at ``init_path`` (training tasks applied).
    """

    name: str
    head: str
    init_path: str
    trainable: bool = False
    optimizer: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    optimizer_state: str | None = None
    version: int = 0


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
        self.engine = None  # a DeepSpeed engine, when a stage trains it with DeepSpeed

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters, created on first use."""
        if self._optimizer is None:
            if not self.config.trainable:
                raise RuntimeError(f"model {self.config.name!r} is not trainable")
            opt = dict(self.config.optimizer)
            self._optimizer = torch.optim.AdamW(
                [p for p in self.module.parameters() if p.requires_grad],
                lr=opt.get("lr", 1e-5), betas=tuple(opt.get("betas", (0.9, 0.999))),
                weight_decay=opt.get("weight_decay", 0.0), eps=opt.get("eps", 1e-8))
            saved = self.config.optimizer_state
            if saved and Path(saved).is_file():  # resuming: moments and steps as saved
                state = torch.load(saved, map_location=self.device, weights_only=True)
                self._optimizer.load_state_dict(state)
        return self._optimizer

    def use_deepspeed(self, zero_stage: int, extra: Mapping[str, Any], rank: int) -> None:
        """Train from now on through a DeepSpeed engine (ZeRO ``zero_stage``) wrapping
        the module and its AdamW, on this process's gang; a checkpoint's ZeRO optimizer
        shard of ``rank`` is loaded when there is one."""
        from rlhfflow.stages.parallel import deepspeed_engine

        self.engine = deepspeed_engine(self.module, self.optimizer, zero_stage,
                                       self.config.optimizer.get("grad_clip"), dict(extra),
                                       self.device)
        shard = self.config.optimizer_state and zero_shard_path(self.config.optimizer_state,
                                                                rank)
        if shard and shard.is_file():
            self.engine.optimizer.load_state_dict(
                torch.load(shard, map_location=self.device, weights_only=False))

    def step(self, loss: torch.Tensor, gang=None) -> float:
        """Backward, (all-reduce gradients over ``gang``,) clip gradients, one optimizer
        step; returns the gradient norm. ``loss`` is this rank's share of the batch loss,
        so the gang's gradients add up to the whole batch's."""
        if self.engine is not None:
            # DeepSpeed averages gradients over the gang; the shares are meant to be summed
            self.engine.backward(loss * (gang.size if gang else 1))
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = self.config.optimizer.get("grad_clip")
        if gang is not None and gang.size > 1:
            from rlhfflow.stages.parallel import allreduce_gradients

            params = [p for p in self.module.parameters() if p.requires_grad]
            allreduce_gradients(params, gang)
        else:
            params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
        self.optimizer.step()
        return float(norm)

    def state_for_transfer(self) -> dict[str, torch.Tensor]:
        """The weights as CPU tensors, to send to another worker's copy."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def install(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights with ``weights`` received from the model's home; they are
        version ``version``."""
        with torch.no_grad():
            self.module.load_state_dict(dict(weights), strict=True)
        self.version = version

    def save(self, path: str | Path) -> None:
        """Save weights and tokenizer in transformers format (atomically)."""
        from rlhfflow.stages.models import save_model

        save_model(self.module, self.tokenizer, path)

    def save_optimizer(self, path: str | Path, rank: int = 0) -> None:
        """Save the optimizer state (created now if no step was taken yet); a DeepSpeed
        engine's ZeRO shard of ``rank`` goes to ``zero_shard_path(path, rank)``."""
        path = Path(path)
        if self.engine is not None:
            path, state = zero_shard_path(path, rank), self.engine.optimizer.state_dict()
        else:
            state = self.optimizer.state_dict()
        staged = path.with_name(path.name + ".tmp")
        try:
            torch.save(state, staged)
        except RuntimeError:
            # torch's zip writer reports a full disk as a RuntimeError about positions
            if shutil.disk_usage(path.parent).free < 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device", str(staged)) from None
            raise
        staged.replace(path)


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
        self._lock = threading.Lock()

    def get(self, name: str) -> ResidentModel:
        """The resident model ``name``, loading it from ``init_path`` on first use."""
        with self._lock:
            if name not in self.models:
                if name not in self.configs:
                    raise KeyError(f"unknown model {name!r}; known: {', '.join(self.configs)}")
                self.models[name] = self._load(self.configs[name])
            return self.models[name]

    def _load(self, config: ModelConfig) -> ResidentModel:
        from rlhfflow.stages.models import load_model  # transformers: only when loading

        start = time.perf_counter()
        module, tokenizer = load_model(config.init_path, config.head,
                                       torch_dtype=DTYPES[config.dtype], device=self.device)
        module.train(False)
        for p in module.parameters():
            p.requires_grad_(config.trainable)
        self.loads[config.name] = self.loads.get(config.name, 0) + 1
        self.load_seconds[config.name] = time.perf_counter() - start
        return ResidentModel(config, module, tokenizer, self.device)

    def update_config(self, config: ModelConfig) -> None:
        """Replace a model's config; a loaded copy with another ``init_path`` is dropped."""
        with self._lock:
            old = self.configs.get(config.name)
            self.configs[config.name] = config
            if old is not None and old.init_path != config.init_path:
                self.models.pop(config.name, None)

    def loaded(self) -> dict[str, int]:
        """Versions of the models loaded in this process."""
        return {name: m.version for name, m in self.models.items()}
