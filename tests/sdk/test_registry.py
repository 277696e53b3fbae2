"""Creating a stage by its type's name: its params validated, its training backend given
by the SDK (``Stage.use_backend``), not set on the object from outside."""

from __future__ import annotations

from rlhfflow.sdk import create_stage


def test_a_stage_is_created_with_the_training_backend_its_keys_name():
    plain = create_stage("train_actor", params={"epochs": 2}, model="actor")
    assert (plain.backend, plain.deepspeed) == ("torch", None)
    options = {"zero_stage": 3, "config": {"train_micro_batch_size_per_gpu": 2}}
    stage = create_stage("train_actor", params={"epochs": 2}, model="actor",
                         backend="deepspeed", deepspeed=options)
    assert (stage.backend, stage.deepspeed) == ("deepspeed", options)
    assert stage.params.epochs == 2
    sharded = create_stage("train_actor", model="actor", backend="fsdp")
    assert (sharded.backend, sharded.deepspeed) == ("fsdp", None)
