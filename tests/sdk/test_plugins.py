"""Stage types as plugins: entry points, import paths, capabilities, the reference, and
the example plugin package installed with pip and run on a real Dask cluster."""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from distributed import Client

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import AlgorithmSpec, SpecError
from rlhfflow.plan.auto.planner import resolve_plan
from rlhfflow.runtime.cluster import local_cluster
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.sdk import registry as base
from rlhfflow.sdk.reference import describe_stage_types
from rlhfflow.storage import ExperienceBuffer, MetricsLog
from tests.conftest import REPO, small_pipeline

PLUGIN = REPO / "examples" / "rlhfflow-example-plugin"
PENALTY = {"type": "length_penalty", "after": ["reward"],
           "params": {"budget": 2, "per_token": 0.5}}


@pytest.fixture
def registry():
    """Forget the entry points loaded so far, and restore the registry afterwards, so a
    test can add a distribution to ``sys.path`` and have it found."""
    saved = (dict(base.STAGE_TYPES), dict(base.BROKEN_PLUGINS), dict(base.PLUGIN_SOURCES))
    base._plugins_loaded = False
    yield
    for live, old in zip((base.STAGE_TYPES, base.BROKEN_PLUGINS, base.PLUGIN_SOURCES), saved,
                         strict=True):
        live.clear()
        live.update(old)
    base._plugins_loaded = False


def _dist_info(root: Path, name: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution (``*.dist-info``) declaring stage entry points."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("[rlhfflow.stages]\n" + "\n".join(lines) + "\n")


def _with(tmp_path, stages: dict, **kwargs) -> Path:
    overrides = {f"stages.{name}": spec for name, spec in stages.items()}
    return small_pipeline(tmp_path, "grpo", overrides=overrides, **kwargs)


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """The example plugin, installed by pip into a folder of its own (not the venv)."""
    target = tmp_path_factory.mktemp("site")
    # from a copy: setuptools leaves build/ and egg-info/ in the source folder
    source = shutil.copytree(PLUGIN, tmp_path_factory.mktemp("src") / PLUGIN.name)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True)
    return target


@pytest.fixture
def installed(plugin_dir, registry, monkeypatch):
    """The example plugin importable here and in worker processes started from here."""
    monkeypatch.syspath_prepend(str(plugin_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(plugin_dir), str(REPO), os.environ.get("PYTHONPATH", "")]))
    yield plugin_dir


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("stage, message", [
    ({"type": "lenght_penalty"}, "stages.extra.type: unknown stage type 'lenght_penalty'; "
                                 "did you mean 'length_penalty'?"),
    ({"type": "nosuch.module:Stage"}, "stages.extra.type: cannot import module "
                                      "'nosuch.module': ModuleNotFoundError"),
    ({"type": "rlhfflow.sdk.stage:NoSuch"}, "stages.extra.type: module "
                                              "'rlhfflow.sdk.stage' has no 'NoSuch'"),
    ({"type": "rlhfflow.sdk.stage:Column"}, "stages.extra.type: "
                                              "'rlhfflow.sdk.stage:Column' is not a subclass"),
    ({**PENALTY, "params": {"budget": -1}}, "stages.extra.params.budget: "),
    ({**PENALTY, "params": {"output": "scores"}},
     "stages.extra: writes column 'scores', which stage 'reward' writes too"),
    ({"type": "tests.bad_plugin:BadColumns", "after": ["reward"]},
     "stages.extra.type: tests.bad_plugin:BadColumns.writes() declares column 'bonus' "
     "badly: dtype must be 'str' or a bool/int/float numpy dtype, not 'object'"),
    ({"type": "tests.bad_plugin:Raises", "after": ["reward"]},
     "stages.extra.type: tests.bad_plugin:Raises.reads() raised RuntimeError: broken"),
    ({"type": "tests.bad_plugin:BadResolve", "after": ["reward"]},
     "stages.extra.type: tests.bad_plugin:BadResolve.resolve_params() must return its "
     "Params, got dict"),
    ({"type": "tests.bad_plugin:TakenMetric", "after": ["reward"]},
     "stages.extra.type: tests.bad_plugin:TakenMetric.iteration_metrics() declares "
     "'kl_mean', which stage 'advantages' declares too"),
    ({"type": "tests.bad_plugin:RuntimeMetric", "after": ["reward"]},
     "stages.extra.type: tests.bad_plugin:RuntimeMetric.iteration_metrics() declares "
     "'reward_mean', a figure the runtime computes itself; give it another name"),
    ({"type": "tests.bad_plugin:RatioOfNothing", "after": ["reward"]},
     "stages.extra.type: tests.bad_plugin:RatioOfNothing.iteration_metrics() raised "
     "ValueError: metric 'bonus_rate': reduce 'ratio' needs 'over'"),
])
def test_a_bad_plugin_stage_is_one_line_naming_file_and_key(installed, tmp_path, stage,
                                                            message):
    path = _with(tmp_path, {"extra": stage})
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    assert str(info.value).startswith(f"{path}: {message}")
    assert "\n" not in str(info.value)


def test_validate_exits_2_and_starts_nothing(tmp_path):
    path = _with(tmp_path, {"extra": {"type": "nosuch.module:Stage"}})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "stages.extra.type" in result.output
    assert not (tmp_path / "out").exists()


def test_a_plugin_that_fails_to_import_breaks_only_its_own_type(registry, tmp_path,
                                                                 monkeypatch):
    site = tmp_path / "site"
    _dist_info(site, "broken-plugin", {"broken": "nosuch_module_xyz:Stage",
                                       "not_a_stage": "rlhfflow.sdk.stage:Column"})
    monkeypatch.syspath_prepend(str(site))
    path = _with(tmp_path, {"extra": {"type": "broken", "after": ["reward"]}})
    with pytest.raises(SpecError, match=r"stages\.extra\.type: plugin stage type 'broken': "
                       r"nosuch_module_xyz:Stage \(broken-plugin\) failed to import: "
                       r"ModuleNotFoundError"):
        load_pipeline(path)
    # the other types still load: the same pipeline without the broken stage validates
    assert load_pipeline(small_pipeline(tmp_path, "grpo")).graph.generators() == ["generate"]
    listing = CliRunner().invoke(main, ["stages"])
    assert listing.exit_code == 0
    assert "broken  BROKEN: nosuch_module_xyz:Stage (broken-plugin) failed" in listing.output
    assert "not_a_stage  BROKEN: rlhfflow.sdk.stage:Column (broken-plugin) is not a " \
           "Stage subclass" in listing.output
    assert "generate  (rlhfflow.stages.generate:GenerateStage, built-in)" in listing.output


def test_a_bad_type_is_exit_2_from_the_command(tmp_path):
    path = _with(tmp_path, {"extra": {"type": "rlhfflow.sdk.stage:NoSuch"}})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        f"Error: {path}: stages.extra.type: module 'rlhfflow.sdk.stage' has no 'NoSuch'\n")


# --------------------------------------------------------------------------- capabilities


def test_a_plugin_generator_is_planned_like_the_builtin_one(tmp_path):
    """``generates`` on the class, not the name ``generate``, makes a stage the prompt
    encoder, the one that runs ahead and the one placed on the rollout group."""
    overrides = {"stages.generate.type": "tests.bad_plugin:MyGenerator",
                 "overlap.max_staleness": 1, "placement.strategy": "disaggregated",
                 "cluster.workers": 2}
    pipeline = load_pipeline(small_pipeline(tmp_path, "grpo", overrides=overrides))
    node = pipeline.graph.nodes["generate"]
    assert node.generates and node.type == "tests.bad_plugin:MyGenerator"
    assert node.response_tokens == 8 and pipeline.graph.generators() == ["generate"]
    plan = resolve_plan(pipeline, 2)
    assert plan.stages["generate"].workers == plan.groups["rollout"]
    assert plan.stages["generate"].lag == 1


def test_stage_test_runs_one_stage_and_its_upstream_in_process(tmp_path):
    path = small_pipeline(tmp_path, "grpo")
    result = CliRunner().invoke(main, ["stage", "test", str(path), "reward",
                                       "--iteration", "1"])
    assert result.exit_code == 0, result.output
    assert "stage reward on iteration 1; ran first: generate" in result.output
    assert re.search(r"scores\s+float32 \[32\]", result.output)
    assert not (tmp_path / "out").exists()
    bad = CliRunner().invoke(main, ["stage", "test", str(path), "rewrad"])
    assert bad.exit_code == 2 and "did you mean 'reward'?" in bad.output


def test_stage_test_takes_overrides_as_run_and_validate_do(tmp_path):
    # one file, two settings (two checkpoints to evaluate): --set and KEY=VALUE after STAGE
    path = small_pipeline(tmp_path, "grpo")
    result = CliRunner().invoke(main, ["stage", "test", str(path), "reward",
                                       "data.batch_size=2", "--set",
                                       "data.samples_per_prompt=3"])
    assert result.exit_code == 0, result.output
    assert re.search(r"scores\s+float32 \[6\]", result.output)
    spaced = CliRunner().invoke(main, ["stage", "test", str(path), "reward", "--set",
                                       "data.batch_size", "2"])
    assert spaced.exit_code == 2
    assert spaced.output.strip().splitlines() == [
        "Error: --set expects KEY=VALUE; got 'data.batch_size' (did you mean --set "
        "data.batch_size=2?)"]
    wrong = CliRunner().invoke(main, ["stage", "test", str(path), "reward",
                                      "data.batch_size=zero"])
    assert wrong.exit_code == 2 and "data.batch_size" in wrong.output, wrong.output


def test_stage_test_shows_a_failing_stage_with_its_traceback(tmp_path):
    path = _with(tmp_path, {"extra": {"type": "tests.bad_plugin:Fails", "after": ["reward"]}})
    result = CliRunner().invoke(main, ["stage", "test", str(path), "extra"])
    assert result.exit_code == 1
    assert "Traceback" in result.output and "bad_plugin.py" in result.output
    assert result.output.rstrip().splitlines()[-1] == (
        "Error: stage 'extra' failed: the plugin divided by zero")


def test_the_builtins_are_declared_as_entry_points_too():
    """setup.cfg declares every built-in in the ``rlhfflow.stages`` group, each pointing at
    the class that registered itself on import (the installed metadata may be older)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    declared = dict(line.split(" = ") for line in
                    config["options.entry_points"]["rlhfflow.stages"].strip().splitlines())
    builtins = {n for n, src in base.PLUGIN_SOURCES.items() if src == "rlhfflow"}
    assert set(declared) == builtins
    for name, path in declared.items():
        assert base.resolve_stage_type(path) is base.resolve_stage_type(name)


# --------------------------------------------------------------------------- reference


def test_every_builtin_param_has_a_description():
    docs = describe_stage_types(AlgorithmSpec(), builtin_only=True)
    missing = [f"{d.name}.{p.name}" for d in docs for p in d.params if not p.description]
    assert missing == []


# The generated page docs/reference/stages.md is checked in tests/test_docs.py.


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_the_example_plugin_runs_on_a_dask_cluster_by_name_and_by_path(plugin_dir, registry,
                                                                      tmp_path, monkeypatch):
    """Installed here (entry points are read where the pipeline is validated), shipped to
    the workers with Dask's ``upload_file``: the workers import the stage by path only."""
    stages = {
        "reward": {"type": "score", "after": ["generate"],
                   "params": {"function": "rlhfflow_example_plugin.rewards:says_yes"}},
        "penalty": PENALTY,
        "long_penalty": {"type": "rlhfflow_example_plugin.stages:LengthPenalty",
                         "after": ["reward"], "params": {"budget": 0, "per_token": 1.0,
                                                         "output": "long_scores"}},
    }
    path = _with(tmp_path, stages, iterations=1, batch_size=4, max_new_tokens=6)
    archive = shutil.make_archive(str(tmp_path / "plugin"), "zip", plugin_dir,
                                  "rlhfflow_example_plugin")
    # the workers start before the plugin is on this process's path, so they lack it
    with local_cluster(2, dashboard_address="127.0.0.1:0", torch_threads=1) as cluster:
        monkeypatch.syspath_prepend(str(plugin_dir))
        listing = CliRunner().invoke(main, ["stages"])
        assert "length_penalty  (rlhfflow_example_plugin.stages:LengthPenalty, from " \
               "rlhfflow-example-plugin)" in listing.output
        assert "penalty per token over the budget" in listing.output
        pipeline = load_pipeline(path, {"cluster.address": cluster.scheduler_address})
        assert pipeline.graph.nodes["penalty"].impl == \
            "rlhfflow_example_plugin.stages:LengthPenalty"
        with Client(cluster) as client:
            found = client.run(importlib.util.find_spec, "rlhfflow_example_plugin")
            assert set(found.values()) == {None}
            client.upload_file(archive)
        run_pipeline(pipeline, progress=False)
    data = ExperienceBuffer(tmp_path / "out" / "buffer.zarr", create=False).read(0)
    lengths = torch.as_tensor(data["response_mask"]).sum(-1).float()
    scores = torch.as_tensor(data["scores"]).float()
    expected = scores - 0.5 * (lengths - 2).clamp(min=0)
    assert torch.allclose(torch.as_tensor(data["penalized_scores"]), expected)
    assert torch.allclose(torch.as_tensor(data["long_scores"]), scores - lengths)


@pytest.mark.parametrize("where", ["inline", "dask"])
def test_a_plugin_stages_declared_metrics_reach_the_record_the_trackers_and_the_page(
        tmp_path, where):
    """A plugin stage declares figures over the columns it writes
    (``Stage.iteration_metrics``) and the runtime names none of them: each iteration's
    record holds them over all its rows (two micro-batches' sums added), TensorBoard
    gets them, and on a Dask cluster the dashboard page has a plot's data for each."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhfflow.monitor.dashboard import latest_run, page_columns, page_events
    from tests.metrics_plugin import vowel_share

    path = small_pipeline(tmp_path, "grpo", iterations=2, batch_size=4, max_new_tokens=6,
                          overrides={"stages.vowels": {"type": "tests.metrics_plugin:VowelShare",
                                                       "after": ["generate"]},
                                     "data.micro_batches": 2, "logging.tensorboard": "tb"})
    if where == "inline":
        run_pipeline(load_pipeline(path), progress=False, inline=True)
        messages = None
    else:
        with local_cluster(1, dashboard_address="127.0.0.1:0", torch_threads=1) as cluster:
            run_pipeline(load_pipeline(path, {"cluster.address": cluster.scheduler_address}),
                         progress=False)
            messages = latest_run(page_events(cluster.scheduler))
    records = MetricsLog(tmp_path / "out" / "metrics.jsonl").read()
    buffer = ExperienceBuffer(tmp_path / "out" / "buffer.zarr", create=False)
    for record in records:
        texts = buffer.read_text(record["iteration"], "response_text")
        shares = [s for s in map(vowel_share, texts) if s is not None]
        assert len(texts) == 16 and shares
        assert record["vowel_share_mean"] == pytest.approx(sum(shares) / len(shares))
        assert record["vowels_total"] == sum(c in "aeiou" for t in texts for c in t.lower())
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag in ("vowel_share_mean", "vowels_total"):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == \
            [(r["iteration"], pytest.approx(r[tag], rel=1e-6)) for r in records]
    if messages is not None:
        columns = page_columns(messages)
        for tag in ("vowel_share_mean", "vowels_total"):
            assert columns[f"metric:{tag}"] == [pytest.approx(r[tag]) for r in records]
