"""Setup stages (run once before the loop) in whole pipelines: SFT from a JSONL file
feeding the models copied from it, and SFT from an earlier run's experience buffer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from rlhfflow.config import load_pipeline
from rlhfflow.runtime.run import RunError, run_pipeline
from rlhfflow.storage import ExperienceBuffer
from tests.conftest import DATA, small_pipeline


def _with_setup_stage(path: Path, stage: dict) -> Path:
    """Put an ``sft`` stage in front of the pipeline at ``path``."""
    data = yaml.safe_load(path.read_text())
    data["stages"] = {"sft": stage, **data["stages"]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_models_copied_from_an_sft_model_start_from_its_trained_weights(tmp_path):
    path = _with_setup_stage(small_pipeline(tmp_path, iterations=1), {
        "type": "sft", "model": "actor",
        "params": {"data": str(DATA / "sft.jsonl"), "epochs": 2, "batch_size": 16}})
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)

    assert result.setup_metrics["sft"]["records"] == 64
    out = result.output_dir
    assert (out / "models" / "actor" / "setup" / "config.json").is_file()
    # the reference (from: actor) must be the SFT model, as the actor is in iteration 0:
    # their log-probs of the same responses agree (to float rounding: the two copies'
    # prompt forwards can take other kernel paths, ~5e-7 measured; the initial weights
    # would be ~1 off), and the KL is zero
    batch = ExperienceBuffer(out / "buffer.zarr").read(0)
    np.testing.assert_allclose(batch["ref_logprobs"], batch["old_logprobs"], atol=2e-6,
                               rtol=0)
    assert result.metrics[0]["kl_mean"] == pytest.approx(0.0, abs=1e-6)


def test_sft_trains_on_the_best_responses_of_a_buffer(tmp_path):
    (tmp_path / "a").mkdir()
    first = run_pipeline(load_pipeline(small_pipeline(tmp_path / "a", iterations=2)),
                         progress=False, inline=True)
    buffer = ExperienceBuffer(first.output_dir / "buffer.zarr")
    scores = np.concatenate([buffer.read(i, ["scores"])["scores"] for i in (0, 1)])
    threshold = float(scores[scores > 0].min())  # keeps some rows, drops the zeros

    def sft_pipeline(min_score: float, name: str) -> Path:
        spec = {"name": "rft", "iterations": 0, "output": str(tmp_path / name),
                "models": {"actor": {"path": str(first.output_dir / "models/actor/final"),
                                     "trainable": True, "optimizer": {"lr": 1e-3}}},
                "stages": {"sft": {"type": "sft", "model": "actor", "params": {
                    "buffer": str(first.output_dir / "buffer.zarr"),
                    "min_score": min_score, "batch_size": 8}}}}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    result = run_pipeline(load_pipeline(sft_pipeline(threshold, "rft")), progress=False,
                          inline=True)
    stats = result.setup_metrics["sft"]
    assert stats["records"] == int((scores >= threshold).sum())
    assert 0 < stats["records"] < len(scores)
    assert np.isfinite(stats["sft_loss"])
    assert (result.output_dir / "models" / "actor" / "final" / "config.json").is_file()

    with pytest.raises(RunError, match="no response scored at least min_score=2"):
        run_pipeline(load_pipeline(sft_pipeline(2.0, "none")), progress=False, inline=True)


def test_sft_needs_exactly_one_data_source(tmp_path):
    from rlhfflow.config.spec import SpecError

    path = _with_setup_stage(small_pipeline(tmp_path), {
        "type": "sft", "model": "actor", "params": {}})
    with pytest.raises(SpecError, match=r"stages\.sft\.params: give exactly one of 'data'"):
        load_pipeline(path)


def test_a_setup_stage_that_fails_marks_the_logging_run_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database
    from mlflow.tracking import MlflowClient

    data = tmp_path / "sft.jsonl"
    data.write_text((DATA / "sft.jsonl").read_text())
    uri = (tmp_path / "mlruns").as_uri()
    path = _with_setup_stage(small_pipeline(tmp_path, iterations=1, overrides={
        "logging.mlflow": {"tracking_uri": uri, "experiment": "tests"}}), {
        "type": "sft", "model": "actor", "params": {"data": str(data), "batch_size": 16}})
    pipeline = load_pipeline(path)
    data.unlink()  # gone between validation and the stage's run
    with pytest.raises(RunError):
        run_pipeline(pipeline, progress=False, inline=True)
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED"
