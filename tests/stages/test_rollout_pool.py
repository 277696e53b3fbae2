"""Environment steps on a CPU pool (``rollout``'s ``env_placement: pool``): each step runs in
another process with the environment shipped there and back, the rows' results are those
of steps run in the task, and the planner does not charge the steps to the model worker."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import yaml

from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.stages import StageContext, create_stage
from tests.conftest import chat_batch, chat_store
from tests.stages.test_rollout import EXAMPLE, TEXTS

#: A guessing game that notes the process of each hook in the file ``log``; a module of
#: its own file, as a pipeline names it (imported under a name only the parent knows).
PID_ENV = '''
import os
import re


class PidGuess:
    def __init__(self, log, penalty=0.1):
        self.log, self.penalty, self.secret, self.steps = log, penalty, 0, 0

    def note(self, hook):
        with open(self.log, "a") as f:
            f.write(f"{hook} {os.getpid()}\\n")

    def reset(self, record):
        self.note("reset")
        self.secret = int(record["secret"])
        return []

    def step(self, text):
        self.note("step")
        # state kept across steps (the environment comes back from each): the penalty
        # grows with the steps taken
        self.steps += 1
        found = re.search(r"\\d+", text)
        if found is None:
            return "say a number", -self.penalty * self.steps, False, {}
        guess = int(found.group())
        if guess == self.secret:
            return "correct", 1.0, True, {}
        return ("higher" if guess < self.secret else "lower"), -self.penalty * self.steps, \\
            False, {}


class Locked(PidGuess):
    def __init__(self, log, penalty=0.1):
        import threading

        super().__init__(log, penalty)
        self.lock = threading.Lock()
'''


def _pids(log: Path) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {"reset": set(), "step": set()}
    for line in log.read_text().splitlines():
        hook, pid = line.split()
        out[hook].add(int(pid))
    return out


def _run(chat_lm_dir, tmp_path, executor, env="PidGuess", name="run"):
    (tmp_path / "pidenv.py").write_text(PID_ENV)
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batch = chat_batch(tok, TEXTS, samples=2, secrets=[3, 5, 7])
    log = tmp_path / f"{name}.log"
    stage = create_stage("rollout", params={
        "env": f"pidenv.py:{env}", "env_kwargs": {"log": str(log)}, "max_turns": 3,
        "max_new_tokens": 6, "max_tokens": 48, "env_placement": "pool"}, model="actor")
    ctx = StageContext(iteration=0, seed=0, models=store,
                       settings={"base_dir": str(tmp_path)}, env_executor=executor)
    return stage.run(batch, ctx), log


def test_pool_steps_run_in_another_process_and_give_the_rows_of_steps_in_the_task(
        chat_lm_dir, tmp_path):
    # spawn: the child knows nothing of the parent's modules, as a Dask worker would not
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        shipped, shipped_log = _run(chat_lm_dir, tmp_path, pool, name="pool")
    inline, inline_log = _run(chat_lm_dir, tmp_path, None, name="task")
    pids = _pids(shipped_log)
    assert pids["reset"] == {os.getpid()} and pids["step"] and os.getpid() not in pids["step"]
    assert _pids(inline_log)["step"] == {os.getpid()}
    # the environment's state came back with each step: its penalties grew as in the task
    assert shipped["turns"].max() >= 2
    # which rows share a forward differs (the steps' timing): the same tokens, log-probs
    # to float rounding
    assert torch.equal(shipped["response_ids"], inline["response_ids"])
    assert torch.equal(shipped["response_mask"], inline["response_mask"])
    torch.testing.assert_close(shipped["sample_logprobs"], inline["sample_logprobs"],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(shipped["env_reward"], inline["env_reward"])


def test_an_environment_that_does_not_pickle_is_one_line_naming_params_env(chat_lm_dir,
                                                                           tmp_path):
    from rlhfflow.errors import RlhfflowError

    with concurrent.futures.ThreadPoolExecutor(1) as pool, \
            pytest.raises(RlhfflowError) as info:
        _run(chat_lm_dir, tmp_path, pool, env="Locked")
    text = str(info.value)
    assert "\n" not in text and "params.env" in text and "cannot be pickled" in text, text


def test_without_a_pool_the_steps_run_in_the_task(chat_lm_dir, tmp_path):
    out, log = _run(chat_lm_dir, tmp_path, None)
    assert _pids(log)["step"] == {os.getpid()} and out["turns"].min() >= 1


def _guess(tmp_path, cluster, **params) -> Path:
    data = yaml.safe_load((EXAMPLE / "guess-tiny.yaml").read_text())
    data["data"]["prompts"] = str(EXAMPLE / "prompts.jsonl")
    data["cluster"] = cluster
    data["output"] = str(tmp_path / "out")
    data["stages"]["rollout"]["params"].update(params)
    path = tmp_path / "guess.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "envs.py").write_text((EXAMPLE / "envs.py").read_text())
    return path


def test_pool_placement_without_a_pool_is_one_line_naming_the_key(tmp_path):
    path = _guess(tmp_path, {"workers": 1}, env_placement="pool")
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text and info.value.exit_code == 2
    assert "stages.rollout.params.env_placement" in text and "cluster.env_workers" in text
    # a pool, or a cluster at an address (whose workers say whether they are one): valid
    assert load_pipeline(path, {"cluster.env_workers": 1}).graph.nodes["rollout"].env_on_pool
    assert load_pipeline(path, {"cluster.address": "tcp://127.0.0.1:1"})


def test_the_planner_does_not_charge_pool_steps_to_the_model_worker(tmp_path):
    from rlhfflow.config.shapes import model_shapes
    from rlhfflow.plan.auto.costmodel import CostModel, Observation, Profile, machine_info

    path = _guess(tmp_path, {"workers": 1, "env_workers": 1})
    task = load_pipeline(path)
    pool = load_pipeline(path, {"stages.rollout.params.env_placement": "pool"})
    shapes = {m: vars(s) for m, s in model_shapes(task).items()}
    # rollout tasks measured with the steps in the task: 0.5 s of each was the environment
    observations = [Observation("rollout", rows, 1, 1, 0.1 + 0.01 * rows + 0.5, env=0.5)
                    for rows in (8, 16, 8, 16)]
    profile = Profile("multiturn-guess", machine_info(), shapes, observations=observations)
    profile.save(tmp_path / "profile.json")
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.observations[0].env == 0.5
    in_task = CostModel(task, profile).stage_seconds("rollout", 16, 1)
    on_pool = CostModel(pool, profile).stage_seconds("rollout", 16, 1)
    assert in_task == pytest.approx(0.76) and on_pool == pytest.approx(0.26)
    # the simulator's iteration follows: 0.5 s less per rollout task (micro-batch)
    from rlhfflow.plan.auto.planner import resolve_plan
    from rlhfflow.plan.auto.simulate import simulate

    sims = [simulate(p, resolve_plan(p, 1), CostModel(p, profile), threads=1, iterations=3)
            for p in (task, pool)]
    tasks = resolve_plan(task, 1).stages["rollout"].micro_batches or 1
    assert sims[0].iteration_s - sims[1].iteration_s == pytest.approx(0.5 * tasks, abs=0.05)


def test_a_run_s_profile_holds_the_environment_s_time_inside_each_task(tmp_path):
    from rlhfflow.runtime.profiler import observations_from_run
    from rlhfflow.runtime.telemetry import TASKS_FILE

    tasks = [[0, "rollout", 1, 10.0, 12.0, 16], [0, "rollout/env", 1, 10.5, 11.0, 0],
             [0, "rollout/env", 1, 11.5, 12.5, 0], [0, "rollout/env-pool", 1, 10.0, 12.0, 0],
             [0, "rollout", 2, 20.0, 21.0, 16]]
    (tmp_path / TASKS_FILE).write_text(json.dumps({"layout": {"threads": 1, "workers": 1},
                                                   "tasks": tasks}) + "\n")
    got = {o.seconds: o.env for o in observations_from_run(tmp_path, skip_first=False)}
    assert got == {2.0: 1.0, 1.0: 0.0}


@pytest.mark.slow
def test_a_run_steps_its_environments_on_the_pool_and_agrees_with_steps_in_the_task(
        tmp_path):
    from rlhfflow.runtime.run import run_pipeline
    from rlhfflow.storage import ExperienceBuffer

    (tmp_path / "pidenv.py").write_text(PID_ENV)
    results = {}
    for placement, cluster in (("pool", {"workers": 1, "env_workers": 1}),
                               ("task", {"workers": 1})):
        where = tmp_path / placement
        where.mkdir()
        (where / "pidenv.py").write_text(PID_ENV)
        path = _guess(where, {**cluster, "dashboard_address": ":0"}, env="pidenv.py:PidGuess",
                      env_kwargs={"log": str(where / "pids.log")}, env_placement=placement)
        data = yaml.safe_load(path.read_text())
        data["iterations"] = 2
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        result = run_pipeline(load_pipeline(path), progress=False)
        assert len(result.metrics) == 2
        buffer = ExperienceBuffer(result.output_dir / "buffer.zarr")
        results[placement] = [buffer.read(k) for k in range(2)]
        pids = _pids(where / "pids.log")
        # reset runs in the rollout task; the steps in another process on the pool
        assert pids["step"] and (pids["step"].isdisjoint(pids["reset"])
                                 if placement == "pool" else pids["step"] == pids["reset"])
        tasks = [t for line in (result.output_dir / "tasks.jsonl").read_text().splitlines()
                 for t in json.loads(line)["tasks"]]
        assert any(t[1] == ("rollout/env-pool" if placement == "pool" else "rollout/env")
                   for t in tasks)
    for pool, task in zip(results["pool"], results["task"], strict=True):
        assert (pool["response_ids"] == task["response_ids"]).all()
        assert (pool["response_mask"] == task["response_mask"]).all()
        assert abs(pool["sample_logprobs"] - task["sample_logprobs"]).max() < 1e-4


def test_a_cluster_s_pool_workers_take_no_stage_and_a_pool_run_needs_some(tmp_path):
    from distributed import Client, LocalCluster, Scheduler, SpecCluster, Worker

    from rlhfflow.errors import RunError
    from rlhfflow.runtime.backend import DaskBackend
    from rlhfflow.runtime.workers import env_pool

    path = _guess(tmp_path, {"workers": 1, "address": "tcp://127.0.0.1:1"},
                  env_placement="pool")
    pooled, in_task = load_pipeline(path), load_pipeline(
        path, {"stages.rollout.params.env_placement": "task"})
    specs = {name: {"cls": Worker, "options": {"nthreads": 1, "resources": resources}}
             for name, resources in (("d", {"device": 1}), ("e", {"env": 1}))}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0"}}
    with SpecCluster(workers=specs, scheduler=scheduler) as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        info = client.scheduler_info()["workers"]
        assert [info[a]["name"] for a in backend.workers] == ["d"]
        assert [info[a]["name"] for a in backend.env_workers] == ["e"]
        assert env_pool(pooled, backend) == "env" and env_pool(in_task, backend) is None
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        backend = DaskBackend(client)
        assert len(backend.workers) == 1 and not backend.env_workers
        with pytest.raises(RunError) as info:
            env_pool(pooled, backend)
        assert "\n" not in str(info.value) and "resources env=1" in str(info.value)
