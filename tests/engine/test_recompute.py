"""Gradient checkpointing (models.NAME.gradient_checkpointing): the same gradients, with
fewer activations kept for the backward pass, on the lean forward and transformers' own."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfflow.engine import lean, recompute
from rlhfflow.engine.forward import response_logits
from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model, save_tiny_model
from rlhfflow.stages import ModelConfig, ModelStore
from tests.conftest import padded_ids


def _batch(rows: int = 4, prompt: int = 12, response: int = 20, seed: int = 0):
    ids, mask, _ = padded_ids(rows, prompt + response, seed)
    return {"prompt_ids": ids[:, :prompt], "prompt_mask": mask[:, :prompt],
            "response_ids": ids[:, prompt:], "response_mask": torch.ones_like(ids[:, prompt:])}


def _gradients(model, batch):
    """The loss and parameter gradients of one training forward and backward, and the
    bytes autograd saved for the backward pass."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = response_logits(model, batch).logsumexp(-1).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, sum(saved)


def _model(arch: str = "llama", lean_forward: bool = True):
    model = build_tiny_model(build_char_tokenizer(), arch=arch, n_layer=4, hidden=64,
                             n_head=4).eval()
    if lean_forward:
        assert lean.enable(model)
    return model


@pytest.mark.parametrize(("arch", "lean_forward", "how"), [
    ("llama", True, "lean"), ("llama", False, "layers"), ("gpt2", False, "layers")])
def test_checkpointed_gradients_equal_the_plain_ones_and_keep_fewer_activations(
        arch, lean_forward, how):
    plain = _model(arch, lean_forward)
    checkpointed = copy.deepcopy(plain)
    assert recompute.enable(checkpointed) == how
    batch = _batch()
    loss, grads, saved = _gradients(plain, batch)
    loss_ck, grads_ck, saved_ck = _gradients(checkpointed, batch)
    torch.testing.assert_close(loss_ck, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ck[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # only each layer's input is kept (plus what the head saves): the 4 layers' own
    # intermediates (norms, projections, attention, MLP) are recomputed
    assert saved_ck < 0.6 * saved, (saved_ck, saved)


def test_checkpointing_leaves_inference_and_decoding_alone():
    plain = _model()
    checkpointed = copy.deepcopy(plain)
    recompute.enable(checkpointed)
    ids, mask, pos = padded_ids()
    with torch.no_grad():
        for use_cache in (False, True):
            a = plain(input_ids=ids, attention_mask=mask, position_ids=pos,
                      use_cache=use_cache).logits
            b = checkpointed(input_ids=ids, attention_mask=mask, position_ids=pos,
                             use_cache=use_cache).logits
            assert torch.equal(a, b)


def test_a_store_loads_a_checkpointed_model_that_trains_like_a_plain_one(tmp_path):
    save_tiny_model(tmp_path / "m", n_layer=3, hidden=32, n_head=4)
    configs = {checkpointing: ModelConfig(name="m", head="lm", init_path=str(tmp_path / "m"),
                                          trainable=True,
                                          gradient_checkpointing=checkpointing)
               for checkpointing in (False, True)}
    models = [ModelStore({"m": configs[c]}).get("m") for c in (False, True)]
    assert getattr(models[1].module, recompute.LEAN_FLAG, False)
    assert not getattr(models[0].module, recompute.LEAN_FLAG, False)
    batch = _batch(seed=1)
    norms = []
    for resident in models:
        loss = response_logits(resident.module, batch).logsumexp(-1).mean()
        norms.append(resident.step(loss))
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    for a, b in zip(models[0].module.parameters(), models[1].module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_model_with_an_eager_attention_keeps_transformers_forward(tmp_path):
    save_tiny_model(tmp_path / "m", n_layer=2, hidden=32, n_head=4)
    config = ModelConfig(name="m", head="lm", init_path=str(tmp_path / "m"),
                         attn_implementation="eager")
    module = ModelStore({"m": config}).get("m").module
    assert module.config._attn_implementation == "eager"
    assert lean.unsupported(module) == "attn_implementation 'eager' (the lean forward is SDPA)"


DEEPSPEED_STEP = """
import sys
import torch
import torch.distributed as dist
from rlhfflow.engine.forward import response_logits
from rlhfflow.stages import ModelConfig, ModelStore
from tests.engine.test_recompute import _batch

path = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{path}/pg", rank=0, world_size=1)
steps = []
for deepspeed, checkpointing in ((False, False), (True, True)):
    config = ModelConfig(name="m", head="lm", init_path=f"{path}/m", trainable=True,
                         gradient_checkpointing=checkpointing)
    resident = ModelStore({"m": config}).get("m")
    if deepspeed:
        resident.use_deepspeed(2, {}, 0)
    module = resident.engine if deepspeed else resident.module
    norm = resident.step(response_logits(module, _batch(seed=1)).logsumexp(-1).mean())
    steps.append((norm, [p.detach().clone() for p in resident.module.parameters()]))
assert abs(steps[0][0] - steps[1][0]) < 1e-6 * steps[0][0], steps
for a, b in zip(steps[0][1], steps[1][1], strict=True):
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
print("same step")
"""


@pytest.mark.slow
def test_a_checkpointed_model_takes_the_same_step_under_deepspeed_zero2(tmp_path):
    """DeepSpeed's engine calls the module: the checkpointed layers run inside it, and
    its ZeRO-2 step equals the plain torch step of the same model without checkpointing."""
    pytest.importorskip("deepspeed")
    save_tiny_model(tmp_path / "m", n_layer=3, hidden=32, n_head=4)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "LOCAL_RANK": "0", "RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    script = tmp_path / "step.py"
    script.write_text(DEEPSPEED_STEP)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same step" in done.stdout
