"""Streaming rollouts (``rollout`` with ``stream: true``): the worker's episode loop lives
across tasks, starts the next iterations' episodes in the tail of this one's, and carries
episodes across weight updates, each token recording the version that sampled it. Run
from Python with real tiny models, then as a pipeline on a real Dask cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from rlhfflow.engine.forward import response_logprobs
from rlhfflow.stages import StageContext, create_stage
from tests.conftest import chat_batch, chat_store

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "multiturn"
GUESS = str(EXAMPLE / "envs.py") + ":GuessNumber"
TEXTS = ["guess my number, 1 to 9:", "which number?", "guess a number from 1 to 9:"]
PARAMS = {"env": GUESS, "max_turns": 3, "max_new_tokens": 6, "max_tokens": 120}
#: a stream that returns its own iteration's episodes
ITERATION = {**PARAMS, "stream": True, "stream_order": "iteration"}


def _ctx(store, iteration, ahead=()) -> StageContext:
    return StageContext(iteration=iteration, seed=0, models=store,
                        settings={"base_dir": str(EXAMPLE)}, ahead=list(ahead))


def _batches(tok, n: int) -> list[dict]:
    """Iteration k's source rows: the same texts, prompt indices of their own."""
    out = []
    for k in range(n):
        batch = chat_batch(tok, TEXTS, samples=2)
        batch["prompt_index"] = batch["prompt_index"] + 10 * k
        batch["group_ids"] = batch["group_ids"] + 10 * k
        out.append(batch)
    return out


def _check_against_fresh_forward(module, batch, out, version_of_tokens) -> None:
    """The sampler's log-probs of the tokens a version sampled equal one forward of the
    weights ``module`` holds, for the tokens ``version_of_tokens`` selects."""
    fresh = response_logprobs(module, {**batch, **out})
    chosen = version_of_tokens & (out["response_mask"] == 1)
    assert chosen.any()
    torch.testing.assert_close(fresh[chosen], out["sample_logprobs"][chosen], atol=1e-4,
                               rtol=0)


def test_a_stream_plays_the_plain_rollout_s_episodes_and_starts_the_next_ones_early(
        chat_lm_dir):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batches = _batches(tok, 3)
    plain = create_stage("rollout", params=PARAMS, model="actor")
    expected = [plain.run(batches[k], _ctx(store, k)) for k in range(3)]

    stage = create_stage("rollout", params={**ITERATION,
                                            "stream_in_flight": 12}, model="actor")
    got = [stage.run(batches[k], _ctx(store, k, [(k + 1, batches[k + 1])] if k < 2 else []))
           for k in range(3)]
    for k in range(3):
        # the same episodes (weights unchanged): the same tokens, log-probs to rounding
        assert torch.equal(got[k]["response_ids"], expected[k]["response_ids"])
        assert torch.equal(got[k]["response_mask"], expected[k]["response_mask"])
        torch.testing.assert_close(got[k]["sample_logprobs"], expected[k]["sample_logprobs"],
                                   atol=1e-4, rtol=0)
        assert got[k]["turns"].tolist() == expected[k]["turns"].tolist()
        versions = got[k]["token_versions"]
        assert ((versions == 0) == (got[k]["response_mask"] == 1)).all()
        assert (versions[got[k]["response_mask"] == 0] == -1).all()
        assert got[k]["token_lag"].abs().sum() == 0
    # iteration 0's task started iteration 1's episodes (room for 12 in flight, 6 its own)
    assert got[0]["started_ahead"].sum() == 0
    assert got[1]["started_ahead"].sum() == 6 and got[2]["started_ahead"].sum() == 6
    assert got[0]["episodes_in_flight"][0] > 6
    assert not stage._stream.keys  # nothing left behind after the last iteration
    assert sum(int(g["episodes_dropped"].sum()) for g in got) == 0


@pytest.mark.parametrize("on_update", ["recompute", "keep"])
def test_episodes_go_on_across_a_weight_update_and_each_token_says_its_version(
        chat_lm_dir, on_update):
    store = chat_store(chat_lm_dir)
    resident = store.get("actor")
    tok = resident.tokenizer
    batches = _batches(tok, 2)
    # 8 in flight: 2 of iteration 1's episodes start at once, the others as room frees
    stage = create_stage("rollout", params={**ITERATION, "stream_in_flight": 8,
                                            "stream_on_update": on_update}, model="actor")
    stage.run(batches[0], _ctx(store, 0, [(1, batches[1])]))
    # iteration 1's episodes are under way, some unfinished
    assert not all(e.done for e in stage._stream.episodes.values())
    old = {n: p.detach().clone() for n, p in resident.module.named_parameters()}
    with torch.no_grad():  # an update: new weights, the next version
        for p in resident.module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    resident.version += 1
    out = stage.run(batches[1], _ctx(store, 1))
    versions, mask = out["token_versions"], out["response_mask"]
    assert set(versions[mask == 1].tolist()) == {0, 1}  # partial rollouts: both policies
    assert out["policy_version"].tolist() == \
        [int(versions[r][mask[r] == 1].min()) for r in range(len(versions))]
    assert (out["token_lag"][versions == 0] == 1).all()
    assert out["version_spread"].max() == 1
    if on_update == "keep":  # the old weights' caches kept: not the new policy's exactly
        with pytest.raises(AssertionError):
            _check_against_fresh_forward(resident.module, batches[1], out, versions == 1)
        return
    # every token is its own policy's: the new weights' after the update, the old before
    _check_against_fresh_forward(resident.module, batches[1], out, versions == 1)
    new = {n: p.detach().clone() for n, p in resident.module.named_parameters()}
    with torch.no_grad():
        for n, p in resident.module.named_parameters():
            p.copy_(old[n])
    _check_against_fresh_forward(resident.module, batches[1], out, versions == 0)
    with torch.no_grad():
        for n, p in resident.module.named_parameters():
            p.copy_(new[n])


def test_episodes_no_task_will_claim_are_dropped_and_counted(chat_lm_dir):
    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batches = _batches(tok, 3)
    stage = create_stage("rollout", params=ITERATION, model="actor")
    stage.run(batches[0], _ctx(store, 0, [(1, batches[1])]))
    held = len(stage._stream.keys)
    assert held == 6
    # the run went on at iteration 2 (say, back from a checkpoint on another plan):
    # iteration 1's episodes will never be claimed
    out = stage.run(batches[2], _ctx(store, 2))
    assert int(out["episodes_dropped"].sum()) == held
    assert out["started_ahead"].sum() == 0 and not stage._stream.keys


def test_two_micro_batches_on_one_worker_keep_each_other_s_episodes(chat_lm_dir):
    """Micro-batches 0 and 1 of every iteration run on the same worker (more micro-batches
    than workers): each task's episodes started ahead wait for their own task."""
    from rlhfflow.engine.batch import slice_batch

    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batches = _batches(tok, 3)
    halves = [[slice_batch(b, 0, 3), slice_batch(b, 3, 6)] for b in batches]
    stage = create_stage("rollout", params={**ITERATION,
                                            "stream_in_flight": 6}, model="actor")
    plain = create_stage("rollout", params=PARAMS, model="actor")
    for k in range(3):
        for j in range(2):
            ahead = [(k + 1, halves[k + 1][j])] if k < 2 else []
            out = stage.run(halves[k][j], _ctx(store, k, ahead))
            expected = plain.run(halves[k][j], _ctx(store, k))
            assert torch.equal(out["response_ids"], expected["response_ids"])
            assert int(out["episodes_dropped"].sum()) == 0
            if k:
                assert out["started_ahead"].all()
    assert not stage._stream.keys


def test_between_tasks_the_stream_plays_on_and_waits_while_a_task_runs(chat_lm_dir):
    """In a run's worker (``between_tasks``) the episodes in flight play on after the
    task returns, on the stream's thread; ``paused`` (what a task that writes weights
    holds) stops it at a step boundary."""
    import time

    from rlhfflow.engine.streaming import paused

    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batches = _batches(tok, 2)
    stage = create_stage("rollout", params={**ITERATION,
                                            "stream_in_flight": 7}, model="actor")
    ctx = _ctx(store, 0, [(1, batches[1])])
    ctx.between_tasks = True
    with paused():  # as stage_task holds it
        stage.run(batches[0], ctx)
        stream = stage._stream
        before = (stream.stats.steps, [e.tokens[:] for e in stream.episodes.values()])
        time.sleep(0.3)  # the task still runs: nothing moves
        assert (stream.stats.steps, [e.tokens for e in stream.episodes.values()]) == before
    deadline = time.monotonic() + 30
    while not all(e.done for e in stream.episodes.values()):
        assert time.monotonic() < deadline, "the stream did not play on between tasks"
        time.sleep(0.02)
    assert stream.stats.steps > before[0]
    with paused():
        ctx = _ctx(store, 1)
        ctx.between_tasks = True
        out = stage.run(batches[1], ctx)
    expected = create_stage("rollout", params=PARAMS, model="actor").run(batches[1],
                                                                        _ctx(store, 1))
    assert torch.equal(out["response_ids"], expected["response_ids"])
    assert out["started_ahead"].all()
    stage._stream.close()


def test_a_task_gets_the_stream_within_a_step_while_it_decodes_between_tasks(chat_lm_dir):
    """A lock is not fair: the stream's thread, taking it again right after each step,
    could keep a task waiting in ``paused`` for any number of steps. A waiting task goes
    first: the thread starts no step while it waits, so it waits at most for the step
    under way (and one begun as it arrived)."""
    import threading
    import time

    from rlhfflow.engine.streaming import paused

    store = chat_store(chat_lm_dir)
    tok = store.get("actor").tokenizer
    batches = _batches(tok, 2)
    stage = create_stage("rollout", params={**ITERATION, "stream_in_flight": 7},
                         model="actor")
    ctx = _ctx(store, 0, [(1, batches[1])])
    ctx.between_tasks = True
    with paused():
        stage.run(batches[0], ctx)
    stream = stage._stream
    rounds = [0]

    def busy_round() -> bool:  # a step that always has work, 5 ms under the lock
        rounds[0] += 1
        time.sleep(0.005)
        return True
    stream.round = busy_round
    try:
        deadline = time.monotonic() + 10
        while rounds[0] < 3:
            assert time.monotonic() < deadline, "the stream's thread did not decode"
            time.sleep(0.01)
        with stream.handoff:  # as a task waiting for the lock: no step starts meanwhile
            stream.wanted += 1
        time.sleep(0.05)  # the step under way ends
        held = rounds[0]
        time.sleep(0.2)
        assert rounds[0] == held
        with stream.handoff:
            stream.wanted -= 1
            stream.handoff.notify_all()
        waited = []
        for _ in range(20):
            before = rounds[0]
            with paused():
                waited.append(rounds[0] - before)
                assert stream.lock._is_owned()
            time.sleep(0.01)
        assert max(waited) <= 2, waited
        assert threading.active_count() >= 2 and rounds[0] > before  # it went on after
    finally:
        stream.close()


# --------------------------------------------------------------------------- finish order


def _finish_ctx(store, k: int, batches, taken=frozenset()) -> StageContext:
    """Task ``k``'s context in finish order under ``max_staleness: 1``."""
    ctx = _ctx(store, k, [(k + 1, batches[k + 1])] if k + 1 < len(batches) else [])
    ctx.behind, ctx.staleness, ctx.taken = [(k - 1, batches[k - 1])] if k else [], 1, taken
    return ctx


def _keys(out) -> list[tuple[int, int, int]]:
    return list(zip(out["source_iteration"].tolist(), out["prompt_index"].tolist(),
                    out["sample_index"].tolist(), strict=True))


def _all_keys(batches) -> list[tuple[int, int, int]]:
    return sorted((k, int(p), int(q)) for k, b in enumerate(batches)
                  for p, q in zip(b["prompt_index"], b["sample_index"], strict=True))


TURNS_ENV = """
class Turns:
    \"\"\"An episode of ``record["turns"]`` model turns, at once.\"\"\"

    def reset(self, record):
        self.left = int(record["turns"])
        return []

    def step(self, text):
        self.left -= 1
        return ("go on", 0.0, False, {}) if self.left else ("", 1.0, True, {})
"""


def test_finish_order_returns_whole_groups_that_finished_first_each_episode_once(
        chat_lm_dir, tmp_path):
    """A task returns the groups that finished first among its own iteration's and the
    next one's (twice its rows in flight: iteration 1's one-turn episodes before
    iteration 0's three-turn ones), each row with its own prompt, and what it owes the
    next; over the run every episode is returned once, token for token the plain
    rollout's (the version moves as a trainer's would, the weights stay, the caches are
    kept)."""
    (tmp_path / "turns.py").write_text(TURNS_ENV)
    store = chat_store(chat_lm_dir)
    batches = _batches(store.get("actor").tokenizer, 4)
    for k, batch in enumerate(batches):
        batch["prompt_fields"] = [json.dumps({"turns": 3 - 2 * (k % 2)})] * 6
    params = {**PARAMS, "env": "turns.py:Turns"}
    ctx = {"settings": {"base_dir": str(tmp_path)}}
    plain = create_stage("rollout", params=params, model="actor")
    expected = {}
    for k, batch in enumerate(batches):
        out = plain.run(batch, StageContext(iteration=k, seed=0, models=store, **ctx))
        for row, (p, q) in enumerate(zip(batch["prompt_index"].tolist(),
                                         batch["sample_index"].tolist(), strict=True)):
            expected[(k, p, q)] = (out["response_ids"][row], batch["prompt_text"][row])
    stage = create_stage("rollout", params={**params, "stream": True,
                                            "stream_on_update": "keep"}, model="actor")
    seen, labels = [], []
    for k in range(4):
        store.get("actor").version = k
        task = _finish_ctx(store, k, batches)
        task.settings = StageContext(iteration=k, seed=0, **ctx).settings
        out = stage.run(batches[k], task)
        keys = _keys(out)
        seen += keys
        labels.append(sorted({key[0] for key in keys}))
        assert sorted(Counter(out["group_ids"].tolist()).values()) == [2, 2, 2]
        for row, key in enumerate(keys):
            ids, text = expected[key]
            assert torch.equal(out["response_ids"][row], ids), key
            assert out["prompt_text"][row] == text
            source = batches[key[0]]
            at = source["prompt_index"].tolist().index(key[1])
            real = out["prompt_ids"][row][out["prompt_mask"][row].bool()]
            assert real.tolist() == \
                source["prompt_ids"][at][source["prompt_mask"][at].bool()].tolist()
        assert out["deferred"].tolist() == [int(key[0] < k) for key in keys]
    # iteration 1's short episodes first, then iteration 0's, owed
    assert labels[:2] == [[1], [0]]
    assert sorted(seen) == _all_keys(batches)
    assert not stage._stream.keys


def test_finish_order_starts_no_more_episodes_on_one_version_than_a_step_takes(
        chat_lm_dir, tmp_path):
    """Under ``max_staleness: 2`` with room for three iterations' rows, the first task
    must not start all of them on the first weights: its own and the next iteration's
    long episodes, the one after's short ones finishing first, would all be owed by the
    same later step, twice its rows. At most a step's rows start on each version, so
    the run goes through and every episode is returned once, none older than the
    bound."""
    (tmp_path / "turns.py").write_text(TURNS_ENV)
    store = chat_store(chat_lm_dir)
    batches = _batches(store.get("actor").tokenizer, 6)
    for k, batch in enumerate(batches):
        batch["prompt_fields"] = [json.dumps({"turns": 4 if k < 2 else 1})] * 6
    stage = create_stage("rollout", params={
        **PARAMS, "max_turns": 4, "env": "turns.py:Turns", "stream": True,
        "stream_on_update": "keep", "stream_in_flight": 18}, model="actor")
    seen = []
    for k in range(6):
        store.get("actor").version = k
        ctx = _ctx(store, k, [(j, batches[j]) for j in (k + 1, k + 2) if j < 6])
        ctx.settings = StageContext(iteration=k, seed=0, models=store, settings={
            "base_dir": str(tmp_path)}).settings
        ctx.behind = [(j, batches[j]) for j in (k - 2, k - 1) if j >= 0]
        ctx.staleness = 2
        out = stage.run(batches[k], ctx)
        stream = stage._stream
        started = Counter(stream.started_on.values())
        assert all(n <= 6 for n in started.values()), started
        keys = _keys(out)
        seen += keys
        assert all(k - key[0] <= 2 for key in keys), (k, keys)
        assert (out["policy_version"] >= k - 2).all()
    assert sorted(seen) == _all_keys(batches)
    assert not stage._stream.keys


def test_finish_order_takes_what_the_staleness_bound_owes_first(chat_lm_dir):
    """After a weight update, every episode started on the weights before is owed: the
    task waits for it and returns it, so no token is more than one version behind."""
    store = chat_store(chat_lm_dir)
    resident = store.get("actor")
    batches = _batches(resident.tokenizer, 3)
    stage = create_stage("rollout", params={**PARAMS, "stream": True}, model="actor")
    first = stage.run(batches[0], _finish_ctx(store, 0, batches))
    started = {stage._stream.keys[r] for r in stage._stream.started_in}
    assert len(started) == 6  # twice the rows were started, half are left
    # between tasks on the same weights (the trainer has not updated yet), nothing more
    # starts: an episode started now would be owed by the next task, which can take 6
    stage._stream.admit()
    assert len(stage._stream.started_in) == 6
    with torch.no_grad():
        for p in resident.module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    resident.version += 1
    second = stage.run(batches[1], _finish_ctx(store, 1, batches))
    assert set(_keys(second)) == started  # what version 0 started, nothing newer
    assert (second["policy_version"] == 0).all() and first["policy_version"].eq(0).all()
    third = stage.run(batches[2], _finish_ctx(store, 2, batches))
    assert (third["policy_version"] >= 1).all()
    assert sorted(_keys(first) + _keys(second) + _keys(third)) == _all_keys(batches)


def test_finish_order_with_two_micro_batches_on_one_worker(chat_lm_dir):
    """Two tasks an iteration share the worker's stream: together they take each
    iteration's rows, every episode once, none more than one version behind."""
    from rlhfflow.engine.batch import slice_batch

    store = chat_store(chat_lm_dir)
    resident = store.get("actor")
    batches = _batches(resident.tokenizer, 4)
    halves = [[slice_batch(b, 0, 2), slice_batch(b, 2, 6)] for b in batches]
    stage = create_stage("rollout", params={**PARAMS, "stream": True,
                                            "stream_on_update": "keep"}, model="actor")
    seen = []
    for k in range(4):
        resident.version = k
        for j in range(2):
            ctx = _finish_ctx(store, k, [h[j] for h in halves])
            out = stage.run(halves[k][j], ctx)
            assert len(out["prompt_index"]) == len(halves[k][j]["prompt_index"])
            assert (out["policy_version"] >= k - 1).all()
            seen += _keys(out)
    assert sorted(seen) == _all_keys(batches)


def test_finish_order_after_a_resume_plays_what_was_owed_and_nothing_taken(chat_lm_dir):
    """A new stream (the run resumed after iteration 1) gets the rows of iteration 1
    again and the episodes iterations 0-1 took (``taken``, from the buffer): it plays the
    owed ones afresh and never returns a taken one."""
    store = chat_store(chat_lm_dir)
    batches = _batches(store.get("actor").tokenizer, 4)
    before = create_stage("rollout", params={**PARAMS, "stream": True}, model="actor")
    seen = []
    for k in range(2):
        seen += _keys(before.run(batches[k], _finish_ctx(store, k, batches)))
    before._stream.close()  # the process died with its episodes
    taken = frozenset(key for key in seen if key[0] >= 1)
    after = create_stage("rollout", params={**PARAMS, "stream": True}, model="actor")
    for k in range(2, 4):
        seen += _keys(after.run(batches[k], _finish_ctx(store, k, batches, taken)))
    assert sorted(seen) == _all_keys(batches)


def test_finish_order_after_a_recovery_plays_again_what_an_undone_task_took(chat_lm_dir):
    """The run went back to the checkpoint after iteration 0 (a worker was lost) and the
    stream on a surviving worker goes on: what its task of iteration 1 took was undone,
    so those episodes are played again; what iteration 0 took is not."""
    store = chat_store(chat_lm_dir)
    batches = _batches(store.get("actor").tokenizer, 4)
    stage = create_stage("rollout", params={**PARAMS, "stream": True}, model="actor")
    first = _keys(stage.run(batches[0], _finish_ctx(store, 0, batches)))
    stage.run(batches[1], _finish_ctx(store, 1, batches))  # undone by the recovery
    seen = list(first)
    for k in range(1, 4):
        seen += _keys(stage.run(batches[k], _finish_ctx(
            store, k, batches, frozenset(key for key in first if key[0] >= 0))))
    assert sorted(seen) == _all_keys(batches)


# --------------------------------------------------------------------------- a pipeline


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHFFLOW_WARM": "0"}
    return subprocess.run([sys.executable, "-m", "rlhfflow.cli.main", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def _pipeline(tmp_path: Path, iterations: int | None = None, checkpoint=None,
              **overrides) -> Path:
    config = yaml.safe_load((EXAMPLE / "guess-stream-tiny.yaml").read_text())
    config["data"]["prompts"] = str(EXAMPLE / config["data"]["prompts"])
    config["stages"]["rollout"]["params"]["env"] = GUESS
    config["output"] = str(tmp_path / "out")
    if iterations is not None:
        config["iterations"] = iterations
    if checkpoint is not None:
        config["checkpoint"] = checkpoint
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        config[section][name] = value
    path = tmp_path / "stream.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_a_streaming_pipeline_trains_on_two_workers_and_reports_its_stream(tmp_path):
    path = _pipeline(tmp_path)
    result = _cli("run", str(path), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in
               (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    later = records[1:]
    assert all(r["started_ahead_frac"] > 0 for r in later)  # episodes started early
    assert all(r["episodes_dropped"] == 0 for r in records)
    # (an iteration whose episodes all finished in the task before decodes nothing)
    assert all(0 <= r["decode_occupancy"] <= 1 for r in records)
    assert records[0]["decode_occupancy"] > 0
    # staleness is bounded by admission: no token is more than max_staleness behind
    assert all(r["train"]["train_actor"]["staleness_max"] <= 1 for r in records)
    assert any(r["token_lag_mean"] > 0 for r in later)
    _assert_each_episode_once(tmp_path / "out", 4)
    from rlhfflow.monitor.report import build_report

    page = build_report(tmp_path / "out", samples=0)
    assert "<h2>Streaming episodes</h2>" in page and "alt='streaming episodes'" in page
    # finish order's figures are recorded and among those the section plots
    from rlhfflow.monitor.report import STREAM_TITLES

    for key in ("deferred_frac", "stream_wait_owed_s", "stream_wait_groups_s"):
        assert key in STREAM_TITLES and all(key in r for r in records)


def test_the_plan_says_the_rollout_streams_and_pins_its_micro_batches(tmp_path):
    path = _pipeline(tmp_path)
    plan = _cli("plan", str(path), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "micro-batch j always on the same one" in plan.stdout
    assert "rollout streams episodes" in plan.stdout
    explained = _cli("plan", str(path), "--explain", "rollout", cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr
    assert "rollout-1-0: rows 0-7, on worker 0" in explained.stdout
    assert "rollout-1-1: rows 8-15, on worker 1" in explained.stdout
    assert "streams, finish order: it gets its rows of iteration 1 and of iteration(s) 2" \
        in explained.stdout
    assert "it waits while such an owed group is unfinished" in explained.stdout
    assert "finish order: rollout returns the groups that finished first" in plan.stdout
    config = yaml.safe_load(path.read_text())
    config["stages"]["rollout"]["params"]["stream_order"] = "iteration"
    path.write_text(yaml.safe_dump(config))
    explained = _cli("plan", str(path), "--explain", "rollout", cwd=tmp_path)
    assert "streams: it also gets its rows of iteration(s) 2" in explained.stdout


def test_streaming_needs_a_staleness_bound_and_names_its_bias_without_a_correction(
        tmp_path):
    path = _pipeline(tmp_path, **{"overlap.max_staleness": 0})
    result = _cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "stream" in line and "max_staleness" in line and str(path.name) in line
    assert "Traceback" not in result.stderr


def test_finish_order_refuses_a_stage_that_reads_the_prompts_beside_the_rollout(tmp_path):
    """Finish order returns other iterations' prompts: a stage reading the prompts that
    does not run after the rollout would pair them wrongly; after it, it is fine."""
    path = _pipeline(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["stages"]["lengths"] = {"type": "tests.metrics_plugin:PromptLength"}
    path.write_text(yaml.safe_dump(config))
    result = _cli("validate", str(path), cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "stages.lengths" in line and "after: [rollout]" in line and path.name in line
    config["stages"]["lengths"]["after"] = ["rollout"]
    path.write_text(yaml.safe_dump(config))
    assert _cli("validate", str(path), cwd=REPO).returncode == 0


# --------------------------------------------------------------------------- faults


def _popen(path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHFFLOW_WARM": "0",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _assert_each_episode_once(out: Path, iterations: int, rows: int = 16) -> None:
    """Finish order: the buffer's rows over the run are every iteration's episodes
    (``source_iteration``, ``prompt_index``, ``sample_index``) once each."""
    from rlhfflow.storage.buffer import ExperienceBuffer

    buffer = ExperienceBuffer(out / "buffer.zarr")
    keys = []
    for k in buffer.iterations():
        got = buffer.read(k, ["source_iteration", "prompt_index", "sample_index"])
        keys += zip(*(got[c].tolist() for c in got), strict=True)
    assert len(keys) == len(set(keys)) == iterations * rows
    assert Counter(key[0] for key in keys) == dict.fromkeys(range(iterations), rows)


def _faulty_pipeline(tmp_path: Path) -> tuple[Path, Path]:
    path = _pipeline(tmp_path, iterations=6, checkpoint={"every": 1, "keep": 2})
    return path, tmp_path / "out"


@pytest.mark.slow
def test_sigkill_then_resume_loses_and_repeats_no_episode(tmp_path):
    """The episodes in flight die with the run; the resumed run starts what the
    iterations up to the last checkpoint did not take afresh from its prompts: every
    iteration trained once, every episode once (finish order: read from the buffer)."""
    import psutil

    from tests.runtime.test_resume import _assert_each_iteration_once, _wait_for_lines

    path, out = _faulty_pipeline(tmp_path)
    proc = _popen(path)
    _wait_for_lines(out / "metrics.jsonl", 3, proc)
    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    psutil.wait_procs(workers, timeout=60)
    again = _popen(path)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "resuming after iteration" in stderr
    _assert_each_iteration_once(out, 6)
    _assert_each_episode_once(out, 6)


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_a_streaming_run_completes(tmp_path):
    import psutil

    from rlhfflow.runtime.cluster import embedded_worker_processes
    from tests.runtime.test_resume import _assert_each_iteration_once, _wait_for_lines

    path, out = _faulty_pipeline(tmp_path)
    proc = _popen(path)
    _wait_for_lines(out / "metrics.jsonl", 2, proc)
    workers = embedded_worker_processes(psutil.Process(proc.pid))
    workers[0].kill()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "recovering from the last checkpoint" in stderr
    _assert_each_iteration_once(out, 6)
    _assert_each_episode_once(out, 6)
