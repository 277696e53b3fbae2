"""What saving and loading a model through transformers needs around it, apart from
``rlhfflow.engine.models`` (which says what a model directory holds): saves that import
no DeepSpeed and write on any rank, with the user's umask and a tokenizer config that
transformers 4.x loads too; loads without transformers' report and progress bars, with
CPU weights copied to aligned memory (bitwise as the model saved).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# With accelerate installed (the `models` extra), transformers imports DeepSpeed's
# integration, and DeepSpeed prints a warning on every import in every process of a
# machine without a GPU that it chose the CPU. Saying so up front keeps runs quiet.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"
from transformers.utils import logging as hf_logging

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def skip_deepspeed_unwrap() -> None:
    """Keep ``save_pretrained`` from importing DeepSpeed. It unwraps the model with
    accelerate's ``extract_model_from_parallel``, which imports DeepSpeed whenever it is
    installed only to ask ``isinstance(model, DeepSpeedEngine)``: 1 s of CPU, 4 s with
    MLflow installed (DeepSpeed's autotuner imports it), in the coordinator's first save
    of a tiny model and in every worker's first checkpoint. No object is a DeepSpeed
    engine unless DeepSpeed was imported, so asking whether it was gives the same answer
    (idempotent; a module attribute, set once)."""
    try:
        from accelerate.utils import other
    except ImportError:  # no accelerate: transformers unwraps by itself, without DeepSpeed
        return
    if getattr(other, "is_deepspeed_available", None) is not _deepspeed_imported:
        other.is_deepspeed_available = _deepspeed_imported


def _deepspeed_imported() -> bool:
    return "deepspeed" in sys.modules


@contextmanager
def save_on_any_rank(model: PreTrainedModel) -> Iterator[None]:
    """Let ``save_pretrained`` write on any torch.distributed rank: transformers 5 silently
    writes only the tokenizer on ranks other than 0, and every worker of a gang (or one
    that was in one) may be the one saving its copy."""
    if not hasattr(model, "should_save_on_this_rank"):
        yield
        return
    model.should_save_on_this_rank = lambda is_main_process=True: True
    try:
        yield
    finally:
        del model.should_save_on_this_rank


def apply_umask(directory: Path) -> None:
    """mkdtemp (and some writers) create private files; a saved model should get the
    ordinary permissions of the user's umask, like any directory they create."""
    umask = _current_umask()
    directory.chmod(0o777 & ~umask)
    for item in directory.rglob("*"):
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


def _current_umask() -> int:
    # os.umask can only be read by setting it, which races with other threads (a Dask
    # worker has several): read it from /proc where there is one
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def make_tokenizer_config_portable(directory: Path) -> None:
    """Name the tokenizer class so transformers 4.x can load it too.

    transformers 5 saves a plain ``tokenizers``-backed tokenizer as ``"TokenizersBackend"``, a
    class 4.x does not know; ``"PreTrainedTokenizerFast"`` loads the same file in both.
    """
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# Loading an LM checkpoint as a value model is expected to leave the value head "missing";
# transformers 5 logs a load-report table for it, and progress bars on every save and load.
# Both are process-global switches, so a counter lets concurrent loads (e.g. Dask worker
# threads) share one quiet spell. The report is dropped with a logging filter rather than by
# raising the logger's level: transformers 5.23 runs a tensor-parallel plan check, which warns
# "The following layers were not sharded", exactly when that logger's level is >= WARNING.
_quiet_lock = threading.Lock()
_quiet_depth = 0
_bars_were_enabled = True


def _drop_below_error(record: logging.LogRecord) -> bool:
    """Logging filter that keeps only errors."""
    return record.levelno >= logging.ERROR


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' weight-loading report and progress bars, restoring them after."""
    global _quiet_depth, _bars_were_enabled
    loader_logger = hf_logging.get_logger("transformers.modeling_utils")
    with _quiet_lock:
        if _quiet_depth == 0:
            _bars_were_enabled = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
            loader_logger.addFilter(_drop_below_error)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                loader_logger.removeFilter(_drop_below_error)
                if _bars_were_enabled:
                    hf_logging.enable_progress_bar()


def realign_cpu_tensors(model: PreTrainedModel, alignment: int = 64) -> PreTrainedModel:
    """Copy CPU weights that transformers left at unaligned addresses into fresh torch memory.

    transformers 5 can hand back CPU tensors whose data is not 64-byte aligned; BLAS then takes
    a different code path and results differ from an in-memory model in the last bit. Copying
    them makes a saved-then-loaded model bitwise identical to the one saved. Ties survive,
    because tied weights are one ``Parameter`` object and ``.data`` is swapped on it.
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and tensor.data_ptr() % alignment:
                tensor.data = tensor.data.clone()
    return model
