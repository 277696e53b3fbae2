"""Generation: finished rows leave the batch, speculative decoding keeps the target
exactly (greedy tokens, sampled distribution), adaptive drafting, per-row metrics.

Real tiny models throughout. The actor's and the draft's LM heads are scaled up so that
their next-token distributions are peaked and different: with the near-uniform output of a
freshly initialised model nearly every draft would be accepted and a broken residual
(rejection) path would go unnoticed.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.loader import load_pipeline
from rlhfflow.config.spec import SpecError
from rlhfflow.engine.drafting import ForwardCost, shallow_view
from rlhfflow.engine.models import (
    DEFAULT_ALPHABET,
    build_char_tokenizer,
    build_tiny_model,
    save_model,
)
from rlhfflow.stages import ModelConfig, ModelStore, StageContext, create_stage
from tests.conftest import make_prompt_batch, peaked_model, small_pipeline

TEXTS = ["describe the sun:", "a", "talk about a fire and a rain:", "hello there",
         "speak of the star:", "x y z"]
EOS = 2
DRAFTERS = {
    "ngram": {"drafter": "ngram", "ngram_min": 1},
    "layers": {"drafter": "layers", "draft_layers": 1},
    "model": {"drafter": "model", "draft_model": "draft"},
    "adaptive": {"drafter": "adaptive", "adaptive_drafters": ["ngram", "layers", "model"],
                 "draft_model": "draft", "ngram_min": 1, "draft_layers": 1,
                 # a cost model that makes drafting pay, so adaptive drafts in the test
                 "verify_cost": [0.01, 0.00001]},
}


@pytest.fixture(scope="module")
def gen_store(tmp_path_factory) -> ModelStore:
    """An actor, a draft model with the same tokenizer and a model with another one."""
    root = tmp_path_factory.mktemp("generation")
    tok = build_char_tokenizer()
    save_model(peaked_model(tok, 0, 40.0), tok, root / "actor")
    save_model(peaked_model(tok, 1, 40.0), tok, root / "draft")
    other = build_char_tokenizer("abc")
    save_model(build_tiny_model(other, "lm", seed=2), other, root / "other")
    return ModelStore({name: ModelConfig(name, "lm", str(root / name))
                       for name in ("actor", "draft", "other")})


def _run(store, batch, seed=0, **params):
    stage = create_stage("generate", params={"max_new_tokens": 16, **params}, model="actor")
    out = stage.run(batch, StageContext(iteration=0, seed=seed, models=store))
    return out, stage


# --------------------------------------------------------------------------- compaction


@pytest.mark.parametrize("params", [{}, {"temperature": 0.7, "top_p": 0.9}, {"greedy": True}])
def test_finished_rows_leave_the_batch_with_bit_identical_tokens_and_logprobs(
        gen_store, params):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=3)
    today, _ = _run(gen_store, batch, compact=False, **params)
    compact, stage = _run(gen_store, batch, compact=True, **params)
    lengths = today["response_mask"].sum(-1)
    assert lengths.min() < lengths.max()  # rows do finish at different steps
    assert stage.last_stats.rows_left == len(lengths)
    for key in ("response_ids", "response_mask", "sample_logprobs"):
        assert torch.equal(compact[key], today[key]), key


# --------------------------------------------------------------------------- speculation


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_speculation_gives_the_plain_tokens(gen_store, drafter):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=2)
    plain, _ = _run(gen_store, batch, greedy=True, compact=False)
    spec, stage = _run(gen_store, batch, greedy=True, **DRAFTERS[drafter])
    assert torch.equal(spec["response_ids"], plain["response_ids"])
    assert torch.equal(spec["response_mask"], plain["response_mask"])
    torch.testing.assert_close(spec["sample_logprobs"], plain["sample_logprobs"],
                               atol=1e-4, rtol=0)
    assert int(spec["gen_drafted"].sum()) > 0  # it did speculate
    assert bool((spec["gen_accepted"] <= spec["gen_drafted"]).all())


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_sampled_speculation_is_reproducible_and_logprobs_are_the_targets(
        gen_store, drafter):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=2)
    first, _ = _run(gen_store, batch, temperature=0.8, **DRAFTERS[drafter])
    again, _ = _run(gen_store, batch, temperature=0.8, **DRAFTERS[drafter])
    other_seed, _ = _run(gen_store, batch, seed=1, temperature=0.8, **DRAFTERS[drafter])
    assert torch.equal(first["response_ids"], again["response_ids"])
    assert not torch.equal(first["response_ids"], other_seed["response_ids"])
    batch.update(first)
    logprob = create_stage("logprob", params={"output": "old_logprobs"}, model="actor")
    out = logprob.run(batch, StageContext(iteration=0, seed=0, models=gen_store,
                                          settings={"temperature": 0.8}))
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(out["old_logprobs"][mask], batch["sample_logprobs"][mask],
                               atol=1e-4, rtol=0)


def _exact_marginals(module, prompt: list[int], vocab: int, temperature: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of response positions 1 and 2 (index ``vocab``: the response
    ended before, at EOS), by enumerating the first one or two tokens."""
    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = module(input_ids=prefixes).logits[:, -1].double()
        return torch.softmax(logits / temperature, -1)

    base = torch.tensor([prompt])
    p0 = next_probs(base)[0]
    firsts = torch.arange(vocab)[:, None]
    p1_given = next_probs(torch.cat([base.expand(vocab, -1), firsts], 1))  # [a, b]
    pair = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    p2_given = next_probs(torch.cat([base.expand(len(pair), -1), pair], 1)).view(
        vocab, vocab, vocab)  # [a, b, c]
    joint1 = p0[:, None] * p1_given
    live = torch.ones(vocab, dtype=torch.bool)
    live[EOS] = False
    pos1 = torch.zeros(vocab + 1, dtype=torch.float64)
    pos1[:vocab] = joint1[live].sum(0)
    pos1[vocab] = p0[EOS]
    joint1 = joint1 * live[:, None] * live[None, :]
    pos2 = torch.zeros(vocab + 1, dtype=torch.float64)
    pos2[:vocab] = (joint1[..., None] * p2_given).sum((0, 1))
    pos2[vocab] = 1 - pos2[:vocab].sum()
    return pos1, pos2


def _chi_square_p_ok(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, float]:
    """``(statistic, critical value at p = 0.001)``; bins with fewer than 5 expected
    draws are merged into one."""
    total = int(counts.sum())
    expected = expected_p * total
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.0902  # one-sided normal quantile of 0.999 (Wilson-Hilferty approximation)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


DRAWS = 3000


@pytest.fixture(scope="module")
def draw_batch():
    """One prompt sampled ``DRAWS`` times. Every character is in the prompt, so the
    n-gram drafter always finds the last token."""
    return make_prompt_batch(build_char_tokenizer(), [DEFAULT_ALPHABET], samples=DRAWS)


@pytest.fixture(scope="module")
def exact_marginals(gen_store, draw_batch):
    """The actor's exact distributions of response positions 1 and 2 at temperature 1."""
    module = gen_store.get("actor").module
    prompt = draw_batch["prompt_ids"][0][draw_batch["prompt_mask"][0].bool()].tolist()
    return _exact_marginals(module, prompt, module.config.vocab_size, 1.0)


@pytest.mark.parametrize("drafter", ["ngram", "layers", "model", "adaptive", "wrong"])
def test_sampled_speculation_keeps_the_target_distribution(gen_store, draw_batch,
                                                            exact_marginals, drafter):
    draws, batch = DRAWS, draw_batch
    params = dict(DRAFTERS.get(drafter, {}))
    if drafter == "adaptive":  # a fixed cost per forward: drafting pays at any batch
        params["verify_cost"] = [1.0, 0.0]
    if drafter == "wrong":  # the test must notice a changed distribution
        params = {"compact": False, "temperature": 1.25}
    # 4 tokens: the first verification drafts positions 1 and 2
    out, _ = _run(gen_store, batch, max_new_tokens=4, **params)
    vocab = gen_store.get("actor").module.config.vocab_size
    for position, exact in zip((1, 2), exact_marginals, strict=True):
        tokens = torch.where(out["response_mask"][:, position].bool(),
                             out["response_ids"][:, position], vocab)
        counts = torch.bincount(tokens, minlength=vocab + 1)
        stat, critical = _chi_square_p_ok(counts, exact)
        if drafter == "wrong":
            assert stat > critical, (position, stat, critical)
        else:
            assert stat < critical, (position, stat, critical)
    if drafter != "wrong":
        assert int(out["gen_drafted"].sum()) > draws // 2
        assert 0 < int(out["gen_accepted"].sum()) < int(out["gen_drafted"].sum())


def test_adaptive_turns_speculation_off_where_verification_costs_per_token(gen_store):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=4)
    # every scored token costs the same and nothing is fixed: drafting cannot pay
    params = dict(DRAFTERS["adaptive"], verify_cost=[0.0, 0.001])
    out, stage = _run(gen_store, batch, **params)
    assert set(stage.last_stats.choices) == {("off", 0)}
    assert int(out["gen_drafted"].sum()) == 0


def test_adaptive_drafts_while_acceptance_pays_and_records_its_choices(gen_store):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS[:2], samples=1)
    out, stage = _run(gen_store, batch, greedy=True, max_new_tokens=24, **DRAFTERS["adaptive"])
    chosen = {name for name, k in stage.last_stats.choices if k}
    assert chosen and chosen <= {"ngram", "layers", "model"}
    assert int(out["gen_k_sum"].sum()) > 0
    assert out["gen_seconds"].dtype == torch.float32 and bool((out["gen_seconds"] > 0).all())


def test_the_ngram_drafter_learns_from_earlier_responses_to_the_same_prompt(gen_store):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=1)
    stage = create_stage("generate", params={"max_new_tokens": 16, "greedy": True,
                                             "drafter": "ngram", "ngram_min": 3},
                         model="actor")
    ctx = StageContext(iteration=0, seed=0, models=gen_store)
    first = stage.run(batch, ctx)
    second = stage.run(batch, ctx)  # greedy: the same responses, now in the history
    assert torch.equal(first["response_ids"], second["response_ids"])
    assert int(second["gen_accepted"].sum()) > int(first["gen_accepted"].sum())
    assert int(second["gen_steps"].sum()) < int(first["gen_steps"].sum())


def _store_iteration(path, iteration: int, batch, out) -> None:
    """Commit one iteration's token columns to an experience buffer, as a run does."""
    from rlhfflow.storage import ExperienceBuffer
    from rlhfflow.storage.buffer import ColumnSpec

    columns = {**{c: batch[c] for c in ("prompt_ids", "prompt_mask", "prompt_index")},
               **{c: out[c] for c in ("response_ids", "response_mask")}}
    buffer = ExperienceBuffer(path)
    buffer.begin_iteration(iteration, len(batch["prompt_index"]), {
        c: ColumnSpec(str(v.numpy().dtype), tuple(v.shape[1:])) for c, v in columns.items()},
        chunk_rows=4)
    ExperienceBuffer.write_rows(path, iteration, 0, columns)
    buffer.commit(iteration)


def test_the_ngram_history_comes_from_the_buffer_on_a_worker_that_never_saw_the_prompt(
        gen_store, tmp_path):
    """A fresh stage (a restarted worker, or one the prompt was never generated on) finds
    the earlier responses in the run's buffer: greedy repeats them, so drafts are taken."""
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS, samples=1)
    params = {"max_new_tokens": 16, "greedy": True, "drafter": "ngram", "ngram_min": 3}
    buffer = str(tmp_path / "buffer.zarr")
    ctx = StageContext(iteration=1, seed=0, models=gen_store, settings={"buffer": buffer})
    first = create_stage("generate", params=params, model="actor").run(batch, ctx)
    _store_iteration(buffer, 0, batch, first)
    without = create_stage("generate", params=params, model="actor").run(batch, ctx)
    reader = create_stage("generate", params={**params, "ngram_buffer": 2}, model="actor")
    with_buffer = reader.run(batch, ctx)
    assert torch.equal(with_buffer["response_ids"], first["response_ids"])
    assert int(with_buffer["gen_accepted"].sum()) > int(without["gen_accepted"].sum())
    assert int(with_buffer["gen_steps"].sum()) < int(without["gen_steps"].sum())
    # the worker's own responses and the buffer's are the same: kept once
    assert all(len(reader.history[g]) == 1 for g in batch["prompt_index"].tolist())


def test_prompt_history_reads_the_last_committed_iterations_only(tmp_path):
    from rlhfflow.storage.history import prompt_history

    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, ["ab", "cd"], samples=2)
    path = str(tmp_path / "buffer.zarr")
    for iteration, fill in ((0, 5), (1, 6), (2, 7)):
        out = {"response_ids": torch.full((4, 3), fill),
               "response_mask": torch.tensor([[1, 1, 0]] * 4, dtype=torch.int8)}
        _store_iteration(path, iteration, batch, out)
    found = prompt_history(path, [0, 1, 9], per_prompt=3, last_iterations=2)
    prompt = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()
    assert found[0] == [prompt + [6, 6], prompt + [7, 7], prompt + [7, 7]]
    assert found[9] == [] and prompt_history(tmp_path / "none", [0], 3, 2) == {0: []}


def test_a_draft_model_with_another_tokenizer_is_refused(gen_store):
    tok = build_char_tokenizer()
    batch = make_prompt_batch(tok, TEXTS[:1])
    with pytest.raises(ValueError, match="'other' has another tokenizer than the actor"):
        _run(gen_store, batch, drafter="model", draft_model="other")


def test_the_layers_view_shares_the_actors_weights(gen_store):
    actor = gen_store.get("actor").module
    view = shallow_view(actor, 1)
    assert len(view.model.layers) == 1 and len(actor.model.layers) == 2
    assert view.lm_head.weight is actor.lm_head.weight
    assert view.model.layers[0] is actor.model.layers[0]
    with pytest.raises(ValueError, match="below the actor's 2 layers"):
        shallow_view(actor, 2)


def test_the_cost_model_interpolates_its_measured_points():
    cost = ForwardCost([(1, 1.0), (4, 1.0), (16, 4.0)])
    assert cost(2) == 1.0 and cost(10) == 2.5 and cost(28) == 7.0
    assert ForwardCost.linear(0.5, 0.25)(4) == 1.5


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory) -> Path:
    """A tiny LM whose character tokenizer knows only "abc" (another vocabulary)."""
    path = tmp_path_factory.mktemp("bad") / "other"
    other = build_char_tokenizer("abc")
    save_model(build_tiny_model(other, "lm", seed=2), other, path)
    return path


@pytest.mark.parametrize(("overrides", "key", "message"), [
    ({"stages.generate.params.drafter": "oracle"}, "stages.generate.params.drafter",
     "expected one of"),
    ({"stages.generate.params.drafter": "ngram", "stages.generate.params.draft_k": 0},
     "stages.generate.params.draft_k", "expected an integer >= 1, got 0"),
    ({"stages.generate.params.drafter": "ngram", "stages.generate.params.draft_k": 17},
     "stages.generate.params.draft_k", "16, got 17"),
    ({"stages.generate.params.drafter": "model"}, "stages.generate.params.drafter",
     "needs params.draft_model"),
    ({"stages.generate.params.drafter": "model",
      "stages.generate.params.draft_model": "drafty"},
     "stages.generate.params.draft_model", "unknown model 'drafty'"),
    ({"stages.generate.params.drafter": "model",
      "stages.generate.params.draft_model": "draft"},
     "stages.generate.params.draft_model", "has another vocabulary than 'actor'"),
    ({"stages.generate.params.drafter": "adaptive"},  # the default 4 of the tiny actor's 2
     "stages.generate.params.draft_layers", "4 must be below the model's 2 decoder layers"),
])
def test_bad_drafting_settings_are_one_line_naming_the_key(tmp_path, other_tokenizer_model,
                                                           overrides, key, message):
    path = small_pipeline(tmp_path, "grpo", overrides={
        "models.draft": {"path": str(other_tokenizer_model)}, **overrides})
    with pytest.raises(SpecError) as info:
        load_pipeline(path)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"{path}: {key}: ") and message in line


def test_a_bad_drafter_exits_2_from_the_command_line(tmp_path, other_tokenizer_model):
    path = small_pipeline(tmp_path, "grpo", overrides={
        "models.draft": {"path": str(other_tokenizer_model)},
        "stages.generate.params.drafter": "model",
        "stages.generate.params.draft_model": "draft"})
    done = CliRunner().invoke(main, ["validate", str(path)])
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        "a draft model must share the actor's tokenizer")


def test_a_draft_model_with_the_actors_tokenizer_validates(tmp_path):
    path = small_pipeline(tmp_path, "grpo", overrides={
        "models.draft": {"tiny": {"layers": 1, "hidden": 32, "heads": 2}},
        "stages.generate.params.drafter": "adaptive",
        "stages.generate.params.adaptive_drafters": ["ngram", "model"],
        "stages.generate.params.draft_model": "draft"})
    assert load_pipeline(path).params["generate"].drafter == "adaptive"


def test_adaptive_drops_a_drafter_whose_steps_take_longer_than_predicted():
    from rlhfflow.engine.drafting import Acceptance, AdaptivePolicy, NgramDrafter

    drafters = {"ngram": NgramDrafter([[5, 6, 5, 6]], [0], {}, 2, 1)}
    policy = AdaptivePolicy(ForwardCost.linear(1.0, 0.0), k_max=4, timed=True)
    policy.stats["ngram"] = Acceptance(accepted=5, evaluated=10)
    assert policy.choose(1, drafters)[0] == "ngram"  # a fixed cost per forward: it pays
    for _ in range(10):  # but its steps measure 3 s where 1 s was predicted
        policy.observe_time("ngram", 1, 4, drafters, 3.0)
        policy.observe_time(None, 1, 0, drafters, 1.0)
    assert policy.choose(1, drafters) == (None, 0)


class _CostlyDrafter:
    """A drafter that costs a fifth of a forward per drafted token (as 6 of 30 layers)."""

    def cost(self, rows: int, k: int) -> float:
        return 0.2 * k


def test_adaptive_probes_an_unknown_drafter_on_a_few_cheap_steps_only():
    from rlhfflow.engine.drafting import Acceptance, AdaptivePolicy

    drafters = {"layers": _CostlyDrafter()}
    # a forward costs the same for 1 or 2 tokens (small batch): a k=1 probe costs 1.2x
    policy = AdaptivePolicy(ForwardCost.linear(1.0, 0.0), k_max=4)
    choices = [policy.choose(1, drafters) for _ in range(6)]
    assert choices == [("layers", 1)] * 2 + [(None, 0)] * 4  # the prior alone: no
    # a drafter measured to pay is chosen without probing
    policy = AdaptivePolicy(ForwardCost.linear(1.0, 0.0), k_max=4,
                            stats={"layers": Acceptance(accepted=40, evaluated=50)})
    assert policy.choose(1, drafters)[0] == "layers"
    # every token costs the same (large batch on a CPU): a probe would double a step
    policy = AdaptivePolicy(ForwardCost.linear(0.0, 1.0), k_max=4)
    assert [policy.choose(64, drafters) for _ in range(3)] == [(None, 0)] * 3


def test_the_cost_model_times_the_work_not_its_launch(gen_store, monkeypatch):
    """On a GPU a forward returns once its kernels are queued: each timed forward is
    fenced by waiting for the device, which a CPU does not need."""
    from rlhfflow.engine import drafting

    fences = []
    monkeypatch.setattr(drafting, "wait_for", fences.append)
    module = build_tiny_model(build_char_tokenizer(), "lm", seed=5)
    cost = drafting.measure_cost(module, 4)
    assert [n for n, _ in cost.points] == [1, 2, 4]
    assert fences == [torch.device("cpu")] * (2 * 2 * 3)  # before and after, 2 tries, 3 sizes
    monkeypatch.undo()
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    drafting.wait_for(torch.device("cpu"))
    drafting.wait_for(torch.device("cuda", 0))
    assert synced == [torch.device("cuda", 0)]
