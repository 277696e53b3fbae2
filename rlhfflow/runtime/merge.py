"""A LoRA checkpoint's adapters merged into the base weights: the plain transformers model
``rlhfflow models merge`` writes, made the way a run's ``final`` export is made.

The base is what the run started the model from, found from the run directory alone
(``run.json`` records the pipeline's models and the file they were read from): a
``tiny:`` model's ``OUTPUT/models/NAME/init``, a setup stage's ``OUTPUT/models/NAME/setup``,
else the model's ``path:`` (relative to that file, or a Hub id in the local cache). The
adapters are those of a checkpoint (``checkpoints/iter_NNNNNN/models/NAME``). The model
is loaded as a run loads it (``ModelStore``) and saved with ``ResidentModel.export``: the
same merge (``engine.lora.merged_copy``) and the same atomic save.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfflow.errors import UserError
from rlhfflow.runtime.runstate import RUN_FILE
from rlhfflow.storage import Checkpoint, CheckpointStore
from rlhfflow.storage.checkpoints import STATE_FILE, CheckpointError


class MergeError(UserError):
    """A run, checkpoint, model or output that cannot be merged as asked: one line."""


@dataclass(frozen=True)
class MergeSource:
    """What a merge reads: the run directory, its checkpoint, the LoRA model's name,
    its spec (``run.json``'s ``models.NAME``), its base weights and its adapters."""

    run_dir: Path
    checkpoint: Checkpoint
    model: str
    spec: dict[str, Any]
    base: str
    adapters: Path


def find_source(path: str | Path, model: str | None = None,
                iteration: int | None = None) -> MergeSource:
    """The checkpoint and model a merge of ``path`` reads: a run directory (its newest
    whole checkpoint, or that of ``iteration``) or a checkpoint directory in one;
    ``model`` defaults to the run's only trained model with LoRA. ``MergeError`` names
    the argument and what was expected."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise MergeError(f"{path}: no such directory (expected a run directory or one of "
                         f"its checkpoints/iter_NNNNNN)")
    if (path / STATE_FILE).is_file() and path.parent.name == "checkpoints":
        if iteration is not None:
            raise MergeError(f"--iteration: {path} is a checkpoint already; give its run "
                             f"directory to choose another iteration")
        run_dir, checkpoint = path.parent.parent, _checkpoint_at(path)
    else:
        run_dir, checkpoint = path, _run_checkpoint(path, iteration)
    models = _run_models(run_dir)
    name = _lora_model(run_dir, models, model)
    adapters = checkpoint.model_dir(name)
    if not (adapters / "adapter_config.json").is_file():
        raise MergeError(f"{adapters}: no adapters of model {name!r} in this checkpoint "
                         f"(expected adapter_config.json)")
    return MergeSource(run_dir, checkpoint, name, models[name],
                       _base_weights(run_dir, models, name), adapters)


def merge(source: MergeSource, out: str | Path, overwrite: bool = False) -> Path:
    """Write ``source``'s model with its adapters merged into ``out`` (transformers'
    ``save_pretrained`` and the tokenizer), atomically: assembled in a hidden sibling and
    renamed into place, so a crash leaves no directory that looks like a model. An
    existing ``out`` is a ``MergeError`` unless ``overwrite``."""
    from rlhfflow.engine.resident import ModelConfig, ModelStore

    out = check_output(out, overwrite)
    spec = source.spec
    config = ModelConfig(name=source.model, head=spec.get("head", "lm"),
                         init_path=source.base, trainable=True,
                         dtype=spec.get("dtype", "float32"),
                         lora=dict(spec["lora"]), adapter_path=str(source.adapters))
    lora_log = logging.getLogger("rlhfflow.engine.lora")
    level = lora_log.level
    lora_log.setLevel(logging.WARNING)  # its line on the forward a run takes says nothing here
    try:
        resident = ModelStore({source.model: config}).get(source.model)
    except (OSError, ValueError) as exc:  # the base or the adapters unusable
        text = str(exc).strip().splitlines()
        raise MergeError(f"model {source.model!r} from {source.base} with the adapters of "
                         f"{source.adapters}: {text[0] if text else type(exc).__name__}"
                         ) from None
    finally:
        lora_log.setLevel(level)
    resident.export(out)
    return out


def check_output(out: str | Path, overwrite: bool) -> Path:
    """``out`` as an absolute path, or a ``MergeError`` when it exists (and not
    ``overwrite``) or is not a directory."""
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        raise MergeError(f"--out: {out} exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise MergeError(f"--out: {out} exists and is not a directory")
    return out


def _checkpoint_at(path: Path) -> Checkpoint:
    """The checkpoint in directory ``path``, whole, or a ``MergeError``."""
    store = CheckpointStore(path.parent)
    try:
        checkpoint = store.read(path)
    except CheckpointError as exc:
        raise MergeError(str(exc)) from None
    problem = store.damage(checkpoint)
    if problem:
        raise MergeError(f"{path}: damaged checkpoint ({problem})")
    return checkpoint


def _run_checkpoint(run_dir: Path, iteration: int | None) -> Checkpoint:
    """The newest whole checkpoint of ``run_dir``, or that of ``iteration``."""
    store = CheckpointStore(run_dir / "checkpoints")
    if not (run_dir / RUN_FILE).is_file():
        raise MergeError(f"{run_dir}: not a run directory (expected {RUN_FILE} and "
                         f"checkpoints/) nor a checkpoint (expected {STATE_FILE})")
    if iteration is None:
        checkpoint, _ = store.latest_whole()
        if checkpoint is None:
            raise MergeError(f"{store.root}: no whole checkpoint to merge (the run saved "
                             f"none; checkpoint.every sets how often it does)")
        return checkpoint
    path = store.root / f"iter_{iteration:06d}"
    if not (path / STATE_FILE).is_file():
        have = [c.iteration for c in store.list()]
        raise MergeError(f"--iteration: no checkpoint of iteration {iteration} in "
                         f"{store.root} (expected one of {have or 'none'})")
    return _checkpoint_at(path)


def _run_models(run_dir: Path) -> dict[str, dict[str, Any]]:
    """``models`` of the pipeline that made ``run_dir`` (``run.json``), with the file it
    was read from under ``"_source"``."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
        models = dict(record["identity"]["models"])
    except (OSError, ValueError, KeyError, TypeError):
        raise MergeError(f"{run_dir / RUN_FILE}: unreadable (expected the record of the "
                         f"run that made {run_dir})") from None
    return {name: {**spec, "_source": record.get("source", "")}
            for name, spec in models.items()}


def _lora_model(run_dir: Path, models: dict[str, dict[str, Any]], name: str | None) -> str:
    """``name``, checked to be a trained model with LoRA; or the only such model."""
    with_lora = [m for m, spec in models.items() if spec.get("lora") and spec.get("trainable")]
    if name is None:
        if len(with_lora) != 1:
            raise MergeError(f"--model: {run_dir} has {len(with_lora)} trained models with "
                             f"LoRA ({', '.join(with_lora) or 'none'}); name one")
        return with_lora[0]
    if name not in models:
        raise MergeError(f"--model: no model {name!r} in {run_dir} (expected one of "
                         f"{', '.join(models)})")
    if name not in with_lora:
        raise MergeError(f"--model: model {name!r} has no LoRA adapters to merge (expected "
                         f"a trained model with models.{name}.lora; with LoRA: "
                         f"{', '.join(with_lora) or 'none'})")
    return name


def _base_weights(run_dir: Path, models: dict[str, dict[str, Any]], name: str) -> str:
    """The weights model ``name`` started from in the run (as ``runtime.models``
    resolves them): a setup stage's, a ``tiny:`` model's, or its root's ``path:``."""
    root = name
    while models[root].get("from") is not None:
        root = models[root]["from"]
    for owner in (name, root):
        setup = run_dir / "models" / owner / "setup"
        if (setup / "config.json").is_file():
            return str(setup)
    spec = models[root]
    if spec.get("tiny") is not None:
        init = run_dir / "models" / root / "init"
        if not (init / "config.json").is_file():
            raise MergeError(f"{init}: the base weights of model {name!r} are missing "
                             f"(expected the tiny model the run built)")
        return str(init)
    path = str(spec.get("path"))
    local = Path(path).expanduser()
    if not local.is_absolute() and spec["_source"]:
        local = Path(spec["_source"]).parent / local
    if local.exists():
        return str(local.resolve())
    from rlhfflow.engine.hub import is_hub_id

    if is_hub_id(path):
        return path
    raise MergeError(f"{local}: the base weights of model {name!r} (models.{root}.path in "
                     f"{spec['_source']}) are not there")
