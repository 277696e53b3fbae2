"""What a long run keeps in memory is bounded: the Dask lineage of its tasks (every
``LINEAGE_EVERY`` iterations no dependency crosses back), the workers' developer logs
(``DEVELOPER_LOGS``), and the dashboard's task stream. ``benchmarks/memory.py`` measures the
processes' resident memory over thousands of iterations."""

from __future__ import annotations

import time

import numpy as np
import pytest
from distributed import Client, Event, LocalCluster, SchedulerPlugin

from rlhfflow.config.loader import load_pipeline
from rlhfflow.plan.tasks import AFTER, Task, Wait
from rlhfflow.runtime.backend import DaskBackend
from rlhfflow.runtime.cluster import DEVELOPER_LOGS, TASK_STREAM_LENGTH
from rlhfflow.runtime.dataflow import LINEAGE_EVERY, Dataflow
from rlhfflow.runtime.run import run_pipeline
from rlhfflow.storage import ExperienceBuffer
from tests.conftest import small_pipeline


@pytest.fixture(scope="module")
def threads_cluster():
    """One in-process worker: the waits are about futures, not about where they run."""
    with LocalCluster(n_workers=1, threads_per_worker=4, processes=False,
                      dashboard_address=":0") as cluster:
        yield cluster


def _hold(event_name: str) -> str:
    Event(event_name).wait()
    return "done"


def _waiting(spec_iteration: int, target_iteration: int, dataflow: Dataflow, handle
             ) -> Task:
    dataflow.handles["target"] = handle
    dataflow._iteration["target"] = target_iteration
    return Task(id="waiter", iteration=spec_iteration, waits=(Wait("target", AFTER),))


def test_a_wait_for_a_finished_task_is_left_out(threads_cluster):
    with Client(threads_cluster) as client:
        dataflow = Dataflow(DaskBackend(client), [])
        done = client.submit(lambda: 1, key="finished-task")
        done.result()
        assert dataflow.waits(_waiting(3, 2, dataflow, done)) == []


def test_a_wait_for_a_running_task_stays_between_lineage_cuts(threads_cluster):
    with Client(threads_cluster) as client:
        dataflow = Dataflow(DaskBackend(client), [])
        running = client.submit(_hold, "between", key="running-task")
        try:
            iteration = LINEAGE_EVERY + 1  # not a multiple: no cut
            assert dataflow.waits(_waiting(iteration, iteration - 1, dataflow, running)) \
                == [running]
        finally:
            Event("between", client=client).set()
        assert running.result() == "done"


def test_at_a_lineage_cut_a_task_of_an_earlier_iteration_is_waited_for_and_left_out(
        threads_cluster):
    with Client(threads_cluster) as client:
        dataflow = Dataflow(DaskBackend(client), [])
        running = client.submit(_hold, "cut", key="earlier-task")
        # set from a task: the cut blocks this thread until the earlier task is done
        client.submit(lambda: Event("cut").set(), key="setter")
        assert dataflow.waits(_waiting(2 * LINEAGE_EVERY, 2 * LINEAGE_EVERY - 1, dataflow,
                                       running)) == []
        assert running.status == "finished"


class _LiveTasks(SchedulerPlugin):
    """The most tasks the scheduler held at once, and how many it was given."""

    name = "live-tasks"

    def __init__(self) -> None:
        self.most, self.keys = 0, set()

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        self.keys.add(key)
        self.most = max(self.most, len(self.scheduler.tasks))


def _live_tasks(dask_scheduler=None) -> tuple[int, int]:
    plugin = dask_scheduler.plugins[_LiveTasks.name]
    return plugin.most, len(plugin.keys)


@pytest.mark.slow
def test_a_long_run_keeps_the_tasks_of_a_few_iterations_not_of_all(cluster, tmp_path):
    iterations = 3 * LINEAGE_EVERY
    path = small_pipeline(tmp_path, "ppo", iterations=iterations, batch_size=4,
                          max_new_tokens=4,
                          overrides={"cluster.address": cluster.scheduler_address})
    with Client(cluster) as client:
        client.register_plugin(_LiveTasks())
        run_pipeline(load_pipeline(path), progress=False)
        most, total = client.run_on_scheduler(_live_tasks)
    per_iteration = total / iterations
    # the lineage of every iteration would be ~iterations x per_iteration tasks at the end
    assert most < (LINEAGE_EVERY + 4) * per_iteration, (most, total)


def _known(key: str, dask_scheduler=None) -> bool:
    return key in dask_scheduler.tasks


def _stage_groups(dask_scheduler=None) -> dict[str, int]:
    """The "stage" task groups the scheduler's records hold (the module's other tests
    leave groups of their own on the shared cluster)."""
    spans = dask_scheduler.extensions["spans"].spans.values()
    return {"computations": sum(g.name == "stage" for c in dask_scheduler.computations
                                for g in c.groups),
            "spans": sum(g.name == "stage" for s in spans for g in s.groups),
            "dependencies": sum(len(g.dependencies) for g in dask_scheduler.task_groups.values()
                                if g.name == "train")}


def test_a_busy_cluster_keeps_only_the_task_groups_it_still_has(threads_cluster):
    with Client(threads_cluster) as client:
        # a task that runs throughout: the cluster is never idle, so Dask adds every
        # group to one computation and one span (as in a pipelined run); its group
        # ("train") lives on, and its tasks depend on a group that does not ("stage")
        busy = client.submit(_hold, "busy", key="train-0")
        DaskBackend(client)  # registers the plugin, as a run does
        for i in range(20):
            # the "stage" group is forgotten with its task, and made again by the next
            key = f"stage-{i}-{i:08x}"
            future = client.submit(lambda x: x, i, key=key)
            follower = client.submit(lambda x: x, future, key=f"train-{i + 1}")
            follower.result()
            del future, follower
            while client.run_on_scheduler(_known, key):
                time.sleep(0.01)
        groups = client.run_on_scheduler(_stage_groups)
        Event("busy", client=client).set()
        busy.result()
        del busy
        while client.run_on_scheduler(_known, "train-0"):
            time.sleep(0.01)
        # the next graph starts a new span; the ended one keeps a group, and Dask's
        # totals over all spans (the dashboard's Fine Performance Metrics) still add up
        client.submit(lambda: 1, key="after-0").result()
        totals = client.run_on_scheduler(_span_totals)
    assert totals["spans"] >= 2 and totals["empty"] == 0, totals
    # the last stage's group, not 20; train's depends on that one only
    assert groups == {"computations": 1, "spans": 1, "dependencies": 1}, groups


def _span_totals(dask_scheduler=None) -> dict[str, int]:
    spans = dask_scheduler.extensions["spans"]
    spans.merge_all().cumulative_worker_metrics  # noqa: B018 - raises on a span of no group
    return {"spans": len(spans.spans),
            "empty": sum(not s.groups for s in spans.spans.values())}


def _logs(dask_worker=None) -> dict[str, int | str]:
    import dask

    return {"stimulus_log": dask_worker.state.stimulus_log.maxlen,
            "profile_history": dask_worker.profile_history.maxlen,
            "profile_interval": dask.config.get("distributed.worker.profile.interval")}


def test_an_embedded_cluster_keeps_short_developer_logs_and_the_task_stream_is_capped():
    import dask

    from rlhfflow.monitor.dashboard import PAGE_ITERATIONS, PLUGIN_NAME, MetricsPage

    length = DEVELOPER_LOGS["distributed.admin.low-level-log-length"]
    before = dask.config.get("distributed.admin.low-level-log-length")
    backend = DaskBackend.connect(None, 1, dashboard_address="127.0.0.1:0", torch_threads=1)
    try:
        client, scheduler = backend.client, backend.cluster.scheduler
        [logs] = client.run(_logs).values()
        # the coordinator's batched streams (the client's, the scheduler's to its worker
        # and client) and its transition log: each entry a batch of whole task messages
        streams = [client.scheduler_comm, *scheduler.stream_comms.values(),
                   *scheduler.client_comms.values()]
        assert [s.recent_message_log.maxlen for s in streams] == [length] * len(streams)
        assert scheduler.transition_log.maxlen == length
        # made as the Task Stream page is first opened, after the cluster started
        stream = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler._task_stream_plugin().buffer.maxlen)
        # the rlhfflow page keeps its own iterations, more than the scheduler's topic
        for i in range(length + 50):
            client.log_event("rlhfflow", {"run": "r", "iteration": i, "reward_mean": 0.5})
        plugin = scheduler.plugins[PLUGIN_NAME]
        deadline = time.monotonic() + 30
        while len(plugin.events) < length + 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        page = MetricsPage(scheduler)
        page.update()
        assert len(scheduler.get_events("rlhfflow")) == length
        assert page.source.data["iteration"] == list(range(length + 50))
        assert PAGE_ITERATIONS >= 1000
    finally:
        backend.close()
    assert logs["stimulus_log"] == logs["profile_history"] == length
    # the rest of the embedded cluster's config reached the worker too (quiet timers)
    assert logs["profile_interval"] == "100ms"
    assert stream == TASK_STREAM_LENGTH
    # the caller's config is back once the run's cluster is closed
    assert dask.config.get("distributed.admin.low-level-log-length") == before


@pytest.mark.slow
def test_a_lineage_cut_changes_no_order_one_step_off_policy(cluster, tmp_path):
    """Across a cut (iteration ``LINEAGE_EVERY``), with rollouts one update ahead, every
    row is still sampled by the version before its iteration's, and the run computes
    what the in-process run computes."""
    iterations = LINEAGE_EVERY + 2

    def run(name: str, inline: bool):
        path = small_pipeline(tmp_path, iterations=iterations, batch_size=4,
                              max_new_tokens=4, file_name=f"{name}.yaml", overrides={
                                  "output": str(tmp_path / name), "data.micro_batches": 2,
                                  "cluster.address": cluster.scheduler_address,
                                  "placement.strategy": "interleaved",
                                  "overlap.max_staleness": 1})
        return run_pipeline(load_pipeline(path), progress=False, inline=inline)

    result = run("dask", inline=False)
    buffer = ExperienceBuffer(result.output_dir / "buffer.zarr", create=False)
    for k in range(iterations):
        versions = np.asarray(buffer.read(k, ["policy_version"])["policy_version"])
        assert set(versions.tolist()) == {max(0, k - 1)}, k
    keys = ("reward_mean", "kl_mean", "policy_loss", "value_loss", "clip_frac")
    inline = run("inline", inline=True)
    np.testing.assert_allclose(
        np.array([[m[k] for k in keys] for m in inline.metrics], dtype=float),
        np.array([[m[k] for k in keys] for m in result.metrics], dtype=float), rtol=1e-5)


def test_a_wait_for_data_placed_as_it_is_is_left_out(threads_cluster):
    with Client(threads_cluster) as client:
        dataflow = Dataflow(DaskBackend(client), [])
        inline = {"prompt_ids": [[1, 2]]}  # what DaskBackend.place returns for small data
        assert dataflow.waits(_waiting(LINEAGE_EVERY, 0, dataflow, inline)) == []
