"""Start-up: what the coordinator of a run imports before the first task, and what it
leaves to the workers (docs/performance/index.md, "Other measurements").

Each check runs in a fresh interpreter, since this test process has imported everything
already. They assert which modules get imported, never how long anything took.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, small_pipeline

# imported by transformers' model classes (torch._dynamo, DTensor, accelerate), never by
# a process that only reads the file, tokenizes prompts and plans
MODEL_CLASSES = ["transformers.modeling_utils", "torch._dynamo", "accelerate"]


def _modules_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (from the repository) and return what it
    printed last: a JSON object."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_fork_server_starts_before_anything_heavy_is_imported():
    """``rlhfflow run`` starts the workers' fork server first: importing what starts it
    must not import torch, Dask or the stages (they would delay the workers' imports)."""
    got = _modules_after(
        "import json, sys\n"
        "import rlhfflow.cli.main\n"
        "import rlhfflow.launch.forkserver\n"
        "print(json.dumps({m: m in sys.modules for m in "
        "['torch', 'dask', 'distributed', 'rlhfflow.stages', 'rlhfflow.config.loader']}))")
    assert not any(got.values()), got


def test_the_coordinator_prepares_a_run_without_transformers_model_classes(tmp_path):
    """Reading and checking the file, planning (auto placement) and preparing prompts,
    buffer and model configs import no model class: tiny models are built by a worker."""
    file = small_pipeline(tmp_path, "ppo")
    got = _modules_after(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from rlhfflow.config.loader import load_pipeline\n"
        "from rlhfflow.plan.auto.planner import choose_plan, load_profile\n"
        "import rlhfflow.runtime.executor\n"
        "from rlhfflow.runtime.prepared import prepare_run\n"
        "from rlhfflow.runtime.runstate import prepare_output\n"
        f"p = load_pipeline({str(file)!r})\n"
        "p = choose_plan(p, load_profile(p)).pipeline\n"
        "out, start = prepare_output(p, True, 'auto', False)\n"
        "e = prepare_run(p, out, start, False)\n"
        "print(json.dumps({'modules': [m for m in " + repr(MODEL_CLASSES) + " if m in "
        "sys.modules], 'tiny': sorted(e.tiny), 'built': (out / 'models').exists()}))")
    assert got["modules"] == []
    # the models the run builds on a worker, not yet on disk
    assert got["tiny"] == ["actor"] and not got["built"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed: nothing to keep from importing")
def test_saving_a_model_does_not_import_deepspeed(tmp_path):
    """transformers' save_pretrained asks accelerate to unwrap the model, which imports
    DeepSpeed (seconds) only for an isinstance check: a model cannot be a DeepSpeed engine
    unless DeepSpeed was imported, and saving must not import it."""
    got = _modules_after(
        "import json, sys\n"
        "from rlhfflow.engine.models import load_model, save_tiny_model\n"
        f"save_tiny_model({str(tmp_path / 'm')!r}, 'lm', seed=0, n_layer=1, hidden=16, "
        "n_head=2)\n"
        f"model, _ = load_model({str(tmp_path / 'm')!r})\n"
        "print(json.dumps({'deepspeed': 'deepspeed' in sys.modules, "
        "'params': sum(p.numel() for p in model.parameters())}))")
    assert got == {"deepspeed": False, "params": got["params"]} and got["params"] > 0


def test_a_task_thread_that_ran_torch_before_the_plugin_gets_the_plugins_threads(cluster):
    """torch sizes a thread's OpenMP pool at its first parallel op; the plugin sets the
    size from the worker's event-loop thread. A task thread that ran torch before then
    must still compute with the plugin's threads (it kept 2 per worker on 2 cores, and
    iterations ran ~10x slower)."""
    from distributed import Client

    from rlhfflow.runtime.worker.host import PLUGIN_NAME, RLHFWorkerPlugin, RunDef

    def threads_now() -> int:
        import torch

        torch.ones(64, 64) @ torch.ones(64, 64)  # initialise this thread's pool
        return torch.get_num_threads()

    with Client(cluster) as client:
        [address] = sorted(client.scheduler_info()["workers"])[:1]
        before = client.submit(threads_now, workers=[address], pure=False).result()
        wanted = before + 1
        run = RunDef(stages={}, models={}, algorithm=None, seed=0)
        client.register_plugin(RLHFWorkerPlugin(run, wanted), name=PLUGIN_NAME)
        try:
            during = client.submit(stage_task_threads, workers=[address], pure=False).result()
        finally:
            client.register_plugin(RLHFWorkerPlugin(run, before), name=PLUGIN_NAME)
    assert during == wanted


def stage_task_threads() -> int:
    """What a task sees once it asked for its host, as every rlhfflow task does first."""
    import torch

    from rlhfflow.runtime.worker.host import current_host

    current_host()
    return torch.get_num_threads()


def test_a_dashboard_port_in_use_moves_with_one_plain_line(tmp_path):
    """Two runs on one machine: the second's dashboard goes to a free port, said in the
    line that prints its link, not in a raw Dask warning."""
    import socket

    path = small_pipeline(tmp_path, "grpo", iterations=1, batch_size=4, max_new_tokens=4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-m", "rlhfflow.cli.main", "run", str(path), "--set",
             f"cluster.dashboard_address=127.0.0.1:{port}", "--set", "cluster.workers=1"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    output = proc.stdout + proc.stderr
    assert "already in use" not in output and "Warning" not in output
    [line] = [x for x in output.splitlines() if "Dask dashboard:" in x]
    assert line.endswith(f"(port {port} is in use, another run?)")
    assert f":{port}/" not in line


def test_waiting_for_the_fork_server_has_its_own_limit_and_says_what_it_waited_for():
    from rlhfflow.launch.forkserver import start_fork_server, wait_fork_server

    if not start_fork_server():
        pytest.skip("no fork server on this platform")
    wait_fork_server(60)  # the suite's server: ready, so this returns
    with pytest.raises(TimeoutError, match="did not finish importing torch"):
        wait_fork_server(0)


def test_workers_that_do_not_start_in_time_are_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from rlhfflow.cli.main import main
    from rlhfflow.runtime import cluster

    def slow(timeout=0):
        raise TimeoutError("the worker processes' fork server did not finish importing")

    monkeypatch.setattr(cluster, "wait_fork_server", slow)
    path = small_pipeline(tmp_path, "grpo", iterations=1)
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: the embedded cluster did not start: the worker processes' fork server did "
        "not finish importing")
    assert "Traceback" not in result.output
