"""Episodes per second of an agent through the endpoint against the in-process rollout,
on the same episodes.

The calculator task on SmolLM2-135M-Instruct (``examples/multiturn/data``): 3-digit by
2-digit products, a calculator tool, up to two model turns. Two ways to play the same
episodes, each a ``rollout`` stage run in this process on the same batch:

* ``rollout``: ``examples/multiturn/calculator.yaml``'s stage, its tool played by the
  stage itself (the episode loop, every row in one decode batch, no HTTP);
* ``agent``: the same stage with ``agent: benchmarks/agents.py:mirror``: the same
  episodes played by an agent through the ``openai`` client, ``--concurrency`` agents at
  once calling the task's loopback endpoint, whose generation service decodes their
  requests together. ``mirror`` plays the rollout's rules (two model turns at most, a
  turn ends at ``</tool_call>``, the tool environment's answers, errors included), so
  with the same random streams the episodes are the same tokens (the table says which
  share is); the example's own agent (``examples/agents/calculator_agent.py``) stops at a
  broken call, so its episodes are shorter than the rollout's and would flatter it. Rounds alternate the two; the figure is the median over rounds of
the per-round ratio of episodes per second (agent / rollout). The model is loaded once.
Both run on a thread of their own, as a run's tasks run on a worker's task thread.

    python benchmarks/agents.py [--episodes 32] [--concurrency 16] [--rounds 3]

Prints a table, then one JSON object with the figures as its last line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from pathlib import Path

import torch
from shared import emit_result

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "multiturn" / "calculator.yaml"


async def mirror(client, record):
    """The rollout's tool episode as an agent (see the module's docstring)."""
    from rlhfflow.engine.environments import ToolEnvironment
    from rlhfflow.engine.usercode import load_function

    calculate = load_function(str(CONFIG.parent / "tools.py") + ":calculate", None)
    env = ToolEnvironment({"calculate": calculate}, 10.0)
    messages = list(record["messages"])
    for turn in range(2):
        answer = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=36, stop=["</tool_call>"])
        text = answer.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        said, _, done, _ = env.step(text)
        if done or turn == 1:
            break
        messages += [{"role": "tool", "content": m["content"]} for m in said]
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32, help="episodes per run "
                                                                  "(8 prompts x 4 samples)")
    parser.add_argument("--concurrency", type=int, default=16, help="agents at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.data.source import PromptSource
    from rlhfflow.engine.resident import ModelStore
    from rlhfflow.runtime.models import model_configs
    from rlhfflow.sdk import RunSettings, StageContext, create_stage

    overrides = {"data.batch_size": args.episodes // 4, "data.samples_per_prompt": 4,
                 "data.shuffle": False}
    agent = {"stages.rollout.params.agent": f"{Path(__file__).resolve()}:mirror",
             "stages.rollout.params.tools": [],
             "stages.rollout.params.agent_concurrency": args.concurrency}
    pipelines = {"rollout": load_pipeline(CONFIG, overrides),
                 "agent": load_pipeline(CONFIG, {**overrides, **agent})}
    work = Path(tempfile.mkdtemp())
    rollout_pipeline = pipelines["rollout"]
    store = ModelStore(model_configs(rollout_pipeline, work), device="cpu")
    batch = PromptSource.from_pipeline(rollout_pipeline, "actor").batch(0)

    # a run's tasks run on a worker's task thread, not a process's main thread (where
    # small torch products are up to 2x faster here: OpenMP's team of the main thread):
    # both ways run on such a thread, as in a run
    task_thread = concurrent.futures.ThreadPoolExecutor(1, "task")

    def play(name: str) -> tuple[float, dict]:
        return task_thread.submit(play_here, name).result()

    def play_here(name: str) -> tuple[float, dict]:
        pipeline = pipelines[name]
        stage = create_stage("rollout", "rollout", pipeline.params["rollout"],
                             pipeline.spec.algorithm, "actor")
        ctx = StageContext(iteration=0, seed=pipeline.spec.seed, models=store,
                           algorithm=pipeline.spec.algorithm,
                           settings=RunSettings(temperature=0.7,
                                                base_dir=str(pipeline.base_dir),
                                                device="cpu"))
        started = time.perf_counter()
        out = stage.run(dict(batch), ctx)
        return time.perf_counter() - started, out

    play("rollout")  # warm: the model's first forwards, the tool process, the imports
    print(f"{'round':>5} {'rollout s':>10} {'agent s':>9} {'rollout ep/s':>13} "
          f"{'agent ep/s':>11} {'ratio':>6} {'same episodes':>14} {'agent calls':>12}")
    ratios, rows = [], []
    for round_ in range(args.rounds):
        order = ["rollout", "agent"] if round_ % 2 == 0 else ["agent", "rollout"]
        took = {}
        outs = {}
        for name in order:
            took[name], outs[name] = play(name)
        ratio = took["rollout"] / took["agent"]
        ratios.append(ratio)
        first = _same_episodes(outs["rollout"], outs["agent"])
        calls = float(outs["agent"]["agent_calls"].float().mean())
        rows.append({"rollout_s": round(took["rollout"], 3), "agent_s": round(took["agent"], 3),
                     "ratio": round(ratio, 3), "same_episodes": first,
                     "agent_calls_mean": calls,
                     "agent_failed": int(outs["agent"]["agent_failed"].sum()),
                     "agent_untrained_calls": int(outs["agent"]["agent_untrained_calls"].sum())})
        print(f"{round_:>5} {took['rollout']:>10.2f} {took['agent']:>9.2f} "
              f"{args.episodes / took['rollout']:>13.2f} {args.episodes / took['agent']:>11.2f} "
              f"{ratio:>6.3f} {first:>14.2f} {calls:>12.2f}")
    median = statistics.median(ratios)
    print(f"median ratio (agent episodes/s over rollout's): {median:.3f}")
    emit_result({"episodes": args.episodes, "concurrency": args.concurrency,
                 "rounds": rows, "median_ratio": round(median, 3)}, __file__)


def _same_episodes(a: dict, b: dict) -> float:
    """The share of rows whose episode is the same tokens, with the same mask, in both."""
    rows = a["response_ids"].shape[0]
    return sum(bool(torch.equal(a["response_ids"][r], b["response_ids"][r]) and
                    torch.equal(a["response_mask"][r], b["response_mask"][r]))
               for r in range(rows)) / rows


if __name__ == "__main__":
    main()
