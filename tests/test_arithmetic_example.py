"""examples/arithmetic: the data script, the exact-match reward, and the GRPO config.

The real run (SmolLM2-135M-Instruct, minutes) is a documented command; here the config is
validated as written, next to a tiny chat model standing in for the checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from rlhfflow.cli.main import main
from tests.conftest import REPO, example_module

EXAMPLE = REPO / "examples" / "arithmetic"



def test_the_data_is_seeded_held_out_and_right() -> None:
    make_data = example_module("arithmetic", "make_data")
    train, test = make_data.make_records("add2", 300, 50, seed=3)
    assert (train, test) == make_data.make_records("add2", 300, 50, seed=3)
    assert train != make_data.make_records("add2", 300, 50, seed=4)[0]
    questions = [r["messages"][0]["content"] for r in train + test]
    assert len(set(questions)) == 350
    for record in train + test:
        (turn,) = record["messages"]
        a, b = turn["content"].removeprefix("What is ").split("?")[0].split(" + ")
        assert turn["role"] == "user" and record["answer"] == str(int(a) + int(b))


def test_the_script_writes_both_files(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--train", "20",
                           "--test", "5", "--task", "mul", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(lines) == 20 and len((tmp_path / "test.jsonl").read_text().splitlines()) == 5
    record = json.loads(lines[0])
    a, b = record["messages"][0]["content"].removeprefix("What is ").split("?")[0].split(" * ")
    assert record["answer"] == str(int(a) * int(b))


def test_exact_match_reads_the_last_number() -> None:
    exact_match = example_module("arithmetic", "reward").exact_match
    responses = ["23 + 58 = 81", "The answer is 81.", "81.5", "about 80", "", "1,081",
                 "81 or 82", " 81 "]
    answers = ["81", "81", "81", "81", "81", "1081", "81", "81"]
    assert exact_match([""] * 8, responses, answers) == [1, 1, 0, 0, 0, 1, 0, 1]


def test_the_config_validates(tmp_path: Path, chat_lm_dir: Path) -> None:
    """grpo.yaml as written, with its data made by the script and a tiny chat model at the
    path where the import command puts SmolLM2."""
    example = tmp_path / "examples" / "arithmetic"
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("data", "__pycache__"))
    shutil.copytree(chat_lm_dir, tmp_path / "models" / "smollm2-135m")
    subprocess.run([sys.executable, str(example / "make_data.py")], check=True,
                   capture_output=True, timeout=60)
    # in-process: the CLI as a program is test_cli's and test_spec's to check
    result = CliRunner().invoke(main, ["validate", str(example / "grpo.yaml")])
    assert result.exit_code == 0, result.output
    assert "4 prompts x 8 samples per prompt = 32 rows per iteration" in result.stdout
