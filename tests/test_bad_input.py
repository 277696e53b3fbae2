"""Bad input stops a run with one line naming the thing, or (where configured) is
skipped, counted and listed; never a silent wrong result."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.data.records import DataError
from rlhfflow.runtime.budget import score_error_budget
from rlhfflow.runtime.run import RunError, run_pipeline
from rlhfflow.runtime.worker.tasks import METRICS, partial_metrics
from rlhfflow.stages import StageContext, create_stage
from rlhfflow.storage import ExperienceBuffer, MetricsLog
from rlhfflow.storage.errors import read_score_errors, truncate_score_errors
from tests.conftest import DATA, small_pipeline, tmpfs

#: the calling convention, as a reward function called the wrong way is told it
CONVENTION = ("rlhfflow calls fn(prompts: list[str], responses: list[str], **fields) -> "
              "list[float], one value per row (or TRL's fn(prompts=..., completions=..., "
              "**fields))")


def _prompts(tmp_path, *bad_lines: str):
    lines = (DATA / "prompts.jsonl").read_text().splitlines()[:20]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines[:2] + list(bad_lines) + lines[2:]) + "\n")
    return path


def test_a_malformed_prompt_line_is_named(tmp_path):
    prompts = _prompts(tmp_path, '{"prompt": "unterminated')
    path = small_pipeline(tmp_path, overrides={"data.prompts": str(prompts)})
    with pytest.raises(DataError, match=rf"^{prompts}:3: invalid JSON"):
        run_pipeline(load_pipeline(path), progress=False, inline=True)


def test_bad_prompts_can_be_skipped_counted_and_listed(tmp_path, capsys):
    prompts = _prompts(tmp_path, "[1, 2]", '{"text": "no prompt field"}',
                       json.dumps({"prompt": "x" * 200}))
    path = small_pipeline(tmp_path, overrides={"data.prompts": str(prompts),
                                               "data.on_bad_prompt": "skip"})
    result = run_pipeline(load_pipeline(path), progress=True, inline=True)
    assert len(result.metrics) == 2
    listed = (result.output_dir / "skipped_prompts.txt").read_text().splitlines()
    assert listed == [f"{prompts}:3: expected a JSON object",
                      f"{prompts}:4: expected a string field 'prompt' or a "
                      f"'messages' list",
                      f"{prompts}:5: the prompt has 201 tokens, more than "
                      f"data.max_prompt_tokens=64"]
    assert "skipped 3 bad prompt(s) (data.on_bad_prompt: skip)" in capsys.readouterr().err


def test_an_over_long_prompt_is_named(tmp_path):
    prompts = _prompts(tmp_path, json.dumps({"prompt": "x" * 200}))
    path = small_pipeline(tmp_path, overrides={"data.prompts": str(prompts)})
    with pytest.raises(DataError, match=rf"^{prompts}:3: the prompt has 201 tokens, more "
                                        r"than data.max_prompt_tokens=64$"):
        run_pipeline(load_pipeline(path), progress=False, inline=True)


def test_prompt_and_response_must_fit_the_model_context(tmp_path):
    path = small_pipeline(tmp_path, overrides={"data.max_prompt_tokens": 121})
    with pytest.raises(SpecError, match=r"data\.max_prompt_tokens: 121 prompt \+ 8 new tokens "
                                        r"= 129 exceed the 128 positions of model 'actor' "
                                        r"\(stage 'generate'\)") as err:
        load_pipeline(path)
    assert str(err.value).startswith(f"{path}: ")


@pytest.mark.parametrize(("body", "expected"), [
    ("return [float('nan')] * len(responses)",
     "reward is not finite for 4 of 4 responses (first: row 0)"),
    ("raise KeyError('judge unavailable')", "RewardError: reward function score() raised at "
     "{file}:2: KeyError: 'judge unavailable'; set params.on_error: skip to leave such "
     "samples out"),
    ("return [1.0]", f"reward returned 1 scores for 4 responses; {CONVENTION}"),
])
def test_a_bad_reward_function_stops_the_run_naming_the_stage(tmp_path, body, expected):
    (tmp_path / "bad_reward.py").write_text(
        f"def score(prompts, responses):\n    {body}\n")
    path = small_pipeline(tmp_path, overrides={
        "stages.reward.params.function": str(tmp_path / "bad_reward.py") + ":score",
        "stages.reward.params.check": False})  # the run's own checks, not the trial's
    with pytest.raises(RunError, match=r"^stage 'reward' failed in iteration 0: ") as err:
        run_pipeline(load_pipeline(path), progress=False, inline=True)
    assert expected.format(file=tmp_path / "bad_reward.py") in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_the_cli_names_the_file_and_line_where_a_reward_function_raised(tmp_path):
    (tmp_path / "judge.py").write_text(
        "def score(prompts, responses):\n"
        "    verdicts = {}\n"
        "    return [verdicts['missing_key'] for r in responses]\n")
    path = small_pipeline(tmp_path, iterations=1, overrides={
        "cluster.workers": 1, "stages.reward.params.function": "judge.py:score"})
    result = CliRunner().invoke(main, ["run", str(path), "--quiet"])
    assert result.exit_code == 1
    # the trial call at validation saw it first (a warning: a made-up response may raise
    # where real ones do not), then the run stops on it
    warning, error = result.stderr.splitlines()
    assert warning.startswith(f"warning: {path}: stages.reward.params.function: a trial call")
    assert error == (
        f"Error: stage 'reward' failed in iteration 0: RewardError: reward function score() "
        f"raised at {tmp_path / 'judge.py'}:3: KeyError: 'missing_key'; set "
        f"params.on_error: skip to leave such samples out")


SOMETIMES = (
    "def score(prompts, responses):\n"
    "    # raises on about one response in four, as a judge choking on some inputs does\n"
    "    return [1 / (sum(map(ord, r)) % 4) for r in responses]\n")


@pytest.mark.parametrize("config", ["ppo", "grpo"])
def test_a_reward_function_that_raises_can_be_skipped_counted_and_listed(tmp_path, config):
    (tmp_path / "sometimes.py").write_text(SOMETIMES)
    path = small_pipeline(tmp_path, config, iterations=3, overrides={
        "stages.reward.params.function": "sometimes.py:score",
        "stages.reward.params.on_error": "skip",
        "stages.reward.params.max_errors": 100, "stages.reward.params.max_errors_total": 100})
    pipeline = load_pipeline(path)
    result = run_pipeline(pipeline, progress=False, inline=True)
    listed = read_score_errors(result.output_dir)
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr")
    for record in result.metrics:
        k = record["iteration"]
        data = buffer.read(k)
        failed = [r["row"] for r in listed if r["iteration"] == k]
        assert sorted(np.flatnonzero(data["score_valid"] == 0).tolist()) == failed
        assert record["samples_skipped"] == len(failed)
        assert (data["advantages"][failed] == 0).all()  # nothing learnt from them
        assert score_error_budget(pipeline, result.output_dir, k, len(failed)) is None
        assert record["policy_loss"] is not None and math.isfinite(record["policy_loss"])
    assert len(listed) > 0
    assert {r["error"] for r in listed} == {
        f"reward function score() raised at {tmp_path / 'sometimes.py'}:3: "
        f"ZeroDivisionError: division by zero"}
    assert all(r["response"] is not None and r["prompt"] for r in listed)


@pytest.mark.slow
def test_skipped_reward_errors_are_listed_by_the_dask_workers(tmp_path):
    (tmp_path / "sometimes.py").write_text(SOMETIMES)
    path = small_pipeline(tmp_path, iterations=2, overrides={
        "cluster.workers": 2, "stages.reward.params.function": "sometimes.py:score",
        "stages.reward.params.on_error": "skip", "stages.reward.params.max_errors": 100})
    result = CliRunner().invoke(main, ["run", str(path), "--quiet"])
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    listed = read_score_errors(out)
    records = MetricsLog(out / "metrics.jsonl").read()
    assert [r["samples_skipped"] for r in records] == [
        sum(1 for e in listed if e["iteration"] == k) for k in range(2)]
    assert len(listed) > 0 and all("ZeroDivisionError" in e["error"] for e in listed)


def test_the_error_budget_per_iteration_and_in_total(tmp_path):
    (tmp_path / "sometimes.py").write_text(SOMETIMES)
    path = small_pipeline(tmp_path, iterations=3, overrides={
        "stages.reward.params.function": "sometimes.py:score",
        "stages.reward.params.on_error": "skip",
        "stages.reward.params.max_errors": 100, "stages.reward.params.max_errors_total": 100})
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    out = result.output_dir
    per_iteration = [sum(1 for r in read_score_errors(out) if r["iteration"] == k)
                     for k in range(3)]
    worst = max(per_iteration)
    tight = load_pipeline(path, {"stages.reward.params.max_errors": worst - 1})
    k = per_iteration.index(worst)
    assert score_error_budget(tight, out, k, worst) == (
        f"stage 'reward': the reward function raised on {worst} samples in iteration {k}, "
        f"more than stages.reward.params.max_errors={worst - 1} (listed in "
        f"{out / 'score_errors'}); fix the function or raise the budget")
    total = sum(per_iteration)
    spent = load_pipeline(path, {"stages.reward.params.max_errors_total": total - 1})
    assert per_iteration[2] > 0  # (seeded) so the last iteration is the one over budget
    assert score_error_budget(spent, out, 1, per_iteration[1]) is None
    assert score_error_budget(spent, out, 2, per_iteration[2]) == (
        f"stage 'reward': the reward function raised on {total} samples so far, more than "
        f"stages.reward.params.max_errors_total={total - 1} (listed in "
        f"{out / 'score_errors'}); fix the function or raise the budget")
    # a resume forgets the listing of the iterations it cuts away
    truncate_score_errors(out, 0)
    assert {r["iteration"] for r in read_score_errors(out)} <= {0}


def test_a_run_past_the_error_budget_stops_with_one_line_and_keeps_what_it_did(tmp_path):
    (tmp_path / "sometimes.py").write_text(SOMETIMES)
    path = small_pipeline(tmp_path, iterations=3, overrides={
        "stages.reward.params.function": "sometimes.py:score",
        "stages.reward.params.on_error": "skip", "stages.reward.params.max_errors": 0})
    with pytest.raises(RunError) as err:
        run_pipeline(load_pipeline(path), progress=False, inline=True)
    text = str(err.value)
    assert "more than stages.reward.params.max_errors=0" in text and "\n" not in text
    records = MetricsLog(tmp_path / "out" / "metrics.jsonl").read()
    # the run stops after the first iteration with an error; that iteration is kept
    assert len(records) < 3 and f"iteration {records[-1]['iteration']}," in text
    assert records[-1]["score_errors"] == records[-1]["samples_skipped"] > 0
    assert all(r["score_errors"] == 0 for r in records[:-1])


def test_each_reward_function_is_logged_alone(tmp_path):
    path = small_pipeline(tmp_path, iterations=2, overrides={
        "stages.reward.params": {"functions": [
            {"function": "rlhfflow.stages.rewards:vowel_ratio", "weight": 0.5},
            {"function": "rlhfflow.stages.rewards:length_ratio", "weight": 0.5,
             "kwargs": {"target": 8}}]}})
    for record in run_pipeline(load_pipeline(path), progress=False, inline=True).metrics:
        vowels, length = record["reward_mean_vowel_ratio"], record["reward_mean_length_ratio"]
        assert record["reward_mean"] == pytest.approx(0.5 * vowels + 0.5 * length)
        assert record["score_errors"] == 0 and record["score_retries"] == 0


def test_partial_sums_carry_errors_retries_and_each_functions_score(tmp_path):
    (tmp_path / "sometimes.py").write_text(SOMETIMES)
    stage = create_stage("score", name="reward", params={
        "functions": [{"function": "sometimes.py:score", "weight": 2.0},
                      {"function": "rlhfflow.stages.rewards:vowel_ratio"}],
        "on_error": "skip"})
    responses = ["a", "b", "c", "d", "aeiou", "xyz", "hello", "ok"]
    batch = {"prompt_text": ["p"] * 8, "response_text": responses,
             "response_mask": torch.ones(8, 3)}
    batch |= stage.run(batch, StageContext(0, 0, settings={"base_dir": str(tmp_path)}))
    partial = partial_metrics(batch, type(stage).iteration_metrics(stage.params))
    valid = batch["score_valid"].bool()
    assert partial["score_errors"] == float((~valid).sum()) > 0
    assert partial["skipped"] == partial["score_errors"] and partial["score_retries"] == 0
    # each function's own score over the scored samples (the score stage declares them)
    for name in ("score", "vowel_ratio"):
        total, scored, _ = partial[METRICS][f"reward_mean_{name}"]
        assert total == pytest.approx(float(batch[f"score_{name}"][valid].sum()))
        assert scored == float(valid.sum())
    assert partial["score_sum"] == pytest.approx(
        float((2 * batch["score_score"] + batch["score_vowel_ratio"])[valid].sum()))


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB filesystem: room for the first checkpoint, not for the run."""
    with tmpfs(tmp_path / "disk", "6m") as mount:
        yield mount


@pytest.mark.slow
def test_a_full_disk_is_one_clear_line_and_the_run_resumes_after(tmp_path, small_disk):
    path = small_pipeline(tmp_path, iterations=6, overrides={
        "output": str(small_disk / "out"), "cluster.workers": 1, "checkpoint.every": 1,
        "checkpoint.keep": 0})
    run = [sys.executable, "-m", "rlhfflow.cli.main", "run", str(path), "--quiet"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("Error: no space left on device: ")
    assert lines[0].endswith("free space and run the same command again to resume from the "
                             "last checkpoint")
    # what was committed is whole: moved to a disk with room, the run resumes from its
    # last checkpoint and completes with every iteration once
    roomy = tmp_path / "roomy"
    shutil.copytree(small_disk / "out", roomy)
    # in-process: the resume is the point here, not the process (the one above is)
    done = CliRunner().invoke(main, ["run", str(path), "--out", str(roomy)])
    assert done.exit_code == 0, done.output
    assert "resuming after iteration" in done.stderr
    assert [r["iteration"] for r in MetricsLog(roomy / "metrics.jsonl").read()] == \
        list(range(6))
    assert ExperienceBuffer(roomy / "buffer.zarr").iterations() == list(range(6))


@pytest.fixture
def buffer_disk(tmp_path):
    """A tmpfs to hold a run's experience buffer, resized by the test (``remount``)."""
    with tmpfs(tmp_path / "buffer-disk", "64m") as mount:
        yield mount


def _committed_iterations_read_whole(buffer: ExperienceBuffer) -> None:
    for iteration in buffer.iterations():
        rows = buffer.attrs(iteration)["rows"]
        assert all(len(v) == rows for v in buffer.read(iteration).values())
        for column in buffer.text_columns(iteration):
            assert len(buffer.read_text(iteration, column)) == rows


@pytest.mark.slow
def test_a_full_disk_during_a_buffer_write_commits_nothing_half_written_and_resumes(
        tmp_path, buffer_disk):
    path = small_pipeline(tmp_path, iterations=6, overrides={
        "cluster.workers": 1, "checkpoint.every": 1, "checkpoint.keep": 0})
    out = tmp_path / "out"
    run_pipeline(load_pipeline(path, {"iterations": 2}), progress=False, inline=True)
    # the buffer moves to a disk with room for about one and a half more iterations;
    # everything else of the run stays where there is room
    shutil.copytree(out / "buffer.zarr", buffer_disk / "buffer.zarr")
    shutil.rmtree(out / "buffer.zarr")
    (out / "buffer.zarr").symlink_to(buffer_disk / "buffer.zarr")
    disk = shutil.disk_usage(buffer_disk)
    size_kib = (disk.used + disk.used * 3 // 4) // 1024  # 2 iterations used it
    subprocess.run(["mount", "-o", f"remount,size={size_kib}k", str(buffer_disk)],
                   check=True)

    run = [sys.executable, "-m", "rlhfflow.cli.main", "run", str(path), "--quiet"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("Error: no space left on device: ")
    assert "buffer.zarr" in lines[0]
    assert lines[0].endswith("free space and run the same command again to resume from the "
                             "last checkpoint")
    # what the buffer shows as committed is whole; the iteration whose write failed is
    # not among it, and no temporary file of the failed write is left
    buffer = ExperienceBuffer(out / "buffer.zarr")
    committed = buffer.iterations()
    assert committed == list(range(len(committed))) and 2 <= len(committed) < 6
    # (the next iteration may have begun: its arrays are made while one is in flight)
    assert buffer.uncommitted() and set(buffer.uncommitted()) <= {len(committed),
                                                                len(committed) + 1}
    _committed_iterations_read_whole(buffer)
    assert not list(buffer_disk.rglob("*.partial"))

    # moved to a disk with room, the run resumes from its last checkpoint, writes the
    # failed iteration again and completes with every iteration once
    (out / "buffer.zarr").unlink()
    shutil.copytree(buffer_disk / "buffer.zarr", out / "buffer.zarr")
    done = CliRunner().invoke(main, ["run", str(path)])
    assert done.exit_code == 0, done.output
    assert "resuming after iteration" in done.stderr
    assert [r["iteration"] for r in MetricsLog(out / "metrics.jsonl").read()] == list(range(6))
    buffer = ExperienceBuffer(out / "buffer.zarr")
    assert buffer.iterations() == list(range(6)) and buffer.uncommitted() == []
    _committed_iterations_read_whole(buffer)


@pytest.mark.parametrize("config", ["ppo", "grpo"])
def test_invalid_rewards_can_be_skipped_and_counted(tmp_path, config):
    (tmp_path / "holes.py").write_text(
        "def score(prompts, responses):\n"
        "    # every third response has no score; the others count their vowels\n"
        "    return [float('nan') if i % 3 == 0 else 0.5 + sum(c in 'aeiou' for c in r) / 16\n"
        "            for i, r in enumerate(responses)]\n")
    path = small_pipeline(tmp_path, config, overrides={
        "stages.reward.params.function": str(tmp_path / "holes.py") + ":score",
        "stages.reward.params.on_invalid": "skip"})
    result = run_pipeline(load_pipeline(path), progress=False, inline=True)
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr")
    learned_from = 0
    for record in result.metrics:
        data = buffer.read(record["iteration"])
        valid = data["score_valid"].astype(bool)
        assert record["samples_skipped"] == int((~valid).sum()) > 0
        assert record["reward_mean"] == pytest.approx(float(data["scores"][valid].mean()))
        assert (data["advantages"][~valid] == 0).all()  # no gradient from skipped samples
        learned_from += int((data["advantages"][valid] != 0).any())
        assert record["policy_loss"] is not None and math.isfinite(record["policy_loss"])
    assert learned_from > 0  # the scored samples still train the policy


# --------------------------------------------------------------------------- prompts, rewards


def test_validate_reads_the_prompts_file_and_names_a_bad_chat_turn(tmp_path):
    from click.testing import CliRunner

    from rlhfflow.cli.main import main

    prompts = _prompts(tmp_path, json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "bot", "content": "x"}]}))
    path = small_pipeline(tmp_path, overrides={"data.prompts": str(prompts)})
    expected = (f"{prompts}:3: messages[1].role: unknown role 'bot' (expected one of "
                f"system, user, assistant, tool, developer)")
    with pytest.raises(DataError) as err:
        load_pipeline(path)
    assert str(err.value) == expected
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stderr) == (2, f"Error: {expected}\n")


def test_a_chat_record_needs_a_tokenizer_with_a_template(tmp_path):
    prompts = _prompts(tmp_path, json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    path = small_pipeline(tmp_path, overrides={"data.prompts": str(prompts)})
    with pytest.raises(DataError, match=rf"^{prompts}:3: the tokenizer has no chat template "
                                        r"\(chat_template in its tokenizer_config.json\) to "
                                        r"render 'messages' records \(model 'actor'\)$"):
        load_pipeline(path)


def test_a_reward_argument_missing_from_a_record_is_named(tmp_path):
    (tmp_path / "exact.py").write_text(
        "def score(prompts, responses, answer):\n    return [0.0] * len(responses)\n")
    prompts = tmp_path / "qa.jsonl"
    prompts.write_text('{"prompt": "one plus one:", "answer": "2"}\n'
                       '{"prompt": "two plus two:"}\n')
    path = small_pipeline(tmp_path, overrides={
        "data.prompts": str(prompts),
        "stages.reward.params.function": str(tmp_path / "exact.py") + ":score"})
    with pytest.raises(SpecError) as err:
        load_pipeline(path)
    assert str(err.value) == (f"{path}: stages.reward.params.function: the reward function "
                              f"takes 'answer', which record {prompts}:2 does not have (give "
                              f"it a default, or add the field)")


def test_a_non_finite_loss_stops_the_run_naming_stage_iteration_and_model(tmp_path):
    # an absurd learning rate: the weights blow up in the first update, the next loss is NaN
    path = small_pipeline(tmp_path, "grpo", overrides={"models.actor.optimizer.lr": 1e30,
                                                       "models.actor.optimizer.grad_clip": None})
    with pytest.raises(RunError, match=r"^stage 'train_actor' failed in iteration \d: "
                                       r"NonFiniteError: model 'actor': (loss|gradient norm) "
                                       r"is (nan|inf)") as err:
        run_pipeline(load_pipeline(path), progress=False, inline=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("body", "expected"), [
    ("return [undefined_scale * len(r) for r in responses]",
     "reward function score() raised at {file}:2: NameError: name 'undefined_scale' is not "
     "defined"),
    ("import not_a_module_anywhere\n    return [0.0] * len(responses)",
     "reward function score() raised at {file}:2: ModuleNotFoundError: No module named "
     "'not_a_module_anywhere'"),
    ("import math\n    return [math.sqr(len(r)) for r in responses]",
     "reward function score() raised at {file}:3: AttributeError: module 'math' has no "
     "attribute 'sqr'"),
    ("return 'good'", "reward function score() returned str for 2 responses; {convention}"),
    ("return [1.0, 0.0, 1.0]", "reward function score() returned 3 numbers for 2 responses; "
                               "{convention}"),
    ("return [1.0]", "reward function score() returned 1 number for 2 responses; "
                     "{convention}"),
    ("return None", "reward function score() returned NoneType for 2 responses; "
                    "{convention}"),
])
def test_a_reward_function_is_tried_at_validation(tmp_path, body, expected):
    (tmp_path / "bad_reward.py").write_text(f"def score(prompts, responses):\n    {body}\n")
    path = small_pipeline(tmp_path, overrides={
        "stages.reward.params.function": "bad_reward.py:score"})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stdout) == (2, "")
    fix = "fix it (or set params.check: false to skip the trial)"
    expected = expected.format(file=tmp_path / "bad_reward.py", convention=CONVENTION)
    assert result.stderr == (
        f"Error: {path}: stages.reward.params.function: a trial call on two rows (the first "
        f"prompt records, made-up responses) failed: {expected}"
        f"{'; ' + fix if 'raised' in expected else ''}\n")
    result = CliRunner().invoke(main, ["validate", str(path),
                                       "stages.reward.params.check=false"])
    assert (result.exit_code, result.stderr) == (0, "")


def test_a_reward_that_may_need_a_real_response_is_only_a_warning(tmp_path):
    # re.search(...).group() on a made-up response: a real one may well have the answer
    (tmp_path / "judge.py").write_text(
        "import re\n"
        "def score(prompts, responses):\n"
        "    return [float(re.search(r'#### (\\w+)', r).group(1) == 'x') for r in responses]\n")
    path = small_pipeline(tmp_path, overrides={"stages.reward.params.function": "judge.py:score"})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0
    assert result.stderr == (
        f"warning: {path}: stages.reward.params.function: a trial call on two rows (the "
        f"first prompt records, made-up responses) failed: reward function score() raised "
        f"at {tmp_path / 'judge.py'}:3: AttributeError: 'NoneType' object has no attribute "
        f"'group'; the made-up responses may cause that where real ones do not ({CONVENTION}): "
        f"if real responses do not, set params.check: false\n")


def test_the_trial_call_gets_the_first_records_and_their_fields(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "seen.py").write_text(
        "import json, pathlib\n"
        "def score(prompts, responses, answer):\n"
        "    pathlib.Path(__file__).with_suffix('.json').write_text(\n"
        "        json.dumps([prompts, responses, answer]))\n"
        "    return [1.0] * len(responses)\n")
    path = small_pipeline(tmp_path, batch_size=2, overrides={
        "data.prompts": str(prompts), "stages.reward.params.function": "seen.py:score"})
    load_pipeline(path)
    assert json.loads((tmp_path / "seen.json").read_text()) == [
        ["2+2=", "1+1="], ["The answer is 42.", "I think it is 7."], ["4", "2"]]


def test_the_trial_call_gives_a_trl_style_reward_the_chat_records_messages(
        tmp_path, chat_lm_dir):
    prompts = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "2+2?"}]
    prompts.write_text("".join(json.dumps({"messages": chat, "answer": a}) + "\n"
                               for a in ("4", "2")))
    (tmp_path / "trl.py").write_text(
        "import json, pathlib\n"
        "def correct(prompts, completions, answer, **kwargs):\n"
        "    pathlib.Path(__file__).with_suffix('.json').write_text(\n"
        "        json.dumps([prompts, completions, answer]))\n"
        "    return [float(a in c[0]['content']) for c, a in zip(completions, answer)]\n")
    path = small_pipeline(tmp_path, batch_size=2, overrides={
        "data.prompts": str(prompts), "stages.reward.params.function": "trl.py:correct",
        "models.actor": {"path": str(chat_lm_dir), "trainable": True}})
    load_pipeline(path)
    assert json.loads((tmp_path / "trl.json").read_text()) == [
        [chat, chat], [[{"role": "assistant", "content": "The answer is 42."}],
                       [{"role": "assistant", "content": "I think it is 7."}]], ["4", "2"]]
    # a mistake in its code is caught by the same trial call
    (tmp_path / "typo.py").write_text(
        "def correct(prompts, completions, **kwargs):\n"
        "    return [float('4' in c[0]['contents']) for c in completions]\n")
    path = small_pipeline(tmp_path, batch_size=2, overrides={
        "data.prompts": str(prompts), "stages.reward.params.function": "typo.py:correct",
        "models.actor": {"path": str(chat_lm_dir), "trainable": True}})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert "KeyError: 'contents'" in result.stderr


@pytest.mark.parametrize("on_error", ["error", "skip"])
def test_a_reward_function_out_of_memory_stops_the_run_and_is_never_skipped(tmp_path,
                                                                           on_error):
    # the machine is short, not the samples bad: skipping them would hide it
    (tmp_path / "huge.py").write_text(
        "import numpy as np\n"
        "def score(prompts, responses):\n"
        "    return np.empty((2**40, 2**20), dtype=np.float32).sum(axis=1)[:len(prompts)]\n")
    path = small_pipeline(tmp_path, overrides={
        "stages.reward.params.function": str(tmp_path / "huge.py") + ":score",
        "stages.reward.params.on_error": on_error})
    with pytest.raises(RunError) as failed:
        run_pipeline(load_pipeline(path), progress=False, inline=True)
    line = str(failed.value)
    assert line.startswith("out of memory: stage 'reward' in iteration 0 could not allocate "
                           "(MemoryError: Unable to allocate 4.00 EiB for an array with shape "
                           "(1099511627776, 1048576) and data type float32); give the workers "
                           "more memory (cluster.memory_limit"), line
    assert "\n" not in line
    assert not (tmp_path / "out" / "errors").exists()  # nothing listed as a bad sample
