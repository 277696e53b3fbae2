"""The documentation stays true to the code: the reference pages are what the code
generates now, every pipeline key is described, the site builds without a warning, and the
README stays a README."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import typing

import click
import pytest
import yaml
from click.testing import CliRunner
from pydantic import BaseModel

from rlhfflow.cli import docs
from rlhfflow.cli.main import main
from rlhfflow.config import spec
from rlhfflow.config.spec import AlgorithmSpec
from rlhfflow.sdk.reference import describe_stage_types, render_markdown
from tests.conftest import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
QUICK_START = ("make run     # creates .venv, installs rlhfflow into it, runs the PPO demo\n"
               "make test    # ruff, mypy, then the whole test suite\n")


def doc_pages() -> list:
    return sorted(DOCS.rglob("*.md"))


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("page", sorted(docs.PAGES))
def test_each_generated_reference_page_is_what_the_code_generates_now(page):
    committed = (DOCS / page).read_text(encoding="utf-8")
    assert committed == docs.PAGES[page](), (
        f"docs/{page} is stale: regenerate it with `python -m rlhfflow.cli.docs --write`")


def test_every_field_of_every_spec_model_has_a_description():
    models = {m for _, m in docs.spec_sections()}
    models |= {obj for obj in vars(spec).values()
               if isinstance(obj, type) and issubclass(obj, spec.Strict) and obj is not spec.Strict}
    missing = [f"{m.__name__}.{name}" for m in models
               for name, info in m.model_fields.items() if not (info.description or "").strip()]
    assert missing == []


def test_the_pipeline_reference_has_a_section_for_every_nested_model():
    sections = dict(docs.spec_sections())
    assert {"", "models.NAME", "models.NAME.tiny", "models.NAME.optimizer", "models.NAME.lora",
            "stages.NAME",
            "stages.NAME.deepspeed", "data", "data.sources[i]", "algorithm", "algorithm.off_policy",
            "cluster", "placement", "overlap",
            "checkpoint", "logging", "logging.mlflow",
            "logging.wandb", "logging.trackio"} == set(sections)
    page = docs.pipeline_reference()
    for model in sections.values():
        for name, info in model.model_fields.items():
            assert f"| `{info.alias or name}` |" in page
    # a constrained alias inside an optional keeps its bound: grad_clip is `float > 0 or null`
    assert "| `grad_clip` | float > 0 or null | `1.0` |" in page


def test_the_stage_page_holds_what_rlhfflow_stages_prints_as_markdown():
    result = CliRunner().invoke(main, ["stages", "--format", "markdown", "--builtin-only"])
    assert result.exit_code == 0, result.output
    expected = render_markdown(describe_stage_types(AlgorithmSpec(), builtin_only=True))
    assert result.output == expected
    assert (DOCS / "reference" / "stages.md").read_text(encoding="utf-8").endswith(expected)


def test_the_cli_page_lists_every_command_and_option():
    page = docs.cli_reference()
    for path, cmd in docs._commands(main, "rlhfflow"):
        assert f"## `{path}`" in page
        for param in cmd.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("-"):
                    assert f"`{opt}`" in page, (path, opt)


def test_the_check_command_names_a_stale_page_and_write_repairs_it(tmp_path):
    target = tmp_path / "docs"
    shutil.copytree(DOCS / "reference", target / "reference")
    (target / "reference" / "cli.md").write_text("stale\n")
    runner = CliRunner()
    result = runner.invoke(docs.cli, ["--check", "--docs", str(target)])
    assert result.exit_code == 1 and "reference/cli.md" in result.output
    assert runner.invoke(docs.cli, ["--write", "--docs", str(target)]).exit_code == 0
    result = runner.invoke(docs.cli, ["--check", "--docs", str(target)])
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- pages


def test_the_readme_is_short_and_keeps_the_two_quick_start_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert f"```bash\n{QUICK_START}```" in text
    # .ci/run runs the README's test command
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_readme_links_only_to_pages_that_exist():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\((docs/[^)#]+)", text)
    assert targets
    assert [t for t in targets if not (REPO / t).is_file()] == []


@pytest.mark.parametrize("page", [README, *doc_pages()], ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_reads_like_a_lab_notebook(page):
    assert "this session" not in page.read_text(encoding="utf-8").lower()


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}


def _all_commands(command: click.Command):
    yield command
    for sub in getattr(command, "commands", {}).values():
        yield from _all_commands(sub)


def test_every_flag_the_docs_show_on_an_rlhfflow_command_is_an_option_of_it():
    """``rlhfflow run X.yaml --inline`` in a page (a code block, its continued lines
    joined, or a code span) names a flag that ``rlhfflow run`` must have."""
    wrong = []
    for page in [README, *doc_pages()]:
        text = re.sub(r"\\\n\s*", " ", page.read_text(encoding="utf-8"))
        for shown in re.finditer(r"\brlhfflow((?:[ \t]+[^\s`|;&)#]+)+)", text):
            words, command, path = shown.group(1).split(), main, ["rlhfflow"]
            while isinstance(command, click.Group) and words and words[0] in command.commands:
                path.append(words[0])
                command = command.commands[words.pop(0)]
            wrong += [f"{page.relative_to(REPO)}: {' '.join(path)} {flag}"
                      for flag in (w.split("=")[0] for w in words if w.startswith("--"))
                      if flag not in _options(command)]
    assert wrong == []


def test_a_flag_the_docs_show_alone_is_an_option_of_a_command_they_document():
    """A flag in a code span of its own (`--inline`) is an option of an ``rlhfflow``
    command, of Dask's scheduler or worker, or of a script in the repository."""
    from distributed.cli import dask_scheduler, dask_worker

    known = set().union(*map(_options, _all_commands(main)))
    known |= _options(dask_scheduler.main) | _options(dask_worker.main)
    for script in [*REPO.glob("benchmarks/*.py"), *REPO.glob("examples/**/*.py"),
                   *REPO.glob("gpu/*.py")]:
        known |= set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", script.read_text()))
    wrong = []
    for page in [README, *doc_pages()]:
        for span in re.findall(r"`(--[^`]*)`", page.read_text(encoding="utf-8")):
            for flag in (w.split("=")[0] for w in span.split() if w.startswith("--")):
                prefix = flag.removesuffix("*")  # `--tls-*`: any of them
                if not any(k == flag or (prefix != flag and k.startswith(prefix))
                           for k in known):
                    wrong.append(f"{page.relative_to(REPO)}: {flag}")
    assert wrong == []


def test_the_nav_holds_every_page_and_every_page_is_in_the_nav():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(node: typing.Any) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        return [p for value in node.values() for p in pages(value)]

    nav = pages(config["nav"])
    assert len(nav) == len(set(nav))
    assert sorted(nav) == sorted(str(p.relative_to(DOCS)) for p in doc_pages())
    top = [next(iter(item)) for item in config["nav"]]
    assert top == ["Home", "Getting started", "Concepts", "How-to guides", "Reference",
                   "Design", "Performance", "Changelog"]


def test_the_code_cites_docs_pages_that_exist_and_no_design_md():
    cited = set()
    for path in (REPO / "rlhfflow").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "DESIGN.md" not in text, path
        cited |= set(re.findall(r"docs/[\w/-]+\.md", text))
    assert cited
    assert sorted(p for p in cited if not (REPO / p).is_file()) == []


def test_every_benchmark_has_a_performance_page():
    pages = "\n".join(p.read_text(encoding="utf-8") for p in (DOCS / "performance").glob("*.md"))
    helpers = {"shared.py", "gpumem.py"}  # imported by the benchmarks, not run alone
    scripts = [p.name for p in (REPO / "benchmarks").glob("*.py") if p.name not in helpers]
    assert [s for s in scripts if f"benchmarks/{s}" not in pages] == []


def test_a_benchmark_appends_its_result_with_date_machine_and_command(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from shared import emit_result
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    for ratio in (1.25, 1.5):
        path = emit_result({"ratio": ratio}, "benchmarks/overhead.py", tmp_path)
    assert path == tmp_path / "overhead.jsonl"
    assert capsys.readouterr().out.splitlines()[-1] == '{"ratio": 1.5}'
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["result"] for r in records] == [{"ratio": 1.25}, {"ratio": 1.5}]
    assert records[0]["machine"]["cores"] >= 1 and records[0]["machine"]["cpu"]
    assert records[0]["date"] and records[0]["command"]


# --------------------------------------------------------------------------- the site


def test_the_site_builds_strictly_without_a_warning(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (the 'docs' extra: pip install -e '.[docs]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr
    assert (tmp_path / "site" / "reference" / "pipeline" / "index.html").is_file()


def test_the_models_the_reference_walks_are_the_spec_models():
    from rlhfflow.spec import algorithm

    walked = {m for _, m in docs.spec_sections()}
    defined = {obj for module in (spec, algorithm) for obj in vars(module).values()
               if isinstance(obj, type) and issubclass(obj, BaseModel)
               and obj.__module__ == module.__name__}
    assert walked == defined
