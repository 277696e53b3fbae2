"""The ``rlhfflow`` command: validate, help texts, init, buffer inspect, as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from rlhfflow import __version__
from rlhfflow.cli.init import starter_prompts
from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.storage.buffer import ColumnSpec, ExperienceBuffer

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_validate_ppo() -> None:
    result = invoke("validate", str(CONFIGS / "ppo-tiny.yaml"))
    assert (result.exit_code, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    assert lines[:2] == [f"{CONFIGS / 'ppo-tiny.yaml'}: valid", "name: ppo-tiny"]
    for line in ["  actor   lm     trainable  tiny llama (2 layers, hidden 64)",
                 "  critic  value  trainable  from actor",
                 "  ref     lm     frozen     from actor",
                 "  generate      generate      @actor",
                 "  advantages    advantages    -",
                 "iterations: 30",
                 f"data: {CONFIGS / 'data' / 'prompts.jsonl'}, 32 prompts x 1 samples per prompt"
                 " = 32 rows per iteration",
                 "cluster: 2 local workers (device auto)",
                 f"output: {Path.cwd().resolve() / 'runs' / 'ppo-tiny'}"]:
        assert line in lines
    stages = lines[lines.index("stages (in order):") + 1:lines.index("iterations: 30")]
    assert [s.split()[0] for s in stages] == [
        "generate", "reward", "ref_logprob", "old_logprob", "values", "advantages",
        "train_actor", "train_critic"]


def test_validate_grpo() -> None:
    result = invoke("validate", str(CONFIGS / "grpo-tiny.yaml"))
    assert result.exit_code == 0
    assert "name: grpo-tiny" in result.stdout
    assert "8 prompts x 4 samples per prompt = 32 rows per iteration" in result.stdout
    assert "critic" not in result.stdout


def test_validate_a_directory() -> None:
    result = invoke("validate", str(CONFIGS))
    assert result.exit_code == 2
    assert "is a directory" in result.stderr


@pytest.mark.parametrize("command", [[], ["validate"], ["graph"], ["init"], ["run"],
                                     ["buffer"], ["buffer", "inspect"]],
                         ids=lambda c: " ".join(c) or "rlhfflow")
def test_help_has_an_example(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "Example:\n    rlhfflow " in result.stdout  # \b kept the example's layout


def test_every_option_has_help() -> None:
    def commands(group):
        for cmd in group.commands.values():
            yield cmd
            yield from commands(cmd) if hasattr(cmd, "commands") else ()

    for cmd in commands(main):
        for param in cmd.params:
            if param.param_type_name == "option":
                assert param.help, f"{cmd.name} {param.opts} has no help"


def test_version() -> None:
    result = invoke("--version")
    assert (result.exit_code, result.stdout) == (0, f"rlhfflow, version {__version__}\n")


# --------------------------------------------------------------------------- init


def test_init_writes_a_project_that_validates(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    project = tmp_path / "demo"
    result = invoke("init", str(project))
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.splitlines()[-2:] == ["next:", f"  rlhfflow run {project}/pipeline.yaml"]
    assert sorted(p.name for p in project.iterdir()) == ["models", "pipeline.yaml",
                                                         "prompts.jsonl"]
    model_dir = project / "models" / "tiny-lm"
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    prompts = [json.loads(line)["prompt"]
               for line in (project / "prompts.jsonl").read_text().splitlines()]
    assert prompts == starter_prompts() and len(set(prompts)) == 64
    assert "describe the sun:" in prompts and "sing about a tree and the moon:" in prompts

    pipeline = load_pipeline(project / "pipeline.yaml")
    assert pipeline.spec.models["actor"].path == "models/tiny-lm"
    assert pipeline.spec.iterations == 20 and pipeline.spec.output is None
    assert pipeline.output_dir == tmp_path / "runs" / "starter"
    assert pipeline.prompts_path == project / "prompts.jsonl"
    assert invoke("validate", str(project / "pipeline.yaml")).exit_code == 0


def test_init_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    result = invoke("init", str(tmp_path))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"Error: {tmp_path}: directory is not empty; use --force to " \
                            "write into it\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]

    result = invoke("init", str(tmp_path), "--force")
    assert result.exit_code == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert load_pipeline(tmp_path / "pipeline.yaml").name == "starter"


def test_init_into_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = invoke("init", str(tmp_path / "file"))
    assert result.exit_code == 2
    assert "is a file" in result.stderr


# --------------------------------------------------------------------------- buffer


def make_buffer(path: Path) -> None:
    buf = ExperienceBuffer(path)
    columns = {"scores": ColumnSpec("float32"), "response_ids": ColumnSpec("int64", (3,))}
    buf.begin_iteration(0, rows=4, columns=columns, chunk_rows=2)
    ExperienceBuffer.write_rows(path, 0, 0, {
        "scores": np.array([0.0, 1.0, 2.0, 3.0], dtype=np.float32),
        "response_ids": np.arange(12).reshape(4, 3)})
    buf.commit(0)
    buf.begin_iteration(1, rows=4, columns=columns, chunk_rows=2)  # never committed


def test_buffer_inspect(tmp_path: Path) -> None:
    make_buffer(tmp_path / "buffer.zarr")
    result = invoke("buffer", "inspect", str(tmp_path / "buffer.zarr"))
    assert (result.exit_code, result.stderr) == (0, "")
    lines = [line.split() for line in result.stdout.splitlines()]
    assert ["iteration", "0", "rows=4"] in lines
    assert ["column", "shape", "dtype", "mean", "std", "min", "max"] in lines
    assert ["response_ids", "4x3", "int64", "5.5", "3.452", "0", "11"] in lines
    assert ["scores", "4", "float32", "1.5", "1.118", "0", "3"] in lines
    assert ["iter_000001:", "incomplete", "(ignored)"] in lines


def test_buffer_inspect_missing_path(tmp_path: Path) -> None:
    result = invoke("buffer", "inspect", str(tmp_path / "nope.zarr"))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"Error: no experience buffer (zarr group) at {tmp_path}/nope.zarr\n"


def test_real_process(tmp_path: Path) -> None:
    """The module runs as a program; quick commands do not pay for torch."""
    command = [sys.executable, "-m", "rlhfflow.cli.main"]
    proc = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"rlhfflow, version {__version__}\n")
    proc = subprocess.run([*command, "buffer", "inspect", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"Error: no experience buffer (zarr group) at {tmp_path}\n"
    code = ("import sys, rlhfflow.cli.main, rlhfflow.storage.buffer; "
            "print(sorted({'torch', 'transformers', 'dask'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout == "[]\n"


def test_plan_explains_why_each_task_waits_and_names_an_unknown_stage():
    runner = CliRunner()
    result = runner.invoke(main, ["plan", str(CONFIGS / "ppo-tiny.yaml"), "--explain",
                                  "train_critic"])
    assert result.exit_code == 0, result.output
    assert "train_critic: 1 task(s) in iteration 1" in result.output
    assert "    updated: train_critic (iteration 0): they train critic in the previous " \
           "iteration and it uses the updated weights" in result.output
    bad = runner.invoke(main, ["plan", str(CONFIGS / "ppo-tiny.yaml"), "--explain", "critc"])
    assert bad.exit_code == 2
    assert bad.output.count("\n") == 1 and "no stage 'critc'" in bad.output


def test_quiet_and_verbose_set_how_much_the_run_prints(tmp_path):
    """Progress is logged under the rlhfflow logger; the command prints it at INFO,
    --quiet leaves warnings and results, --verbose adds each submitted task."""
    from tests.conftest import small_pipeline

    path = small_pipeline(tmp_path, "grpo", iterations=1)
    runner = CliRunner()
    quiet = runner.invoke(main, ["-q", "run", str(path), "--overwrite"])
    assert quiet.exit_code == 0, quiet.output
    assert "1/1  reward" not in quiet.output and "output:" in quiet.output
    verbose = runner.invoke(main, ["-v", "run", str(path), "--overwrite"])
    assert verbose.exit_code == 0, verbose.output
    assert "1/1  reward" in verbose.output and "rlhfflow: submit generate" in verbose.output
    both = runner.invoke(main, ["-q", "-v", "validate", str(path)])
    assert both.exit_code == 2 and "--quiet and --verbose both given" in both.output


@pytest.mark.parametrize("command", ["validate", "plan", "run", "profile"])
def test_key_value_arguments_after_the_file_override_like_set(command: str) -> None:
    # as veRL and Hydra take them; a bad value is the same one line as in the file
    file = str(CONFIGS / "grpo-tiny.yaml")
    extra = ["--scheduler", "tcp://127.0.0.1:1"] if command == "run" else []
    result = invoke(command, file, "algorithm.kl_coef=-1", *extra)
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"Error: {file}: algorithm.kl_coef: expected a number >= 0, got -1\n"


def test_a_key_value_argument_is_applied() -> None:
    result = invoke("validate", str(CONFIGS / "grpo-tiny.yaml"), "iterations=3",
                    "--set", "data.batch_size=4")
    assert result.exit_code == 0
    assert "iterations: 3" in result.stdout.splitlines()
    assert "4 prompts x 4 samples per prompt = 16 rows per iteration" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "iterations", "5"], "--set expects KEY=VALUE; got 'iterations' (did you mean "
                                   "--set iterations=5?)"),
    (["--set=iterations", "5"], "--set expects KEY=VALUE; got 'iterations' (did you mean "
                                "--set iterations=5?)"),
    (["--set", "iterations"], "--set expects KEY=VALUE; got 'iterations'"),
    (["iterations"], "expected FILE and then KEY=VALUE overrides (e.g. algorithm.kl_coef=0.1); "
                     "got 'iterations'"),
    (["iterations=3", "--set", "iterations=4"], "--set iterations: given twice; keep one"),
])
@pytest.mark.parametrize("command", ["validate", "plan", "run", "profile"])
def test_an_override_without_an_equals_sign_is_one_line(command: str, args: list[str],
                                                       message: str) -> None:
    # --scheduler: no embedded cluster, whose fork server run starts before it reads --set
    extra = ["--scheduler", "tcp://127.0.0.1:1"] if command == "run" else []
    result = invoke(command, str(CONFIGS / "grpo-tiny.yaml"), *extra, *args)
    assert (result.exit_code, result.stderr, result.stdout) == (2, f"Error: {message}\n", "")


def test_set_with_a_space_is_one_line_from_a_real_process() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlhfflow.cli.main", "run", str(CONFIGS / "grpo-tiny.yaml"),
         "--set", "iterations", "5"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "RLHFFLOW_WARM": "0"})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("Error: --set expects KEY=VALUE; got 'iterations' (did you mean "
                             "--set iterations=5?)\n")
