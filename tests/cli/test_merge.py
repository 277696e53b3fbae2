"""``rlhfflow models merge``: a LoRA checkpoint's adapters merged into the base weights, a
plain transformers model that computes what the run's LoRA model computes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage import CheckpointStore
from tests.conftest import padded_ids, small_pipeline

pytest.importorskip("peft", reason="pip install 'rlhfflow[lora]'")

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A short GRPO run of a tiny LoRA actor, a checkpoint after each iteration."""
    tmp = tmp_path_factory.mktemp("lora-run")
    path = small_pipeline(tmp, "grpo", iterations=2, batch_size=4, overrides={
        "models.actor.lora": LORA, "checkpoint.every": 1, "checkpoint.keep": 0,
        "cluster.workers": 1})
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    return tmp / "out"


def _merge(*args):
    return CliRunner().invoke(main, ["models", "merge", *map(str, args)])


def _lora_logits(run, iteration):
    """Logits of the run's LoRA model at ``iteration``'s checkpoint, adapters on, with
    peft itself: the base the run built and the adapters the checkpoint holds."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapters = run / "checkpoints" / f"iter_{iteration:06d}" / "models" / "actor"
    base = AutoModelForCausalLM.from_pretrained(run / "models" / "actor" / "init")
    model = PeftModel.from_pretrained(base, adapters).eval()
    ids, mask, positions = padded_ids()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def _plain_logits(path):
    from transformers import AutoModelForCausalLM

    ids, mask, positions = padded_ids()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


@pytest.mark.slow
def test_the_merged_model_computes_what_the_lora_model_does(lora_run, tmp_path):
    result = _merge(lora_run, "--out", tmp_path / "merged")
    assert result.exit_code == 0, result.output
    merged = tmp_path / "merged"
    assert (merged / "config.json").is_file() and (merged / "tokenizer_config.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert (_plain_logits(merged) - _lora_logits(lora_run, 1)).abs().max() < 1e-5
    # the newest checkpoint is the last iteration's: what the run's final export holds
    final = _plain_logits(lora_run / "models" / "actor" / "final")
    assert (_plain_logits(merged) - final).abs().max() < 1e-5
    # it differs from the base: the adapters trained
    init = _plain_logits(lora_run / "models" / "actor" / "init")
    assert (_plain_logits(merged) - init).abs().max() > 1e-3


@pytest.mark.slow
def test_an_earlier_checkpoint_merges_by_iteration_or_by_its_directory(lora_run, tmp_path):
    assert _merge(lora_run, "--iteration", 0, "--model", "actor",
                  "--out", tmp_path / "a").exit_code == 0
    checkpoint = CheckpointStore(lora_run / "checkpoints").list()[0].path
    assert _merge(checkpoint, "--out", tmp_path / "b").exit_code == 0
    expected = _lora_logits(lora_run, 0)
    for out in ("a", "b"):
        assert (_plain_logits(tmp_path / out) - expected).abs().max() < 1e-5
    assert (_plain_logits(tmp_path / "a") - _lora_logits(lora_run, 1)).abs().max() > 1e-4


@pytest.mark.slow
def test_the_merged_model_loads_with_transformers_alone(lora_run, tmp_path):
    """In a process where peft cannot be imported."""
    merged = tmp_path / "merged"
    assert _merge(lora_run, "--out", merged).exit_code == 0
    script = textwrap.dedent(f"""
        import sys
        sys.modules["peft"] = None  # any import of peft fails
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(merged)!r})
        AutoTokenizer.from_pretrained({str(merged)!r})
        print(type(model).__name__, "peft" in sys.modules and sys.modules["peft"] is not None)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["LlamaForCausalLM", "False"]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "ref"], "--model: model 'ref' has no LoRA adapters to merge"),
    (["--model", "critic"], "--model: no model 'critic' in "),
    (["--iteration", "7"], "--iteration: no checkpoint of iteration 7 in "),
    (["--out", "{existing}"], "exists; pass --overwrite to replace it"),
])
def test_bad_merge_input_is_one_line_naming_the_argument(lora_run, tmp_path, args, expected):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    args = [a.format(existing=existing) for a in args]
    out = [] if "--out" in args else ["--out", tmp_path / "merged"]
    result = _merge(lora_run, *args, *out)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not (tmp_path / "merged").exists()
    assert (existing / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_adapters_that_do_not_fit_the_base_are_one_line(lora_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    adapters = run / "checkpoints" / "iter_000001" / "models" / "actor"
    from safetensors.torch import save_file

    # adapters of another model; the state lists no sizes (as checkpoints made before)
    save_file({"base_model.model.other.lora_A.weight": torch.zeros(4, 8)},
              adapters / "adapter_model.safetensors")
    state = run / "checkpoints" / "iter_000001" / "state.json"
    state.write_text(state.read_text().replace('"files"', '"unlisted"'))
    result = _merge(adapters.parent.parent, "--out", tmp_path / "merged")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(
        f"Error: model 'actor' from {run / 'models' / 'actor' / 'init'} with the adapters "
        f"of {adapters}: ")
    assert not (tmp_path / "merged").exists()


@pytest.mark.slow
def test_overwrite_replaces_an_existing_output(lora_run, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert _merge(lora_run, "--out", out, "--overwrite").exit_code == 0
    assert (out / "config.json").is_file() and not (out / "stale.txt").exists()


def test_a_missing_run_or_a_run_without_checkpoints_is_one_line(tmp_path):
    run = [sys.executable, "-m", "rlhfflow.cli.main", "models", "merge",
           str(tmp_path / "nowhere"), "--out", str(tmp_path / "merged")]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'nowhere'}: no such directory (expected a run directory or "
        f"one of its checkpoints/iter_NNNNNN)"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run.json").write_text('{"identity": {"models": {}}}')
    result = _merge(tmp_path / "empty", "--out", tmp_path / "merged")
    assert result.exit_code == 2
    assert result.output.strip() == (f"Error: {tmp_path / 'empty' / 'checkpoints'}: no "
                                     f"whole checkpoint to merge (the run saved none; "
                                     f"checkpoint.every sets how often it does)")
    (tmp_path / "plain").mkdir()
    result = _merge(tmp_path / "plain", "--out", tmp_path / "merged")
    assert result.exit_code == 2 and "not a run directory" in result.output
