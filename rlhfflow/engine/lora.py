"""LoRA adapters through ``peft`` (the ``lora`` extra): a model that trains adapters only.

A LoRA model is its base weights, frozen, plus small trainable matrices ``A`` ``[r, in]``
and ``B`` ``[out, r]`` on chosen Linear layers (``B`` starts at zero, so the model starts
as its base). What follows from the base never changing:

* **The reference is the base.** A frozen ``from:`` copy of a LoRA model is
  :func:`base_view`: the same modules and parameters with each adapted layer replaced by
  its base layer, so no second copy of the weights and no switch flipped on the shared
  model (a Dask worker runs tasks in threads; peft's ``disable_adapter()`` would turn the
  adapters off for every thread at once).
* **Only adapters move.** Shadow copies receive :func:`adapter_state` (the trainable
  parameters), checkpoints hold the adapters in peft's format (:func:`save_adapter`,
  loadable with ``PeftModel.from_pretrained``) and the ``final`` export is the merged model
  (:func:`merged_copy`), plain transformers.

Sharded over a gang (``backend: fsdp``), the base and the adapters are split alike:
each rank sends its part of the adapters, a checkpoint gathers them
(:func:`gathered_adapters`) and the final export merges them into the base reloaded on
rank 0 (:func:`export_sharded`).

A LoRA model of the default shape gets the lean forward (``engine.lean``), which
computes peft's LoRA layers itself; the base view has plain layers again and gets it like
any model.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlhfflow.storage.checkpoints import move_into_place

logger = logging.getLogger(__name__)

#: The file of an adapter checkpoint that marks a directory as one (peft's name).
ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Output heads LoRA leaves alone under ``all-linear``; a value head trains in full.
_VALUE_HEADS = ("score", "classifier")


def lora_config(lora: Mapping[str, Any], head: str):
    """peft's ``LoraConfig`` for ``models.NAME.lora`` (``r``, ``alpha``, ``dropout``,
    ``target_modules``): ``alpha`` defaults to ``2 * r``; a value head (``head ==
    "value"``, zero-initialised) trains in full beside the adapters."""
    from peft import LoraConfig

    r = int(lora["r"])
    alpha = lora.get("alpha")
    return LoraConfig(
        r=r, lora_alpha=float(alpha) if alpha is not None else 2.0 * r,
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=lora.get("target_modules", "all-linear"),
        task_type="TOKEN_CLS" if head == "value" else "CAUSAL_LM",
        modules_to_save=list(_VALUE_HEADS) if head == "value" else None)


def apply_lora(module: torch.nn.Module, lora: Mapping[str, Any], head: str,
               name: str = "") -> torch.nn.Module:
    """``module`` with LoRA adapters (peft's ``PeftModel``): only the adapters (and a
    value head) require gradients. ``A`` is drawn from ``lora["seed"]`` (default 0), not
    from the process's random stream: every copy of the model (its home, its shadows, a
    resumed run) starts from the same adapters. Raises ``ValueError`` naming the model
    when a target module is not in it."""
    from peft import get_peft_model

    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            # peft asks a deprecated gradient-checkpointing name
            warnings.simplefilter("ignore", FutureWarning)
            torch.manual_seed(int(lora.get("seed", 0)))
            wrapped = get_peft_model(module, lora_config(lora, head))
    except ValueError as exc:  # "Target modules {...} not found in the base model"
        raise ValueError(f"model {name!r}: lora.target_modules: {exc}") from None
    logger.info("model %r: LoRA r=%s on %d layers", name, lora["r"],
                sum(1 for m in wrapped.modules() if _is_adapted(m)))
    return wrapped


def is_lora(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a model with peft adapters."""
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def _is_adapted(module: torch.nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def base_view(module: torch.nn.Module) -> torch.nn.Module:
    """The base model of LoRA ``module`` without copying a weight: a new tree of the
    container modules (shallow copies) whose adapted layers are their base layers and
    whose parameters are the LoRA model's own. It is never in train mode, and nothing the
    LoRA model does later (training the adapters, switching modes) changes its output."""
    from peft.utils import ModulesToSaveWrapper

    def strip(node: torch.nn.Module) -> torch.nn.Module:
        if _is_adapted(node):
            return node.get_base_layer()
        if isinstance(node, ModulesToSaveWrapper):
            return node.original_module
        view = copy.copy(node)
        view._modules = {k: strip(child) if child is not None else None
                         for k, child in node._modules.items()}
        view.training = False
        return view

    return strip(module.get_base_model())


def adapter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of LoRA ``module`` (adapters, a value head) by name, as
    CPU copies: what a shadow copy needs, the base being the same everywhere. Of a model
    sharded over a gang (``backend: fsdp``), this rank's parts (``engine.parallel``'s
    ``assemble`` puts the ranks' parts together)."""
    from rlhfflow.engine.parallel import local_part

    return {k: local_part(p.detach()).to("cpu", copy=True)
            for k, p in module.named_parameters() if p.requires_grad}


def gathered_adapters(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole trainable parameters of LoRA ``module`` sharded over a gang, as CPU
    tensors on rank 0 and None on the others (a collective: every rank calls it at
    once); a model that is not sharded: None."""
    import torch.distributed as dist

    from rlhfflow.engine.parallel import gathered, is_sharded

    trained = {k: p for k, p in module.named_parameters() if p.requires_grad}
    if not any(is_sharded(p) for p in trained.values()):
        return None
    whole = {k: gathered(p.detach()).cpu() for k, p in trained.items()}
    return whole if dist.get_rank() == 0 else None


def install_adapter_state(module: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (from :func:`adapter_state`) into LoRA ``module``'s parameters;
    every trainable parameter must be there, and nothing else."""
    params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    if set(params) != set(weights):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(f"adapter weights do not fit the model: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    with torch.no_grad():
        for key, value in weights.items():
            params[key].copy_(value)


def save_adapter(module: torch.nn.Module, tokenizer: Any, path: str | os.PathLike,
                 sharded: bool = False) -> None:
    """Save LoRA ``module``'s adapters (peft's format: ``adapter_config.json`` and
    ``adapter_model.safetensors``) and the tokenizer into ``path``, atomically. A model
    sharded over a gang (``sharded``): every rank calls this at once, the adapters are
    gathered (a few MB) and rank 0 saves them."""
    state = None
    if sharded:
        state = gathered_adapters(module)
        if state is None:  # another rank saves
            return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        module.save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        if not (tmp / ADAPTER_CONFIG).is_file():
            raise RuntimeError(f"saving {path}: peft wrote no {ADAPTER_CONFIG}")
        move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_adapter(module: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load the adapters :func:`save_adapter` wrote in ``path`` into LoRA ``module``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(path) / _ADAPTER_WEIGHTS), device="cpu")
    result = set_peft_model_state_dict(module, weights)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"adapter checkpoint {path} does not fit the model: missing "
                         f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}")


def merged_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model with LoRA ``module``'s adapters merged into a copy of
    its weights (``W + alpha / r * B A``), as users deploy it; ``module`` is unchanged."""
    base = base_view(module)
    merged = copy.deepcopy(base)  # the base weights only: a copy of the tree above
    names = dict(merged.named_modules())
    from peft.utils import ModulesToSaveWrapper

    with torch.no_grad():
        for name, layer in module.get_base_model().named_modules():
            if not _is_adapted(layer):
                if isinstance(layer, ModulesToSaveWrapper):
                    trained = layer.modules_to_save[layer.active_adapters[0]]
                    names[name].load_state_dict(trained.state_dict())
                continue
            target = names[name]
            for adapter in layer.active_adapters:
                if adapter in getattr(layer, "lora_A", {}):
                    target.weight += layer.get_delta_weight(adapter).to(target.weight.dtype)
    return merged


def export_sharded(module: torch.nn.Module, tokenizer: Any, path: str | os.PathLike,
                   config: Any, device: str) -> None:
    """Save LoRA ``module``, sharded over a gang, as users deploy it: its adapters,
    gathered, merged into a plain copy of the frozen weights it was made from (its
    ``ModelConfig``'s ``init_path``, loaded in fp32 on rank 0 only), in place: one whole
    copy of the weights, as a sharded model's export gathers. Every rank calls this at
    once; rank 0 saves."""
    from rlhfflow.engine.models import load_model, save_model

    adapters = gathered_adapters(module)
    if adapters is None:  # another rank saves
        return
    base, _ = load_model(config.init_path, config.head, device=device)
    for p in base.parameters():
        p.requires_grad_(False)
    plain = apply_lora(base, config.lora, config.head, config.name)
    install_adapter_state(plain, adapters)
    with torch.no_grad():
        save_model(plain.merge_and_unload(), tokenizer, path)


def lora_parameter_counts(config, lora: Mapping[str, Any], head: str) -> tuple[int, int]:
    """Parameters LoRA adds to a model built from transformers ``config`` with ``head``
    (on the meta device: nothing allocated), a value head's included: what trains, moves
    to shadows and goes into checkpoints; and the parameters of the adapted layers' base
    weights: what a merged copy for generation holds (``lean.merged_adapters``). Raises
    ``ValueError`` for a target module the model lacks."""
    wrapped = _meta_lora_model(_meta_model(config, head), lora, head)
    adapters = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    adapted = sum(layer.get_base_layer().weight.numel() for layer in wrapped.modules()
                  if _is_adapted(layer))
    return adapters, adapted


def unknown_target_modules(config, lora: Mapping[str, Any], head: str
                           ) -> tuple[list[str], list[str]]:
    """The names in ``lora["target_modules"]`` (a list) that match no layer peft adapts
    in a model built from ``config`` with ``head`` (on the meta device), and the names of
    that model's Linear layers, each once: what the list could name. peft refuses a list
    none of whose names matches, but leaves out a wrong name beside a right one. Nothing
    for ``all-linear``."""
    targets = lora.get("target_modules", "all-linear")
    if not isinstance(targets, list):
        return [], []
    model = _meta_model(config, head)
    skipped = _VALUE_HEADS if head == "value" else ()
    layers = list(dict.fromkeys(
        name.rsplit(".", 1)[-1] for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"))
    layers = [name for name in layers if name not in skipped]
    try:
        wrapped = _meta_lora_model(model, lora, head)
    except ValueError:  # "Target modules {...} not found in the base model"
        return list(targets), layers
    adapted = [name for name, module in wrapped.named_modules() if _is_adapted(module)]
    return [t for t in targets
            if not any(name == t or name.endswith("." + t) for name in adapted)], layers


def _meta_model(config, head: str) -> torch.nn.Module:
    """A model built from ``config`` with ``head`` on the meta device (no memory)."""
    from rlhfflow.engine.models import as_value_config, auto_class
    from rlhfflow.engine.transformers_io import quiet_transformers

    config = copy.deepcopy(config)
    if head == "value":
        as_value_config(config)
    with torch.device("meta"), quiet_transformers():
        return auto_class(head).from_config(config)


def _meta_lora_model(model: torch.nn.Module, lora: Mapping[str, Any], head: str):
    """``model`` (on the meta device) with peft's adapters."""
    from peft import get_peft_model

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, lora_config(lora, head))
