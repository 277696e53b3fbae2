"""Whether a plan fits its workers' memory (``rlhfflow.plan.auto.fitting``): a LoRA
model sharded over its gang (``backend: fsdp``), which the planner may now choose, and
the memory check of ``rlhfflow validate``. The planner only: nothing is trained here."""

from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.plan.auto.costmodel import CostModel
from rlhfflow.plan.auto.memory import layer_params, trainer_state
from rlhfflow.plan.auto.planner import choose_plan
from rlhfflow.plan.placement import make_plan
from tests.conftest import CONFIGS

pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")

GRPO = CONFIGS / "grpo-tiny.yaml"
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
# a GRPO actor of 128 MiB of fp32 weights (hidden 512, 8 layers) with adapters, on 3
# workers: 738 MiB per worker of the train group unsharded, 687 MiB sharded over it
LARGER = {"models.actor.tiny": {"layers": 8, "hidden": 512, "heads": 4}, "cluster.workers": 3,
          "models.actor.lora": LORA}


def _larger(**overrides):
    return load_pipeline(GRPO, {**LARGER, **overrides})


def test_a_sharded_lora_trainer_holds_its_share_and_the_adapters_moments():
    """Sharded, a LoRA model's rank holds half the base and adapters, AdamW moments of
    its half of the adapters, and one gathered layer and the root without gradients
    (its base is frozen): not the 16 bytes per parameter of a full fine-tune's share."""
    pipeline = _larger(**{"stages.train_actor.backend": "fsdp",
                          "placement.strategy": "disaggregated"})
    cost = CostModel(pipeline)
    plan = make_plan(pipeline, 3)
    shape = cost.shapes["actor"]
    assert shape.adapters and shape.trained == shape.adapters
    layer, root = layer_params(shape)
    parts = cost.memory_parts(plan, {name: 0 for name in plan.stages})
    for w in plan.homes["actor"]:
        assert parts[w]["weights"] == pytest.approx(shape.nbytes / 2)  # the reference: a view
        assert parts[w]["trainer"] == pytest.approx(8 * shape.adapters / 2 + 4 * (layer + root))
    full = trainer_state(replace(shape, adapters=None), 2)
    assert full["trained"] > trainer_state(shape, 2)["trained"] + 4 * (layer + root)
    # unsharded, loading (the whole model read: twice its weights for a moment) is a
    # LoRA model's peak, below a full fine-tune's weights, gradients and moments
    # (benchmarks/sharded_memory.py --lora 8: predicted +2% of the measured peak)
    assert trainer_state(shape, 1)["transient"] == pytest.approx(
        shape.nbytes - 12 * shape.adapters)
    assert trainer_state(replace(shape, adapters=None), 1)["transient"] == 0
    # what moves to the shadow after each update: the adapters' parts
    [shadow] = plan.shadows("actor")
    assert parts[shadow]["incoming"] == 4 * shape.adapters


def test_auto_shards_a_lora_model_whose_base_does_not_fit_otherwise():
    assert choose_plan(_larger(**{"cluster.memory_limit": "1GB"}), n_workers=3).best.fits == {}
    sharded = choose_plan(_larger(**{"cluster.memory_limit": "0.95GB"}), n_workers=3)
    assert sharded.best.fits == {"stages.train_actor.backend": "fsdp"}
    assert sharded.best.strategy == "disaggregated"
    assert sharded.pipeline.spec.models["actor"].lora is not None
    assert max(sharded.best.memory) <= sharded.best.capacity


def _validate(*sets: str):
    args = ["validate", str(GRPO), "--set", "models.actor.tiny={layers: 8, hidden: 512, "
            "heads: 4}", "--set", "cluster.workers=3"]
    return CliRunner().invoke(main, [*args, *(a for s in sets for a in ("--set", s))])


def test_validate_refuses_a_plan_that_does_not_fit_the_memory_limit():
    """With a chosen strategy, its plan (the line ``rlhfflow run`` refuses with, naming
    ``cluster.memory_limit`` and what would fit); under ``auto``, none of the plans,
    sharded or checkpointed, fits. One line, exit 2, no cluster started."""
    result = _validate("cluster.memory_limit=1.35GB", "placement.strategy=colocated")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert f"{GRPO}: cluster.memory_limit: does not fit: worker 0 needs 1.16 GiB" in line
    assert "would fit: placement.strategy: disaggregated, stages.train_actor.backend: fsdp" \
        in line
    result = _validate("cluster.memory_limit=0.8GB")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert "placement.strategy: no plan fits the cluster (does not fit: worker" in line
    assert "(cluster.memory_limit, at Dask's pause fraction 0.8)" in line


def test_validate_accepts_what_fits_and_checks_nothing_without_a_limit():
    """Sharded by the planner under ``auto`` fits; a file without ``memory_limit``
    (the machine's memory is the planner's guess, not a limit) is not planned."""
    fits = _validate("cluster.memory_limit=1.35GB")
    assert fits.exit_code == 0, fits.output
    assert "valid" in fits.output.splitlines()[0]
    assert _validate("placement.strategy=colocated").exit_code == 0
