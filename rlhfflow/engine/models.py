"""Tiny, local, transformers-format models and tokenizers for rlhfflow stages.

Every model here is an ordinary transformers checkpoint directory (``save_pretrained``), so users
load their own checkpoints the same way and anyone can load ours with plain transformers.

Two heads are supported:

* ``"lm"``: a causal language model (``AutoModelForCausalLM``), used for actors, SFT and
  reference policies.
* ``"value"``: a scalar per token (``AutoModelForTokenClassification`` with ``num_labels=1``,
  e.g. ``LlamaForTokenClassification``), used for critics and reward models. Its logits
  ``[B, T, 1]`` are the per-token values; a reward model's score for a sequence is its value at
  the last non-pad token (:func:`sequence_scores`).

Nothing is ever downloaded: tokenizers are built from an alphabet with the ``tokenizers``
library and models from a config with random weights.

KV-cache decoding with transformers 5.x (checked against 5.23 and 5.24, see
``tests/engine/test_models.py::test_kv_cache_matches_full_forward``): no helper is needed. For a
left-padded batch, the plain forward call works (5.24 renamed ``past_key_values`` to
``cache``, in the call and in its output; the old name warns and goes in 5.40, and
``rlhfflow.engine.forward.cache_kwargs`` / ``output_cache`` take whichever the installed
version has)::

    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                cache=cache, use_cache=True)
    # then one token at a time, with the *whole* mask so far and only the new position:
    mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
    out = model(input_ids=next_ids[:, None], attention_mask=mask,
                position_ids=position_ids_from_mask(mask)[:, -1:],
                cache=out.cache, use_cache=True)

The step logits match a single full forward over the whole sequence (same mask and positions)
to well under 1e-4, and the left-padded row decodes the same tokens as the same prompt alone.
``model.generate`` also works on left-padded input; it derives the position ids from the mask.
"""

from __future__ import annotations

import copy
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rlhfflow.engine.hub import local_model_dir
from rlhfflow.engine.transformers_io import (
    apply_umask,
    make_tokenizer_config_portable,
    quiet_transformers,
    realign_cpu_tensors,
    save_on_any_rank,
    skip_deepspeed_unwrap,
)
from rlhfflow.storage.checkpoints import move_into_place

# transformers' model classes (and even LlamaConfig) import torch._dynamo, DTensor and
# accelerate: ~2.5 s of CPU that a process which only tokenizes prompts and plans (the
# coordinator of a run, `rlhfflow validate`) never needs. They are imported where used.
if TYPE_CHECKING:
    from transformers import (
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

__all__ = [
    "DEFAULT_ALPHABET",
    "HEADS",
    "build_char_tokenizer",
    "build_tiny_model",
    "count_parameters",
    "load_model",
    "matmul_parameters",
    "position_ids_from_mask",
    "save_model",
    "save_tiny_model",
    "sequence_scores",
    "tiny_config",
    "tiny_matmul_parameters",
    "tiny_parameter_count",
    "value_head_forward",
]

#: Characters the default tokenizer knows, one token each; anything else maps to ``<unk>``.
DEFAULT_ALPHABET: str = string.ascii_lowercase + string.digits + " .,!?:;'-"

#: Model heads understood by :func:`build_tiny_model` and :func:`load_model`.
HEADS: tuple[str, ...] = ("lm", "value")

# Special tokens come first so their ids are stable whatever the alphabet: pad is id 0.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
_SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Any one of these marks a directory as holding a tokenizer AutoTokenizer can load.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer locally, with no download.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then one id per character of
    ``alphabet`` in order. Encoding gives exactly one id per input character (spaces included)
    and adds no BOS/EOS: callers add those themselves where they want them. Characters outside
    the alphabet become ``<unk>``; as with any transformers tokenizer, the literal text of a
    special token (e.g. ``"<eos>"``) encodes to that token. Decoding concatenates the characters with nothing in between,
    so ``decode(encode(s), skip_special_tokens=True) == s`` for any ``s`` over the alphabet.
    ``padding_side`` is ``"right"``; set ``tokenizer.padding_side = "left"`` for generation.
    """
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # drop duplicates, keep order
    if not chars:
        raise ValueError("alphabet must not be empty")
    vocab = {tok: i for i, tok in enumerate([*_SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split every character (newlines too, hence [\s\S] rather than ".") into its own word.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # The default WordLevel decoding joins tokens with spaces; Fuse joins them with nothing.
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="right",
        # Cleanup would turn "a ." into "a." and break the exact round trip.
        clean_up_tokenization_spaces=False,
    )


def tiny_config(
    tokenizer: PreTrainedTokenizerBase,
    *,
    arch: str = "llama",
    n_layer: int = 2,
    hidden: int = 64,
    n_head: int = 4,
    max_positions: int = 128,
) -> PretrainedConfig:
    """Return a small ``LlamaConfig`` (``arch="llama"``) or ``GPT2Config`` (``arch="gpt2"``).

    The vocabulary size and pad/bos/eos ids come from ``tokenizer``. All dropout, including the
    value head's ``classifier_dropout``, is 0 so that forward passes are deterministic. Llama uses
    ``intermediate_size = 4 * hidden``, full multi-head attention (``num_key_value_heads =
    n_head``), default RoPE and untied input/output embeddings.
    """
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "classifier_dropout": 0.0,
    }
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            num_key_value_heads=n_head,
            max_position_embeddings=max_positions,
            attention_dropout=0.0,
            # Untied so an actor's output layer trains independently of its input embeddings,
            # as in most Llama checkpoints; it costs vocab * hidden parameters, tiny here.
            tie_word_embeddings=False,
            **ids,
        )
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            n_embd=hidden,
            n_layer=n_layer,
            n_head=n_head,
            n_positions=max_positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            **ids,
        )
    raise ValueError(f"unknown arch {arch!r}; expected 'llama' or 'gpt2'")


def tiny_parameter_count(
    tokenizer: PreTrainedTokenizerBase,
    head: str = "lm",
    *,
    arch: str = "llama",
    n_layer: int = 2,
    hidden: int = 64,
    max_positions: int = 128,
) -> int:
    """Parameters of the model :func:`build_tiny_model` builds from these arguments, counted
    from the shapes of :func:`tiny_config` instead of building it: the coordinator plans
    tiny models without importing transformers' model classes (``parameter_bytes`` agrees,
    ``tests/engine/test_models.py``). Llama: untied embeddings, 4x MLP (gate, up, down), two norms
    per layer; GPT-2: tied embeddings, learned positions, biases. A value head is one
    output with a bias."""
    vocab, h = len(tokenizer), hidden
    if arch == "llama":
        body = vocab * h + n_layer * (4 * h * h + 3 * h * 4 * h + 2 * h) + h
        output = vocab * h
    elif arch == "gpt2":
        # per layer: two layer norms, qkv and output projections, the 4x MLP (with biases)
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
        body = vocab * h + max_positions * h + n_layer * layer + 2 * h
        output = 0  # tied to the input embeddings
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'llama' or 'gpt2'")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")
    return body + (output if head == "lm" else h + 1)


def tiny_matmul_parameters(tokenizer: PreTrainedTokenizerBase, head: str = "lm", *,
                           arch: str = "llama", n_layer: int = 2, hidden: int = 64) -> int:
    """The matrix weights a token's activations are multiplied by in a forward of the model
    :func:`build_tiny_model` builds (what :func:`matmul_parameters` counts on the built
    model): per layer the attention projections (4 h^2) and the 4x MLP (Llama's gate, up
    and down: 12 h^2; GPT-2's two: 8 h^2), then the output head (the LM head, tied or
    not: vocab x h; a value head: h)."""
    h = hidden
    if arch not in ("llama", "gpt2"):
        raise ValueError(f"unknown arch {arch!r}; expected 'llama' or 'gpt2'")
    layer = 4 * h * h + (12 if arch == "llama" else 8) * h * h
    return n_layer * layer + (len(tokenizer) * h if head == "lm" else h)


def matmul_parameters(config: PretrainedConfig, head: str) -> int:
    """The matrix weights a token's activations are multiplied by in one forward of a model
    built from ``config`` with ``head``: the weights of its linear layers (``nn.Linear``,
    GPT-2's ``Conv1D``), the output head included even where it is tied to the input
    embedding; the embedding lookups, norms and biases are not matrix products. Counted
    on the meta device."""
    from transformers.pytorch_utils import Conv1D

    config = copy.deepcopy(config)
    if head == "value":
        as_value_config(config)
    with torch.device("meta"), quiet_transformers():
        model = auto_class(head).from_config(config, dtype=torch.float32)
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear | Conv1D))


def auto_class(head: str) -> type:
    """Map a head name to the transformers Auto class that builds or loads it."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if head == "lm":
        return AutoModelForCausalLM
    if head == "value":
        return AutoModelForTokenClassification
    raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")


def as_value_config(config: PretrainedConfig) -> PretrainedConfig:
    """Make ``config`` describe a one-output token-classification (value) model, in place."""
    config.num_labels = 1
    # Without an explicit value transformers falls back to 0.1 dropout before the value head,
    # which makes critics and reward models non-deterministic in train mode.
    if getattr(config, "classifier_dropout", None) is None:
        config.classifier_dropout = 0.0
    return config


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, head: str = "lm", seed: int = 0, **config_kwargs
) -> PreTrainedModel:
    """Build a float32 model with random weights from :func:`tiny_config`.

    ``config_kwargs`` go to :func:`tiny_config` (``arch``, ``n_layer``, ...). The weights depend
    only on ``seed`` and the config: the same seed gives identical weights. The global torch RNG
    is left as it was. The model is left in whatever mode transformers builds it (train mode).
    """
    model_class = auto_class(head)
    config = tiny_config(tokenizer, **config_kwargs)
    if head == "value":
        as_value_config(config)
    # fork_rng restores the caller's RNG afterwards, so building a model never shifts the
    # random stream of whatever else the process is doing (data shuffling, sampling, ...).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class.from_config(config, dtype=torch.float32)


def save_tiny_model(path: str | os.PathLike, head: str = "lm", seed: int = 0,
                    **config_kwargs) -> None:
    """Build a tiny model (:func:`build_tiny_model`) with the character tokenizer and save
    both into ``path`` (:func:`save_model`). A run does it as a task on a worker, whose
    process imported transformers' model classes already."""
    tokenizer = build_char_tokenizer()
    save_model(build_tiny_model(tokenizer, head, seed=seed, **config_kwargs), tokenizer, path)


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save ``model`` and ``tokenizer`` (safetensors) into the directory ``path``, atomically;
    ``state_dict``: the weights to save instead of the module's own (a sharded model's,
    gathered).

    Everything is written to a hidden temporary sibling directory first and renamed into place,
    so a crash never leaves a half-written directory at ``path`` that looks like a valid model.
    An existing ``path`` is replaced: it is renamed away, the new one renamed in, and the old
    one deleted. (A crash between those two renames leaves ``path`` missing, never partial.)
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"model path {path} exists and is not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory, so the renames below stay on one filesystem and are atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        skip_deepspeed_unwrap()
        with quiet_transformers(), save_on_any_rank(model):
            # Always safetensors: transformers 5 has no other format (4.x defaults to it).
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").is_file():
            raise RuntimeError(f"saving {path}: transformers wrote no config.json")
        make_tokenizer_config_portable(tmp)
        apply_umask(tmp)
        move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_model_dir(path: Path) -> None:
    """Raise a clear error unless ``path`` is a transformers model directory with a tokenizer."""
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a transformers-format model directory (no config.json)")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"model directory {path} has no tokenizer files (expected one of {_TOKENIZER_FILES})"
        )


def attention_implementations() -> tuple[str, ...]:
    """The ``attn_implementation`` values the installed transformers accepts."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ("eager", *(k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if k != "eager"))


def _load_weights(
    path: Path, head: str, torch_dtype: torch.dtype, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, dict[str, list[str]]]:
    """Load ``path`` with the Auto class of ``head``; return the model and its loading info."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if head == "value":
        as_value_config(config)
    kwargs = {"config": config, "dtype": torch_dtype, "output_loading_info": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with quiet_transformers():
            return auto_class(head).from_pretrained(path, **kwargs)
    except RuntimeError:
        # Size mismatches and the like raise "see the report above", but we hid the report:
        # load again loudly so the user gets transformers' explanation along with the error.
        return auto_class(head).from_pretrained(path, **kwargs)


def _check_missing_weights(
    model: PreTrainedModel, head: str, path: Path, missing: list[str]
) -> None:
    """Zero-init a freshly created value head; refuse any other weight missing from the file.

    A value head missing from the checkpoint means an LM checkpoint is being loaded as a critic
    or reward model: the backbone comes from the LM and the head starts at zero, so the initial
    values are exactly 0 and deterministic (a common critic initialisation). Anything else
    missing (the backbone, or an LM head when loading a value checkpoint as ``"lm"``) would be
    silently random, so it is an error.
    """
    backbone = f"{model.base_model_prefix}."
    head_keys = [k for k in missing if not k.startswith(backbone)]
    if head == "value" and len(head_keys) == len(missing):
        with torch.no_grad():
            for key in head_keys:
                model.get_parameter(key).zero_()
        return
    if missing:
        raise ValueError(
            f"checkpoint {path} cannot be loaded with head {head!r}: missing {missing}"
        )


def load_model(
    path: str | os.PathLike,
    head: str = "lm",
    *,
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    init_from: str | os.PathLike | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a transformers-format model directory and its tokenizer.

    ``head`` picks the Auto class (``"lm"`` causal LM, ``"value"`` one-output token
    classification). An LM checkpoint can be loaded as ``"value"``: the backbone weights are
    the LM's, its output layer is dropped and the value head is zero-initialised.
    ``init_from`` is a fallback directory used when ``path`` does not exist yet, e.g. a critic
    whose own checkpoint has not been written is initialised from the SFT model. The model
    comes back in eval mode (as transformers returns it) on ``device``, in ``torch_dtype``.
    ``path`` may be a Hub id (``org/name[@revision]``), found in this process's Hugging Face
    cache (:func:`rlhfflow.engine.hub.hub_snapshot`). ``attn_implementation`` picks
    transformers' attention kernel (``eager``, ``sdpa``, ...; None: its default).

    Raises ``FileNotFoundError`` for a missing ``path`` or an uncached Hub id, and ``ValueError`` for a directory with
    no ``config.json``, no tokenizer files, or weights that do not fit ``head``.
    """
    use_init = init_from is not None and not Path(path).exists()
    auto_path = local_model_dir(init_from if use_init else path)
    auto_class(head)  # fail on a bad head before touching the disk
    _check_model_dir(auto_path)
    model, info = _load_weights(auto_path, head, torch_dtype, attn_implementation)
    _check_missing_weights(model, head, auto_path, list(info["missing_keys"]))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(auto_path)
    return realign_cpu_tensors(model.to(device)), tokenizer


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: ``cumsum(mask) - 1``, clipped at 0.

    With left padding this gives every sequence positions 0, 1, ... from its first real token,
    exactly as if it were unpadded; pad positions get 0 (they are masked anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def value_head_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token values ``[B, T]`` of a value model (its logits ``[B, T, 1]`` squeezed).

    ``position_ids`` default to :func:`position_ids_from_mask`, so values do not depend on
    whether a batch is left- or right-padded (transformers would otherwise number positions
    from the first pad). Values at pad positions are meaningless.
    """
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.logits[..., 0]


def sequence_scores(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Reward-model score per sequence ``[B]``: the value at the last non-pad token.

    The last position where ``attention_mask == 1`` is found per row, so left and right padding
    both work. Raises ``ValueError`` if a row has no real token at all.
    """
    values = value_head_forward(model, input_ids, attention_mask)
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    last = torch.where(attention_mask.bool(), positions, -1).amax(dim=-1)
    if bool((last < 0).any()):
        raise ValueError("sequence_scores: a row of attention_mask has no non-pad token")
    return values.gather(-1, last[:, None]).squeeze(-1)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters in ``model`` (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(config: PretrainedConfig, head: str, dtype: torch.dtype = torch.float32
                    ) -> int:
    """Bytes of the parameters of a model built from ``config`` with ``head``, counted on
    the meta device (no memory allocated, so it is cheap for any model size)."""
    config = copy.deepcopy(config)
    if head == "value":
        as_value_config(config)
    with torch.device("meta"), quiet_transformers():
        model = auto_class(head).from_config(config, dtype=dtype)
    return count_parameters(model) * torch.empty((), dtype=dtype).element_size()


def model_config(path: str | Path) -> PretrainedConfig:
    """The transformers config of the model saved in ``path``."""
    from transformers import AutoConfig

    with quiet_transformers():
        return AutoConfig.from_pretrained(str(path))
