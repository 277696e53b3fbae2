"""The stage graph: order, levels, producers, edges across iterations, and its renderings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.config.graph import SOURCE, CycleError, StageGraph, StageNode
from rlhfflow.config.loader import Pipeline, load_pipeline
from rlhfflow.stages import SOURCE_COLUMNS, Column

ROOT = Path(__file__).resolve().parents[2]
PPO_TINY = ROOT / "configs" / "ppo-tiny.yaml"
GRPO_TINY = ROOT / "configs" / "grpo-tiny.yaml"

PPO_ORDER = ["generate", "reward", "ref_logprob", "old_logprob", "values", "advantages",
             "train_actor", "train_critic"]


@pytest.fixture(scope="module")
def ppo() -> Pipeline:
    return load_pipeline(PPO_TINY)


def node(name: str, after: tuple[str, ...] = (), model: str | None = None,
         reads: tuple[str, ...] = (), writes: tuple[str, ...] = (), trains: bool = False,
         once: bool = False) -> StageNode:
    return StageNode(name=name, type=name, model=model, after=after, reads=reads,
                     writes={c: Column("float32") for c in writes}, trains=trains, once=once)


# --------------------------------------------------------------------------- structure


def test_topological_order(ppo: Pipeline) -> None:
    assert ppo.graph.order == PPO_ORDER
    assert ppo.graph.loop_stages == PPO_ORDER
    assert ppo.graph.setup_stages == []


def test_order_follows_dependencies_then_declaration() -> None:
    """Of the stages whose dependencies are done, the one declared first comes next."""
    graph = StageGraph({n.name: n for n in [
        node("train", after=("score", "gen")), node("score", after=("gen",)),
        node("gen"), node("other")]})
    assert graph.order == ["gen", "score", "train", "other"]
    assert graph.levels() == [["gen", "other"], ["score"], ["train"]]


def test_levels_and_concurrency(ppo: Pipeline) -> None:
    graph = ppo.graph
    assert graph.levels() == [["generate"], ["reward", "ref_logprob", "old_logprob", "values"],
                              ["advantages"], ["train_actor", "train_critic"]]
    assert graph.concurrent("reward", "values")
    assert graph.concurrent("train_actor", "train_critic")
    assert not graph.concurrent("generate", "reward")
    assert not graph.concurrent("reward", "generate")
    assert not graph.concurrent("generate", "train_actor")  # transitively upstream
    assert not graph.concurrent("reward", "reward")


def test_upstream(ppo: Pipeline) -> None:
    assert ppo.graph.upstream("generate") == frozenset()
    assert ppo.graph.upstream("advantages") == {"generate", "reward", "ref_logprob",
                                                "old_logprob", "values"}
    assert ppo.graph.upstream("train_actor") == ppo.graph.upstream("advantages") | {"advantages"}


def test_producers_and_writers(ppo: Pipeline) -> None:
    graph = ppo.graph
    assert graph.producer("prompt_ids", "generate") == SOURCE
    assert graph.producer("response_ids", "reward") == "generate"
    assert graph.producer("values", "advantages") == "values"
    assert graph.producer("scores", "train_critic") == "reward"  # upstream through advantages
    assert graph.producer("scores", "values") is None  # reward is not upstream of values
    assert graph.writers("ref_logprobs") == ["ref_logprob"]
    assert graph.writers("nothing") == []
    columns = graph.columns()
    assert set(SOURCE_COLUMNS) <= set(columns)
    assert {"response_ids", "scores", "values", "old_logprobs", "ref_logprobs", "advantages",
            "returns", "kl"} <= set(columns)


def test_grpo_graph_has_no_critic() -> None:
    graph = load_pipeline(GRPO_TINY).graph
    assert "values" not in graph.columns()
    assert graph.producer("group_ids", "advantages") == SOURCE
    assert graph.levels() == [["generate"], ["reward", "ref_logprob"], ["advantages"],
                              ["train_actor"]]
    # no old_logprob pass: the ratio divides by generate's own log-probs
    assert "old_logprobs" not in graph.columns()
    assert "sample_logprobs" in graph.nodes["train_actor"].reads


def test_auto_old_logprobs_takes_only_the_trained_models_own_samples() -> None:
    """``old_logprobs: auto`` divides by generate's log-probs only when generate samples
    from the model being trained; otherwise it asks for recomputed ones, and the loader
    names the missing column."""
    from rlhfflow.config.spec import SpecError

    with pytest.raises(SpecError, match="reads column 'old_logprobs', which no upstream"):
        load_pipeline(GRPO_TINY, {"stages.generate.model": "ref"})
    explicit = load_pipeline(GRPO_TINY, {"stages.train_actor.params.old_logprobs":
                                         "sample_logprobs"})
    assert explicit.params["train_actor"].old_logprobs == "sample_logprobs"


def test_cycle_error_names_the_cycle() -> None:
    with pytest.raises(CycleError) as err:
        StageGraph({"a": node("a", after=("c",)), "b": node("b", after=("a",)),
                    "c": node("c", after=("b",)), "d": node("d")})
    assert err.value.cycle == ["a", "b", "c", "a"]


def test_setup_stages_run_before_the_loop(tmp_path: Path) -> None:
    spec = yaml.safe_load(PPO_TINY.read_text())
    spec["data"]["prompts"] = str(ROOT / "configs" / "data" / "prompts.jsonl")
    spec["stages"] = {"sft": {"type": "sft", "model": "actor",
                              "params": {"data": str(ROOT / "configs" / "data" / "sft.jsonl")}},
                      **spec["stages"]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    graph = load_pipeline(path).graph
    assert graph.setup_stages == ["sft"]
    assert graph.loop_stages == PPO_ORDER
    assert all("sft" not in level for level in graph.levels())
    assert graph.trainers("actor") == ["sft", "train_actor"]
    assert ("sft", "generate") not in graph.cross_iteration_edges()
    assert not graph.concurrent("sft", "generate")
    assert graph.to_text().splitlines()[:2] == ["setup (once, before iteration 0):",
                                                "  sft (sft @actor) [once]  after: -"]


# --------------------------------------------------------------------------- models


def test_cross_iteration_edges(ppo: Pipeline) -> None:
    assert ppo.graph.cross_iteration_edges() == [
        ("train_actor", "generate"), ("train_actor", "old_logprob"),
        ("train_actor", "train_actor"), ("train_critic", "values"),
        ("train_critic", "train_critic")]
    assert ppo.graph.users("actor") == ["generate", "old_logprob", "train_actor"]
    assert ppo.graph.trainers("ref") == []


def test_no_release_edges_when_every_user_is_upstream(ppo: Pipeline) -> None:
    assert ppo.graph.release_edges() == []


def test_release_edge_for_a_user_beside_the_trainer() -> None:
    """``probe`` reads the actor but ``train`` does not wait for it: ``train`` must not
    update the weights under it, so ``probe`` releases the actor first."""
    graph = StageGraph({n.name: n for n in [
        node("gen", model="actor", writes=("response_ids",)),
        node("probe", after=("gen",), model="actor", reads=("response_ids",),
             writes=("probe_logprobs",)),
        node("adv", after=("gen",), reads=("response_ids",), writes=("advantages",)),
        node("train", after=("adv",), model="actor", reads=("advantages",), trains=True),
    ]})
    assert graph.concurrent("probe", "train")
    assert graph.release_edges() == [("probe", "train")]
    assert graph.cross_iteration_edges() == [("train", "gen"), ("train", "probe"),
                                             ("train", "train")]


# --------------------------------------------------------------------------- renderings


def test_to_text(ppo: Pipeline) -> None:
    lines = ppo.graph.to_text().splitlines()
    for line in [
        "each iteration:",
        "  data  -> group_ids, prompt_fields, prompt_ids, prompt_index, prompt_mask, "
        "prompt_text, sample_index",
        "  level 0:",
        "    generate (generate @actor)",
        "      writes: response_ids, response_mask, sample_logprobs, policy_version, "
        "response_text, gen_steps, gen_drafted, gen_accepted, gen_k_sum, gen_seconds, gen_moved",
        "  level 1 (run concurrently):",
        "    reward (score)",
        "      reads:  prompt_text<-data, response_text<-generate, prompt_fields<-data",
        "  level 2:",
        "      reads:  scores<-reward, score_valid<-reward, response_mask<-generate, "
        "values<-values, old_logprobs<-old_logprob, ref_logprobs<-ref_logprob",
        "      writes: advantages, returns, kl",
        "  level 3 (run concurrently):",
        "across iterations (new weights):",
        "  train_actor[k] -> generate[k+1]  (actor)",
        "  train_critic[k] -> values[k+1]  (critic)",
    ]:
        assert line in lines
    assert not any(line.startswith("setup") for line in lines)


_DOT_NODE = re.compile(r'^\s*"(\w+)" \[(.*)\];$')
_DOT_EDGE = re.compile(r'^\s*"(\w+)" -> "(\w+)" \[(.*)\];$')
_DOT_ATTR = re.compile(r"^\s*(\w+ \[[^\]]*\]|\w+=\w+);$")


def parse_dot(text: str) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """A parser for the DOT subset ``to_dot`` writes: ``(nodes, edges)``; any other
    statement fails the test."""
    lines = text.splitlines()
    assert lines[0] == "digraph pipeline {" and lines[-1] == "}"
    nodes: dict[str, str] = {}
    edges: list[tuple[str, str, str]] = []
    for line in lines[1:-1]:
        if m := _DOT_EDGE.match(line):
            edges.append((m[1], m[2], m[3]))
        elif m := _DOT_NODE.match(line):
            nodes[m[1]] = m[2]
        else:
            assert _DOT_ATTR.match(line), f"not a DOT statement: {line!r}"
    assert {n for e in edges for n in e[:2]} <= set(nodes), "edge to an undeclared node"
    return nodes, edges


def test_to_dot(ppo: Pipeline) -> None:
    nodes, edges = parse_dot(ppo.graph.to_dot())
    assert set(nodes) == {SOURCE, *PPO_ORDER}
    assert nodes[SOURCE] == "shape=cylinder"
    assert nodes["values"] == 'label="values (values @critic)"'
    solid = {(a, b) for a, b, attrs in edges if "dashed" not in attrs}
    dashed = {(a, b) for a, b, attrs in edges if "dashed" in attrs}
    assert {(SOURCE, "generate"), ("generate", "reward"), ("reward", "advantages"),
            ("values", "advantages"), ("old_logprob", "advantages"),
            ("ref_logprob", "advantages"), ("advantages", "train_actor"),
            ("advantages", "train_critic")} <= solid
    assert ("generate", "advantages", 'label="response_mask"') in edges
    assert dashed == set(ppo.graph.cross_iteration_edges())


def test_to_mermaid(ppo: Pipeline) -> None:
    lines = ppo.graph.to_mermaid().splitlines()
    assert lines[0] == "flowchart LR"
    for line in ["  s_data[(data)]", '  s_generate["generate (generate @actor)"]',
                 "  s_data -->|prompts| s_generate", "  s_generate -->|response_text| s_reward",
                 "  s_values -->|values| s_advantages",
                 "  s_advantages -->|returns| s_train_critic",
                 "  s_train_actor -.->|next iteration| s_generate"]:
        assert line in lines


def test_mermaid_ids_survive_reserved_words() -> None:
    # `end` closes a subgraph in Mermaid: a stage may still be called that
    graph = StageGraph({"generate": node("generate"), "end": node("end", after=("generate",))})
    assert "  s_generate --> s_end" in graph.to_mermaid().splitlines()


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("fmt", ["text", "dot", "mermaid"])
def test_graph_command(ppo: Pipeline, fmt: str) -> None:
    args = ["graph", str(PPO_TINY)] + ([] if fmt == "text" else ["--format", fmt])
    result = CliRunner().invoke(main, args)
    expected = {"text": ppo.graph.to_text, "dot": ppo.graph.to_dot,
                "mermaid": ppo.graph.to_mermaid}[fmt]()
    assert (result.exit_code, result.stdout) == (0, expected + "\n")


def test_graph_command_on_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text("stages: {}\n")
    result = CliRunner().invoke(main, ["graph", str(path), "--format", "dot"])
    assert (result.exit_code, result.stderr) == (
        2, f"Error: {path}: stages: expected at least one stage\n")


def test_graph_command_rejects_an_unknown_format() -> None:
    result = CliRunner().invoke(main, ["graph", str(PPO_TINY), "--format", "svg"])
    assert result.exit_code == 2
    assert "'svg' is not one of 'text', 'dot', 'mermaid'" in result.stderr
