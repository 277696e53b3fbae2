"""Prompts from Hub data sets (``data.prompts: org/name``), field renames and mixed sources.

The Hub cache is a real one, laid out in ``tmp_path`` as huggingface_hub lays out a data
set repository (``datasets--org--name/snapshots/<commit>/`` and ``refs/main``), its files
written by ``datasets`` where installed; ``HF_HUB_CACHE`` points at it and
huggingface_hub's own lookup finds it. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.data import source as source_module
from rlhfflow.data.hub import HubDataError, locate
from rlhfflow.data.records import DataError
from rlhfflow.data.source import KEEP_EPOCHS, KEEP_PICKS, PromptSource
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage.metrics import MetricsLog
from tests.conftest import small_pipeline

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# acme/math
"""
QUESTIONS = {"train": ["what is one and one:", "what is two and two:", "name a star:",
                       "name a tree:"], "test": ["what is ten:"]}


def _write_rows(path: Path, rows: dict[str, list[str]]) -> None:
    """Parquet through ``datasets`` when it is installed (as the Hub stores data), else
    JSONL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import datasets
    except ImportError:
        lines = [json.dumps(dict(zip(rows, values, strict=True)))
                 for values in zip(*rows.values(), strict=True)]
        path.with_suffix(".jsonl").write_text("\n".join(lines) + "\n")
    else:
        datasets.Dataset.from_dict(rows).to_parquet(str(path.with_suffix(".parquet")))


@pytest.fixture
def hub_data(tmp_path: Path, monkeypatch) -> Path:
    """An HF cache holding data set ``acme/math`` (subsets main and socratic) and
    ``acme/chat`` (no card: a ``data/train-*`` file of chats); HF_HUB_CACHE set."""
    cache = tmp_path / "hf-cache"
    repo = cache / "datasets--acme--math"
    snapshot = repo / "snapshots" / COMMIT
    for split, questions in QUESTIONS.items():
        _write_rows(snapshot / "main" / f"{split}-00000-of-00001",
                    {"question": questions, "answer": [str(i) for i in range(len(questions))]})
    _write_rows(snapshot / "socratic" / "train-00000-of-00001",
                {"question": ["why is the sky:"], "answer": ["air"]})
    (snapshot / "README.md").write_text(CARD)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    chat = cache / "datasets--acme--chat"
    (chat / "snapshots" / COMMIT / "data").mkdir(parents=True)
    (chat / "snapshots" / COMMIT / "data" / "train-00000-of-00001.jsonl").write_text(
        "".join(json.dumps({"conversation": [{"role": "user", "content": f"say {w}:"}]}) + "\n"
                for w in ("red", "blue", "green")))
    (chat / "refs").mkdir()
    (chat / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return snapshot


def _pipeline(tmp_path: Path, data: dict, **kw) -> Path:
    overrides = {f"data.{k}": v for k, v in data.items()}
    return small_pipeline(tmp_path, "grpo", iterations=kw.get("iterations", 1), batch_size=4,
                          overrides={"data.prompts": None, **overrides})


def test_an_id_resolves_to_the_files_of_its_subset_and_split(hub_data: Path, tmp_path) -> None:
    assert [p.name for p in locate("acme/math", tmp_path, "test", "main")] == \
        [p.name for p in (hub_data / "main").glob("test-*")]
    assert locate("acme/math", tmp_path, "train", "socratic")[0].parent.name == "socratic"
    assert locate("acme/chat", tmp_path)[0].name == "train-00000-of-00001.jsonl"
    local = tmp_path / "acme" / "math"  # a path that exists wins over the id
    local.parent.mkdir()
    local.write_text('{"prompt": "x"}\n')
    assert locate("acme/math", tmp_path) == [local]


@pytest.mark.parametrize("args, key, message", [
    (("acme/nope",), "prompts", "'acme/nope' is not a local file or directory and not in the "
     "Hugging Face cache (HF_HUB_CACHE={cache}); fetch it first with `hf download "
     "--repo-type dataset acme/nope` or `python -c \"import datasets; "
     "datasets.load_dataset('acme/nope')\"`"),
    (("acme/math", "train", "mian"), "subset",
     "'acme/math' has no subset 'mian' (it has main, socratic)"),
    (("acme/math", "train"), "subset",
     "'acme/math' has several subsets (main, socratic): choose one"),
    (("acme/math", "tset", "main"), "split",
     "'acme/math' subset 'main' has no split 'tset' (it has train, test)"),
])
def test_what_the_cache_lacks_is_one_line_naming_the_key(hub_data, tmp_path, args, key,
                                                         message) -> None:
    with pytest.raises(HubDataError) as caught:
        locate(args[0], tmp_path, *args[1:])
    assert caught.value.key == key
    assert str(caught.value) == message.format(cache=hub_data.parents[2])


def test_a_pipeline_validates_and_runs_from_a_hub_id(hub_data: Path, tmp_path: Path) -> None:
    path = _pipeline(tmp_path, {"prompts": "acme/math", "subset": "main",
                                "prompt_field": "question"})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "data: acme/math, 4 prompts x 4 samples per prompt" in result.output
    pipeline = load_pipeline(path)
    source = PromptSource.from_pipeline(pipeline, "actor")
    assert sorted(source.texts) == sorted(QUESTIONS["train"])
    assert source.fields[0].keys() == {"answer"}  # reaches reward functions
    run_pipeline(pipeline, progress=False, inline=True)
    (record,) = MetricsLog(tmp_path / "out" / "metrics.jsonl").read()
    assert record["samples"] == 16


def test_records_without_the_prompt_field_name_the_obvious_one(hub_data, tmp_path) -> None:
    with pytest.raises(SpecError) as caught:
        load_pipeline(_pipeline(tmp_path, {"prompts": "acme/math", "subset": "main"}))
    assert str(caught.value) == (
        f"{tmp_path / 'grpo-small.yaml'}: data.prompt_field: records have no 'prompt'; they "
        f"have 'question', 'answer': set data.prompt_field: question")


def test_renames_and_the_messages_field_apply_to_every_record(hub_data, tmp_path) -> None:
    pipeline = load_pipeline(_pipeline(tmp_path, {
        "prompts": "acme/math", "subset": "main", "rename": {"question": "prompt",
                                                              "answer": "solution"}}))
    source = PromptSource.from_pipeline(pipeline, "actor")
    assert {f["solution"] for f in source.fields} == {"0", "1", "2", "3"}
    with pytest.raises(SpecError, match=r"data\.rename\.questoin: no record has a field "
                       r"'questoin'; did you mean 'question'\?"):
        load_pipeline(_pipeline(tmp_path, {"prompts": "acme/math", "subset": "main",
                                           "rename": {"questoin": "prompt"}}))
    with pytest.raises(DataError, match=r"train-00000-of-00001\.jsonl:1: a 'messages' record "
                       r"needs a chat template"):  # the chats are read as chats
        load_pipeline(_pipeline(tmp_path, {"prompts": "acme/chat",
                                           "messages_field": "conversation",
                                           "chat_template": False}))


def test_sources_mix_by_weight_in_a_fixed_order(hub_data, tmp_path, monkeypatch) -> None:
    local = tmp_path / "local.jsonl"
    local.write_text("".join(json.dumps({"prompt": f"say {w}:"}) + "\n"
                             for w in ("a", "b", "c", "d", "e", "f", "g")))
    data = {"sources": [{"prompts": str(local), "weight": 0.75},
                        {"prompts": "acme/math", "subset": "main", "weight": 0.25,
                         "rename": {"question": "prompt"}}]}
    pipeline = load_pipeline(_pipeline(tmp_path, data))
    source = PromptSource.from_pipeline(pipeline, "actor")
    math = set(QUESTIONS["train"])
    batches = [[source.texts[i] for i in source.prompt_indices(k)] for k in range(6)]
    assert [sum(t in math for t in batch) for batch in batches] == [1] * 6  # 3:1 in each
    again = PromptSource.from_pipeline(pipeline, "actor")  # a resume: the same prompts
    assert [again.texts[i] for i in again.prompt_indices(5)] == batches[5]
    # a long run keeps a few batches of the stream and a few epochs, not all of them; an
    # earlier batch asked for again (a resume reading back) is the same
    later = [again.prompt_indices(k) for k in range(6, 60)]
    assert len(again._picks) <= KEEP_PICKS * again.batch_size
    assert len(again._epochs) <= KEEP_EPOCHS * len(again.members)
    assert [again.texts[i] for i in again.prompt_indices(5)] == batches[5]
    monkeypatch.setattr(source_module, "KEEP_PICKS", 10**6)  # a source that forgets nothing
    monkeypatch.setattr(source_module, "KEEP_EPOCHS", 10**6)
    keeping = PromptSource.from_pipeline(pipeline, "actor")
    assert [keeping.prompt_indices(k) for k in range(60)][6:] == later
    # every prompt of a source once per pass over it (4 math prompts in 4 batches)
    assert {t for batch in batches[:4] for t in batch if t in math} == math
    with pytest.raises(SpecError, match=r"data\.sources\[1\]\.subset: 'acme/math' has no "
                       r"subset 'x'"):
        load_pipeline(_pipeline(tmp_path, {"sources": [{"prompts": str(local)},
                                                       {"prompts": "acme/math",
                                                        "subset": "x"}]}))


def test_prompts_and_sources_exclude_each_other(tmp_path) -> None:
    with pytest.raises(SpecError, match="data: expected exactly one of 'prompts' and "
                       "'sources'; got neither"):
        load_pipeline(_pipeline(tmp_path, {}))
