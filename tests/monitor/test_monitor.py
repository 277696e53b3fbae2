"""Watching a run: the HTML report, the TensorBoard and MLflow sinks, the dashboard page
and the names of scatter tasks. Real runs (inline, tiny models), a real scheduler with
its dashboard, real event files and a real file-store MLflow."""

from __future__ import annotations

import html
import re
import urllib.request

import pytest
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.monitor.dashboard import latest_run, page_columns
from rlhfflow.monitor.report import build_report
from rlhfflow.monitor.sinks import flat_metrics
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage import ExperienceBuffer, MetricsLog
from tests.conftest import small_pipeline


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 3-iteration GRPO run, inline: its output directory."""
    tmp = tmp_path_factory.mktemp("run")
    run_pipeline(load_pipeline(small_pipeline(tmp, "grpo", iterations=3)), progress=False,
                 inline=True)
    return tmp / "out"


# --------------------------------------------------------------------------- report


def test_report_embeds_every_plot_and_escapes_the_responses(finished_run):
    page = build_report(finished_run, iterations=[1, 2], samples=2)
    images = re.findall(r"<img src='data:image/png;base64,([A-Za-z0-9+/=]+)' alt='([^']*)'",
                        page)
    alts = [alt for _, alt in images]
    assert alts == ["curves", "stage time", "busy fractions", "timeline of iteration 1",
                    "timeline of iteration 2"]
    assert all(len(data) > 2000 for data, _ in images)  # a drawn PNG, not an empty one
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from elsewhere
    buffer = ExperienceBuffer(finished_run / "buffer.zarr", create=False)
    for k in (0, 1, 2):
        for response in buffer.read_text(k, "response_text")[:2]:
            assert f"<pre>{html.escape(response)}</pre>" in page


def test_report_command_writes_the_file_and_names_a_bad_run_dir(finished_run, tmp_path):
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(finished_run), "--out", str(out),
                                       "--iterations", "0-1"])
    assert result.exit_code == 0, result.output
    assert "timeline of iteration 0" in out.read_text()
    for args, message in [
        ([str(tmp_path / "nope")], "no such directory"),
        ([str(tmp_path)], "no metrics.jsonl"),
        ([str(finished_run), "--iterations", "7"], "iteration 7 is not in metrics.jsonl"),
        ([str(finished_run), "--iterations", "a-b"], "--iterations: expected"),
    ]:
        result = CliRunner().invoke(main, ["report", *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1


def _made_run(tmp_path, rewards, kl=None, kl_coef=0.0, prompts=None, fields=None):
    """A run directory made by hand: metrics.jsonl (a reward mean and std per iteration,
    KL only if given), run.json with kl_coef and a buffer of iteration 0 whose scores
    are 0 and 1."""
    import json

    import numpy as np

    from rlhfflow.storage.buffer import ColumnSpec

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for k, mean in enumerate(rewards):
        log.append({"iteration": k, "reward_mean": mean, "reward_std": 0.5,
                    "kl_mean": None if kl is None else kl[k], "iteration_s": 1.0,
                    "busy_frac": [0.5], "response_length_mean": 10.0 + k})
    (tmp_path / "run.json").write_text(json.dumps(
        {"identity": {"name": "made", "algorithm": {"kl_coef": kl_coef}}}))
    prompts = prompts or ["a:", "b:"]
    buffer = ExperienceBuffer(tmp_path / "buffer.zarr")
    texts = {"prompt_text": prompts, "response_text": ["yes", "no"]}
    if fields is not None:
        texts["prompt_fields"] = fields
    buffer.begin_iteration(0, 2, {"scores": ColumnSpec("float32")}, 2, texts=texts)
    ExperienceBuffer.write_rows(buffer.path, 0, 0, {"scores": np.array([1.0, 0.0])})
    buffer.commit(0)
    return tmp_path


def test_report_headline_is_a_trend_of_the_last_iterations_not_one_batch(tmp_path):
    from rlhfflow.monitor.report import trend

    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.0]  # the last batch dips
    page = build_report(_made_run(tmp_path, rewards), samples=0)
    metrics = MetricsLog(tmp_path / "metrics.jsonl").read()
    assert trend(metrics, "reward_mean") == pytest.approx(0.6)  # 0.6, 0.7, 0.8, 0.9 and 0.0
    assert trend(metrics, "reward_mean", first=True) == pytest.approx(0.3)
    assert "<th>reward mean, last 5 iterations</th><td>0.6</td>" in page
    assert "<th>reward mean, first 5 iterations</th><td>0.3</td>" in page


def test_report_says_why_the_kl_panel_is_empty(tmp_path):
    from rlhfflow.monitor.report import kl_absent

    page = build_report(_made_run(tmp_path / "a", [0.5, 0.6], kl_coef=0.0), samples=0)
    assert "<p class='note'>KL: no KL logged: kl_coef is 0 (no KL penalty).</p>" in page
    page = build_report(_made_run(tmp_path / "b", [0.5, 0.6], kl=[0.01, 0.02],
                                  kl_coef=0.05), samples=0)
    assert "class='note'>KL" not in page
    assert "the pipeline computes none" in kl_absent(None)


def test_report_reward_band_stays_within_the_rewards_seen(tmp_path):
    from rlhfflow.monitor.report import reward_band, reward_range

    run = _made_run(tmp_path, [0.1, 0.9])
    assert reward_range(run) == (0.0, 1.0)
    low, high = reward_band([0.1, 0.9], [0.5, 0.5], reward_range(run))
    assert low == pytest.approx([0.0, 0.4]) and high == pytest.approx([0.6, 1.0])
    low, high = reward_band([0.1], [0.5], None)  # no buffer: not clipped
    assert low == pytest.approx([-0.4]) and high == pytest.approx([0.6])


def test_report_plots_each_reward_function_and_the_multi_turn_metrics_when_logged(tmp_path):
    import json

    plain = build_report(_made_run(tmp_path / "a", [0.5, 0.6]), samples=0)
    run = _made_run(tmp_path / "b", [0.5, 0.6])
    log = MetricsLog(run / "metrics.jsonl")
    records = log.read()
    (run / "metrics.jsonl").write_text("".join(json.dumps({
        **r, "reward_mean_format": 0.25 * k, "reward_mean_correct": 0.5, "turns_mean": 2.0,
        "env_reward_mean": 0.5, "info_calls_mean": 1.5, "info_errors_mean": 0.5 - 0.25 * k})
        + "\n" for k, r in enumerate(records)))
    page = build_report(run, samples=0)
    alts = re.findall(r"<img src='data:image/png;base64,[A-Za-z0-9+/=]+' alt='([^']*)'", page)
    assert "<h2>Reward functions</h2>" in page and "<h2>Multi-turn episodes</h2>" in page
    assert alts[:3] == ["curves", "reward functions", "multi-turn episodes"]
    assert "Reward functions" not in plain and "Multi-turn" not in plain


def test_report_marks_each_recovery_from_a_lost_worker_with_its_cause(tmp_path):
    from rlhfflow.monitor.workerlogs import record_recovery

    run = _made_run(tmp_path, [0.1, 0.2, 0.3, 0.4])
    assert "recovery 1" not in build_report(run, samples=0)
    record_recovery(run, 2, 1, "worker tcp://x left the cluster while it held resident "
                    "models (killed by SIGKILL; <its memory>)", 1795862026.5)
    page = build_report(run, samples=0)
    assert ("<li>recovery 1, 2026-11-28 10:33:46 UTC, with iterations up to 2 logged: "
            "worker tcp://x left the cluster while it held resident models (killed by "
            "SIGKILL; &lt;its memory&gt;); resumed after iteration 1 (its checkpoint), "
            "redoing what followed</li>") in page


def test_report_sample_prompts_show_the_users_last_turn(tmp_path):
    import json

    from rlhfflow.monitor.report import shown_prompt

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
    rendered = ("<bos><|im_start|>system: be brief<|im_end|><|im_start|>user: hi<|im_end|>"
                "<|im_start|>assistant: hello<|im_end|><|im_start|>user: 2+2?<|im_end|>"
                "<|im_start|>assistant: ")
    run = _made_run(tmp_path, [0.5], prompts=[rendered, "plain <&> prompt:"],
                    fields=[json.dumps({"messages": chat, "answer": "4"}), "{}"])
    page = build_report(run, samples=2)
    assert "<pre>2+2?</pre>" in page and "im_start" not in page
    assert "<pre>plain &lt;&amp;&gt; prompt:</pre>" in page
    # without the messages stored, cut from the rendered text at the last user marker
    assert shown_prompt(rendered) == "2+2?"
    assert shown_prompt("<|start_header_id|>user<|end_header_id|>\n\nwhy?<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n") == "why?"
    assert shown_prompt("what is 2+2?") == "what is 2+2?"


# --------------------------------------------------------------------------- sinks


def test_every_figure_of_a_record_is_the_runtimes_or_declared_by_a_stage(finished_run):
    """The names no stage may declare (``RUN_METRICS``) are those the runtime writes: the
    rest of a record is what the pipeline's stages declare (``Stage.iteration_metrics``)."""
    from rlhfflow.sdk import RUN_METRICS

    pipeline = load_pipeline(finished_run.parent / "grpo-small.yaml")
    declared = {m.name for node in pipeline.graph.nodes.values() for m in node.metrics}
    assert {"gen_acceptance", "gen_rows_migrated", "kl_mean"} <= declared
    for record in MetricsLog(finished_run / "metrics.jsonl").read():
        assert set(record) - declared <= RUN_METRICS
        assert not declared & RUN_METRICS


def test_metric_names_are_the_ones_trl_users_know():
    record = {"iteration": 3, "reward_mean": 0.5, "kl_mean": 0.01, "reward_std": None,
              "response_length_mean": 12.0, "stage_s": {"generate": 1.5},
              "busy_frac": [0.5, 0.25], "reward_mean_vowels": 0.2, "iteration_s": 2.0,
              "lr": float("nan"), "memory_peak_mib": [2413, None]}
    assert flat_metrics(record) == {
        "reward": 0.5, "kl": 0.01, "completions/mean_length": 12.0, "timing/step": 2.0,
        "timing/generate": 1.5, "perf/busy_w0": 0.5, "perf/busy_w1": 0.25,
        "perf/memory_peak_mib_w0": 2413.0, "rewards/vowels/mean": 0.2}


def test_every_other_number_of_a_record_reaches_the_sinks_under_its_own_key():
    # a multi-turn run's means (the tool-error rate is the curve tool RL watches), the
    # stages' own statistics nested in the record, an evaluation's
    record = {"iteration": 3, "reward_mean": 0.5, "turns_mean": 2.5,
              "info_calls_mean": 1.25, "info_errors_mean": 0.5, "samples": 16,
              "train": {"train_actor": {"grad_norm": 1.5, "version": 2}},
              "stage_flops": {"generate": 10}, "eval/reward_mean": 0.75,
              "gen_acceptance": None, "note": "text", "finished": True}
    assert flat_metrics(record) == {
        "reward": 0.5, "turns_mean": 2.5, "info_calls_mean": 1.25, "info_errors_mean": 0.5,
        "samples": 16.0, "train/train_actor/grad_norm": 1.5, "train/train_actor/version": 2.0,
        "stage_flops/generate": 10.0, "eval/reward_mean": 0.75}


def test_tensorboard_gets_every_iteration_under_trl_names(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = small_pipeline(tmp_path, "grpo", iterations=2,
                          overrides={"logging.tensorboard": "tb"})
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    records = MetricsLog(tmp_path / "out" / "metrics.jsonl").read()
    for tag, key in [("reward", "reward_mean"), ("kl", "kl_mean"),
                     ("completions/mean_length", "response_length_mean")]:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert logged == [(r["iteration"], pytest.approx(r[key], rel=1e-6)) for r in records]
    assert "timing/generate" in events.Tags()["scalars"]


def test_mlflow_run_holds_the_metrics_and_is_finished(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    path = small_pipeline(tmp_path, "grpo", iterations=2, overrides={
        "logging.mlflow": {"tracking_uri": uri, "experiment": "tests", "run_name": "grpo"}})
    run_pipeline(load_pipeline(path), progress=False, inline=True)
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.run_name == "grpo" and run.info.status == "FINISHED"
    records = MetricsLog(tmp_path / "out" / "metrics.jsonl").read()
    history = client.get_metric_history(run.info.run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [
        (r["iteration"], pytest.approx(r["reward_mean"])) for r in records]


def test_a_logging_target_that_fails_to_start_is_one_warning_and_the_run_goes_on(
        tmp_path, capsys):
    pytest.importorskip("mlflow")
    path = small_pipeline(tmp_path, "grpo", iterations=1, overrides={
        "logging.mlflow": {"tracking_uri": "nosuchstore://nowhere"}})
    result = run_pipeline(load_pipeline(path), progress=True, inline=True)
    assert [r["iteration"] for r in result.metrics] == [0]
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("rlhfflow: warning: logging.mlflow: cannot log there")]
    assert len(warnings) == 1


def test_logging_section_is_checked_at_the_edge(tmp_path):
    path = small_pipeline(tmp_path, "grpo", overrides={"logging.neptune": True})
    with pytest.raises(SpecError, match=r"logging\.neptune: unknown key"):
        load_pipeline(path)
    path = small_pipeline(tmp_path, "grpo", overrides={"logging.wandb": True})
    with pytest.raises(SpecError, match=r"logging\.wandb: expected a mapping, got True"):
        load_pipeline(path)
    path = small_pipeline(tmp_path, "grpo", overrides={"logging.mlflow.experiment": 3})
    with pytest.raises(SpecError, match=r"logging\.mlflow\.experiment: expected a string"):
        load_pipeline(path)


def test_a_missing_logging_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    path = small_pipeline(tmp_path, "grpo", overrides={"logging.tensorboard": True})
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert ("logging.tensorboard: needs the 'tensorboard' package, which is not installed: "
            "pip install 'rlhfflow[tensorboard]'") in result.output


# --------------------------------------------------------------------------- dashboard


def test_a_declared_figure_gets_a_column_once_an_iteration_gives_it_a_value():
    events = [(0.0, {"run": "a", "iteration": 0, "metrics": {"gen_acceptance": None,
                                                             "gen_tokens_per_s": 10.0}}),
              (1.0, {"run": "a", "iteration": 1, "metrics": {"gen_acceptance": None,
                                                             "gen_tokens_per_s": 12.0,
                                                             "gen_k_mean": float("nan")}})]
    columns = page_columns(latest_run(events))
    assert [k for k in columns if k.startswith("metric:")] == ["metric:gen_tokens_per_s"]
    events.append((2.0, {"run": "a", "iteration": 2, "metrics": {"gen_acceptance": 0.5}}))
    columns = page_columns(latest_run(events))
    assert columns["metric:gen_acceptance"][2] == 0.5


def test_page_shows_the_latest_run_with_a_column_per_stage_and_worker():
    events = [(0.0, {"run": "a", "iteration": 0, "reward_mean": 9.0}),
              (1.0, {"run": "b", "iteration": 0, "reward_mean": 0.1,
                     "stage_s": {"generate": 1.0}, "busy_frac": [0.5]}),
              (2.0, {"run": "b", "iteration": 1, "reward_mean": None,
                     "stage_s": {"train": 2.0}, "busy_frac": [0.25, 0.75]})]
    columns = page_columns(latest_run(events))
    assert columns["iteration"] == [0, 1]
    assert columns["reward_mean"][0] == 0.1 and columns["reward_mean"][1] != 0.1  # NaN
    assert columns["stage:train"][1] == 2.0 and columns["busy:1"][1] == 0.75
    assert sorted(k for k in columns if ":" in k) == ["busy:0", "busy:1", "stage:generate",
                                                      "stage:train"]


def test_scheduler_with_the_preload_serves_the_page_and_the_run_names_it():
    import torch
    from distributed import Client, LocalCluster

    from rlhfflow.monitor import page_line
    from rlhfflow.monitor.dashboard import MetricsPage
    from rlhfflow.runtime.backend import INLINE_DATA_BYTES, DaskBackend

    with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0",
                      scheduler_kwargs={"preload": ["rlhfflow.monitor.dashboard"]}) as cluster, \
            Client(cluster) as client:
        link = client.dashboard_link
        assert page_line(client, link) == \
            f"rlhfflow: rlhfflow page: {link.rsplit('/', 1)[0]}/rlhfflow"
        # the in-process cluster's link names the host's address; it listens on 127.0.0.1
        port = cluster.scheduler.http_server.port
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/rlhfflow").read().decode()
        assert 'href="rlhfflow"' in page and "Bokeh" in page  # a Bokeh app, in the nav bar
        client.log_event("rlhfflow", {"run": "x", "iteration": 0, "reward_mean": 0.5,
                                      "stage_s": {"generate": 0.1}, "busy_frac": [1.0]})
        drawn = MetricsPage(cluster.scheduler)
        drawn.update()
        assert drawn.source.data["reward_mean"] == [0.5]
        assert "busy:0" in drawn.drawn and "stage:generate" in drawn.drawn
        # a figure a stage declares (Stage.iteration_metrics) gets a plot of its own
        client.log_event("rlhfflow", {"run": "x", "iteration": 1, "reward_mean": 0.6,
                                      "metrics": {"env_reward_mean": 0.25}})
        drawn.update()
        assert drawn.source.data["metric:env_reward_mean"][1] == 0.25
        assert "env_reward_mean" in drawn.figures and "metric:env_reward_mean" in drawn.drawn
        assert list(drawn.root.children[1].select({"name": "env_reward_mean"})) == \
            [drawn.figures["env_reward_mean"]]  # in the page's grid
        # a large prompt batch (a dict of columns) is scattered under a name the
        # dashboard shows; a small one rides in the messages of the tasks that use it
        backend = DaskBackend(client)
        large = {"prompt_ids": torch.arange(INLINE_DATA_BYTES // 8 + 1)}
        future = backend.place(large, key="scatter-prompts-0-0123abcd")
        assert future.key == "scatter-prompts-0-0123abcd"
        assert torch.equal(future.result()["prompt_ids"], large["prompt_ids"])
        assert torch.equal(backend.place(large).result()["prompt_ids"], large["prompt_ids"])
        small = {"prompt_ids": [1, 2], "prompt_mask": [1, 1]}
        assert backend.place(small) is small


def test_scheduler_without_the_preload_gets_a_hint_not_a_link():
    from distributed import Client, LocalCluster

    from rlhfflow.monitor import page_line

    with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") \
            as cluster, Client(cluster) as client:
        line = page_line(client, client.dashboard_link)
    assert "--preload rlhfflow.monitor.dashboard" in line

