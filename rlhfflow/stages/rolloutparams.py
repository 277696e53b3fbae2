"""The ``rollout`` stage's parameters (``RolloutParams``): episodes, sampling, the
environment or tools or agent, where steps run, and streaming. The stage itself is
:mod:`rlhfflow.stages.rollout`; docs/reference/stages.md lists these keys."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from rlhfflow.engine.sandbox import SandboxParams
from rlhfflow.sdk import StageParams


class RolloutParams(StageParams):
    """Episode and sampling settings (docs/reference/stages.md, ``rollout``)."""

    max_turns: Annotated[int, Field(gt=0, description="model turns per episode at most")] = 4
    max_tokens: Annotated[int, Field(
        gt=0, description="response tokens per episode at most, the model's and the "
                          "environment's (and the buffer's response width)")] = 128
    max_new_tokens: Annotated[int, Field(
        gt=0, description="tokens of one model turn at most")] = 32
    temperature: Annotated[float, Field(
        gt=0, description="sampling temperature (also used by logprob and train_actor)")] = 1.0
    top_k: Annotated[int, Field(ge=0, description="keep the k most likely tokens; 0: off")] = 0
    top_p: Annotated[float, Field(gt=0, le=1, description="nucleus sampling; 1.0: off")] = 1.0
    greedy: bool = Field(False, description="argmax instead of sampling")
    stop: list[str] = Field([], description="end a model turn right after the first of "
                                            "these strings (with tools, the end of a "
                                            "call in tool_format too, e.g. </tool_call>)")
    env: str | None = Field(None, description="the environment class, 'file.py:Class' "
                                              "(relative to the pipeline file) or "
                                              "'package.module:Class'")
    env_kwargs: dict[str, Any] = Field({}, description="keyword arguments of the "
                                                       "environment class")
    tools: list[str] = Field([], description="tool functions the model calls (written "
                                             "as tool_format says), 'file.py:function' "
                                             "each")
    tool_format: str = Field(
        "auto", description="how the model writes tool calls: 'hermes' (<tool_call>"
                            "{\"name\": ..., \"arguments\": {...}}</tool_call>), "
                            "'qwen3_coder' (<tool_call><function=NAME><parameter=KEY>"
                            "VALUE</parameter></function></tool_call>), 'llama3_json' "
                            "({\"name\": ..., \"parameters\": {...}} as the whole turn), "
                            "an import path 'file.py:Class' of a ToolFormat subclass, or "
                            "'auto': the tokenizer's own response_template "
                            "(transformers' parse_response) if it has one, else hermes")
    tools_in_prompt: Literal["auto", True, False] = Field(
        "auto", description="render the tools' JSON schemas (from their type hints and "
                            "docstrings) into the prompts through the chat template's "
                            "tools=: 'auto', when the template shows tools; true, always "
                            "(validation fails when it shows none); false, never (the "
                            "prompts describe the tools themselves)")
    tool_timeout_s: Annotated[float, Field(
        gt=0, description="seconds a tool call may take; slower: an error message")] = 10.0
    tool_isolation: Literal["process", "thread"] = Field(
        "process", description="where a tool call runs: 'process', in a child process "
                               "(reused) that is killed at tool_timeout_s with all it "
                               "started; 'thread', on a thread of the stage's process, "
                               "which cannot be stopped (a call past the timeout is left "
                               "running), for tools that must share the process's state")
    sandbox: SandboxParams = Field(
        SandboxParams(), description="limits of the python tool "
                                     "(rlhfflow.engine.sandbox:python): cpu_s, wall_s, "
                                     "memory_mb, file_mb, processes, output_kb, backend, "
                                     "warm (docs/how-to/sandbox.md)")
    info: list[str] = Field([], description="keys of the info dict step returns: each "
                            "key's numbers are summed over the episode into the column "
                            "info_<key> (a step without the key adds 0), averaged in "
                            "the run's metrics as info_<key>_mean")
    scores: bool = Field(False, description="also write env_reward as the scores (all "
                                            "valid) the advantages read, for a pipeline "
                                            "without a score stage")
    kv_cache: bool = Field(True, description="keep each episode's KV cache across turns "
                                             "(a turn feeds only the new tokens); off: "
                                             "every turn prefills the whole episode again")
    env_workers: Annotated[int, Field(
        ge=0, description="threads that run environment steps while the model decodes "
                          "the other rows (for environments that wait on I/O or a "
                          "subprocess); then which rows share a forward depends on how "
                          "long steps take, so runs and resumes agree only to float "
                          "rounding. 0 (the default): steps run in turn with decoding, "
                          "and a run is reproduced bit for bit")] = 0
    env_placement: Literal["task", "pool"] = Field(
        "task", description="where environment steps run: 'task', in the stage's own task "
                            "(inline, or on its env_workers threads); 'pool', each step a "
                            "task of its own on the CPU pool of cluster.env_workers (the "
                            "environment object is pickled there and back with every "
                            "step), so a slow tool holds no model worker; which rows share "
                            "a forward then depends on how long steps take, as with "
                            "env_workers; with agent, each episode's agent runs there. A "
                            "run without a pool (in process, `stage test`) steps in the task")
    plain_separator: str = Field("\n", description="around environment messages when the "
                                                   "prompt was not rendered with a chat "
                                                   "template")
    agent: str | None = Field(
        None, description="an agent function, 'file.py:solve': 'async def solve(client, "
                          "record)' (or a plain def) that talks to the policy through the "
                          "OpenAI client it is given and returns the reward (or {reward, "
                          "info}); instead of env and tools (docs/how-to/agents.md)")
    agent_timeout_s: Annotated[float, Field(
        gt=0, description="seconds an agent's episode may take; longer: it fails, "
                          "counted in agent_failed")] = 120.0
    agent_concurrency: Annotated[int, Field(
        gt=0, description="agents running at once (and requests decoded together)")] = 16
    agent_samples: Annotated[int, Field(
        ge=1, description="samples an agent's episode may make: its calls are one sample "
                          "while each extends the one before at token level; with 2 or "
                          "more, a call that does not (a template that rewrites history) "
                          "starts the next sample, sharing the episode's reward. Each "
                          "episode then owns this many consecutive samples of its prompt "
                          "(data.samples_per_prompt a multiple of it; needs scores: true): "
                          "those it leaves empty are skipped (score_valid 0); calls past "
                          "the last are counted in agent_untrained_calls")] = 1
    env_step_s: Annotated[float | None, Field(
        gt=0, description="the mean seconds one environment step (or tool call) takes, "
                          "for the planner only (nothing measures or enforces it): "
                          "`rlhfflow plan` and placement auto then charge a task the "
                          "environment time of its episodes where no profile measured "
                          "it (docs/concepts/planner.md); null: none charged")] = None
    stream: bool = Field(
        False, description="keep episodes in flight across iterations (docs/how-to/"
                           "streaming.md): the worker's episode loop lives from task to "
                           "task and starts the next iterations' episodes (up to "
                           "overlap.max_staleness ahead, which must be 1 or more) in the "
                           "tail of this one's; an episode goes on across weight updates, "
                           "each token recording the version that sampled it "
                           "(token_versions)")
    stream_on_update: Literal["recompute", "keep"] = Field(
        "recompute", description="with stream, what the episodes in flight do at new "
                                 "weights: 'recompute' their KV caches under them (each "
                                 "later token is exactly the new policy's; costs a prefill "
                                 "of what is in flight), or 'keep' the old weights' caches "
                                 "(cheaper; the tokens' log-probs are still those they "
                                 "were sampled with)")
    stream_order: Literal["finish", "iteration"] = Field(
        "finish", description="with stream, which episodes a task returns: 'finish', as "
                              "many as its rows, in whole groups (a prompt's samples): "
                              "every group with an episode started overlap.max_staleness "
                              "versions back (the bound: trained later it would be further "
                              "behind), then the groups that finished first, whichever "
                              "iteration's prompts they answer (the rows carry their own "
                              "prompts; source_iteration says whose); 'iteration', its "
                              "own iteration's episodes (it waits for the slowest)")
    stream_in_flight: Annotated[int | None, Field(
        gt=0, description="with stream: the episodes kept in flight per task while later "
                          "iterations' wait to start (more: a larger decode batch and more "
                          "tokens from older policies); in finish order the finished ones "
                          "no task took yet count too, and at most (max_staleness + 1) "
                          "times the task's rows are held; null: the task's rows "
                          "(iteration order), twice the task's rows (finish order)")] = None
