"""Sample reallocation: rows still decoding move to an idle worker of the same stage.

The decode loop's handover is tested on its own with a peer that is a second stage
object holding its own copy of the model (another "worker" in this process), then on a
real two-worker Dask cluster: a generate task on one worker hands rows to the other
through the run's event topic and a ``moved-generate`` task. Tokens equal those of the
same batch decoded alone; log-probs agree to float rounding (CPU matrix kernels are not
batch-invariant at a few rows: a row's logits move by ~1e-6 when its batch shrinks).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from rlhfflow.engine.models import build_char_tokenizer, save_model
from rlhfflow.runtime.worker.host import PLUGIN_NAME, RLHFWorkerPlugin, RunDef, StageDef
from rlhfflow.runtime.worker.tasks import part, stage_task
from rlhfflow.stages import ModelConfig, ModelStore, StageContext, create_stage
from tests.conftest import make_prompt_batch, peaked_model
from tests.engine.test_generation import TEXTS

PARAMS = {"max_new_tokens": 16, "migrate_min_s": 0.0}


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    """A tiny actor whose rows end (EOS) at very different steps."""
    tok = build_char_tokenizer()
    path = tmp_path_factory.mktemp("rebalance") / "actor"
    save_model(peaked_model(tok, 0, 40.0), tok, path)
    return path


@pytest.fixture(scope="module")
def batch():
    return make_prompt_batch(build_char_tokenizer(), TEXTS, samples=3)


def _store(actor_dir) -> ModelStore:
    return ModelStore({"actor": ModelConfig("actor", "lm", str(actor_dir))})


def _alone(actor_dir, batch, **params):
    stage = create_stage("generate", params={**PARAMS, **params}, model="actor")
    return stage.run(batch, StageContext(iteration=0, seed=0, models=_store(actor_dir)))


def _assert_same(out, alone) -> None:
    for key in ("response_ids", "response_mask", "gen_steps"):
        assert torch.equal(out[key], alone[key]), key
    assert torch.allclose(out["sample_logprobs"], alone["sample_logprobs"], rtol=0, atol=1e-5)


class StagePeer:
    """A peer in this process: another stage object with its own copy of the model.
    Idle at the decode steps listed in ``at``; ``refuse`` answers like a worker whose
    model version moved on."""

    def __init__(self, actor_dir, at=(2, 5), refuse=False):
        self.other = create_stage("generate", params=PARAMS, model="actor")
        self.ctx = StageContext(iteration=0, seed=0, models=_store(actor_dir))
        self.at, self.refuse, self.calls, self.sent = set(at), refuse, 0, []

    def peer(self, rows, saving_s):
        self.calls += 1
        return "peer" if self.calls in self.at else None

    def send(self, peer, cont):
        self.sent.append(len(cont.rows))
        return None if self.refuse else self.other.continue_rows(cont, self.ctx)

    def gather(self, handles):
        return list(handles)


def test_rows_handed_over_mid_decode_finish_as_they_would_have_here(actor_dir, batch):
    alone = _alone(actor_dir, batch)
    peer = StagePeer(actor_dir)
    stage = create_stage("generate", params=PARAMS, model="actor")
    out = stage.run(batch, StageContext(iteration=0, seed=0, models=_store(actor_dir),
                                        peers=peer))
    assert len(peer.sent) == 2 and peer.sent[0] >= 2  # half the active rows, twice
    assert int(out["gen_moved"].sum()) == sum(peer.sent)
    _assert_same(out, alone)
    lengths = alone["response_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # rows do end at different steps


def test_rows_a_peer_refuses_are_finished_by_the_handing_task(actor_dir, batch):
    alone = _alone(actor_dir, batch)
    peer = StagePeer(actor_dir, refuse=True)
    stage = create_stage("generate", params=PARAMS, model="actor")
    out = stage.run(batch, StageContext(iteration=0, seed=0, models=_store(actor_dir),
                                        peers=peer))
    assert peer.sent and int(out["gen_moved"].sum()) == 0
    _assert_same(out, alone)


def test_no_handover_with_migrate_off_or_with_a_drafter(actor_dir, batch):
    for params in ({"migrate": False}, {"drafter": "ngram", "ngram_min": 1}):
        peer = StagePeer(actor_dir, at=range(100))
        stage = create_stage("generate", params={**PARAMS, **params}, model="actor")
        stage.run(batch, StageContext(iteration=0, seed=0, models=_store(actor_dir),
                                      peers=peer))
        assert peer.calls == 0 and not peer.sent, params


def test_a_generate_task_hands_rows_to_an_idle_dask_worker(cluster, actor_dir, batch):
    """Real Dask: worker B says it is idle on the run's topic (as its last task would);
    a generate task pinned to worker A sends it rows in a ``moved-generate`` task."""
    from distributed import Client

    topic = f"rlhfflow-rows-{uuid.uuid4().hex[:8]}"
    stage = StageDef("rlhfflow.stages.generate:GenerateStage",
                     create_stage("generate", params=PARAMS, model="actor").params, "actor",
                     reads=("prompt_ids", "prompt_mask", "prompt_index", "sample_index"))
    run = RunDef(stages={"generate": stage},
                 models={"actor": ModelConfig("actor", "lm", str(actor_dir))},
                 algorithm=None, seed=0, settings={"rows_topic": topic})
    with Client(cluster) as client:
        client.register_plugin(RLHFWorkerPlugin(run, 1), name=PLUGIN_NAME)
        a, b = sorted(client.scheduler_info()["workers"])
        client.log_event(topic, {"worker": b, "idle": True, "versions": {"actor": 0}})
        [data] = client.scatter([batch], workers=[a])
        future = client.submit(stage_task, "generate", 0, [part([data])], [], {"actor": 0},
                               workers=[a], allow_other_workers=False, pure=False)
        out = future.result().columns
        moved = [t for t in client.run(_stage_intervals, workers=[b])[b]
                 if t[1] == "generate"]
    assert int(out["gen_moved"].sum()) >= 2
    assert moved  # the continuation ran on B, recorded as generate time there
    _assert_same(out, _alone(actor_dir, batch))


def _stage_intervals(dask_worker=None):
    from rlhfflow.runtime.worker.host import current_host

    return list(current_host(dask_worker).timings)
