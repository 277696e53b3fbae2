"""``rollout``: multi-turn episodes. The model speaks, an environment answers, until the
environment says done, ``max_turns`` model turns, or ``max_tokens`` response tokens.

Each row of the batch is one episode. What answers the model is either an environment
class the pipeline names (``env: "envs.py:Guess"``, resolved against the pipeline file
like reward functions), with the two hooks of :class:`Environment`, or a list of plain
Python functions (``tools: ["tools.py:add"]``) that the model calls by writing::

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

(:class:`ToolEnvironment`; a turn without a tool call ends the episode). That is Hermes'
format; ``tool_format`` names another (Qwen3-Coder's XML, Llama 3's JSON, the tokenizer's
own ``response_template``, or a user's class: ``rlhfflow.engine.toolformats``). Where the
model's chat template shows tools, the prompts show the tools' JSON schemas through its
``tools=`` (``tools_in_prompt``). Each call runs in
a child process that is killed at ``tool_timeout_s`` (``tool_isolation``); the built-in
tool ``rlhfflow.engine.sandbox:python`` runs model-written programs in a sandbox with the
``sandbox`` limits, and ``env: rlhfflow.engine.sandbox:CodeTests`` scores a program by the
record's tests (docs/how-to/sandbox.md).

Columns: ``response_ids`` hold the whole episode after the prompt (the model's tokens and
the environment's); ``response_mask`` is 1 on the model's tokens only, so every loss, KL
term and advantage skips the environment's, while the forward passes of the other
stages attend to every token up to the last masked one
(``rlhfflow.engine.forward.response_attention``); ``sample_logprobs`` are those of the
model's tokens (0 elsewhere); ``env_reward`` is the episode's summed environment reward,
``turns`` its model turns and ``env_seconds`` its time in the environment's ``step``;
``turn_rewards`` holds each ``step``'s reward on the last token of the model turn it
answers (for ``advantages``' ``per_turn``); ``turns_json`` is the episode as a
conversation, one JSON list per row (``Episode.log``); ``info_<key>`` (for each key of
``params.info``) the sum over the episode of the number ``step`` returned under that key
in its ``info``. The run's metrics average them over the iteration's episodes
(``env_reward_mean``, ``turns_mean``, ``info_<key>_mean``).

The episodes decode in one loop (:class:`EpisodeLoop`) with each one's KV cache kept
across its turns (``rlhfflow.engine.turns``): a row whose turn ended leaves the decode
batch with its cache, its environment steps (on a thread with ``env_workers``) while the
others decode, and it rejoins feeding only what followed its cache (``kv_cache: false``:
the whole episode again, the same tokens); ``stream: true`` keeps it across iterations.

Sampling is ``generate``'s, per row: the row's uniforms come from the same generator
(``sampling.sample_uniforms``) and its n-th model token of the episode draws the n-th,
so with one turn the stage gives ``generate``'s tokens. Turns are joined with the
tokenizer's chat template when the prompt was rendered with it (environment messages
take the role ``tool`` if the template renders it, else ``user``), else as plain text
with ``plain_separator`` around them.

With ``env_placement: pool`` each environment step is a task of its own on the run's CPU
pool (``cluster.env_workers``, given to the stage as ``StageContext.env_executor``): the
environment object goes there with the model's turn and comes back with the answer, so it
must pickle (cloudpickle; a class from the pipeline's own file goes by value). A slow tool
then runs in another process, beside the decoding of the other rows.

With ``agent: "agent.py:solve"`` the episodes are played by the user's agent function
instead (``rlhfflow.serve.agents``): ``async def solve(client, record)`` talks to the
policy through an ``openai`` client pointed at an endpoint the task serves on loopback
(a generation service on the stage's model, its requests batched together), and returns
the reward. Every call is recorded; an episode whose calls extend each other at token
level is one sample (the tokens between calls masked out, each completion with the
log-probs it was sampled with); with ``agent_samples: K`` a call that rewrote its
history starts the next of the episode's K samples (K consecutive rows of its prompt),
sharing its reward. ``agent_calls``, ``agent_failed`` and ``agent_untrained_calls``
count what happened (docs/how-to/agents.md). Not done yet:
drafters do not draft for the rollout.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import torch

from rlhfflow.engine.environments import (
    Environment,
    Episode,
    ToolEnvironment,
    TurnFormat,
    check_shippable,
    shows_tools,
    tool_schema_problem,
    tool_schemas,
)
from rlhfflow.engine.episodes import EpisodeLoop, Timeline, add_messages, env_threads, settled
from rlhfflow.engine.generation import eos_ids
from rlhfflow.engine.sampling import row_generators, sample_uniforms
from rlhfflow.engine.sandbox import sandbox_for
from rlhfflow.engine.service import GenerationService, SamplingSettings
from rlhfflow.engine.streaming import (
    Admission,
    EpisodeStream,
    Key,
    finish_columns,
    stream_columns,
    whole_groups,
)
from rlhfflow.engine.toolformats import ToolFormat, tool_format, tool_format_problem
from rlhfflow.engine.usercode import imported, load_function
from rlhfflow.errors import RunError
from rlhfflow.sdk import (
    Batch,
    Column,
    IterationMetric,
    PlanHints,
    Stage,
    StageContext,
    register_stage,
)
from rlhfflow.serve.agents import AgentRunner, agent_episodes, agent_problem
from rlhfflow.stages.rolloutparams import RolloutParams

log = logging.getLogger(__name__)

#: what a rollout with ``stream: true`` writes besides the episode
STREAM_COLUMNS = {
    # per token: the version of the weights that sampled it (-1: not the model's)
    "token_versions": Column("int64", "response"),
    # per token: how many versions older than the task's weights the sampling one was
    "token_lag": Column("float32", "response"),
    "version_spread": Column("int64"),     # newest minus oldest version of its tokens
    "started_ahead": Column("int8"),       # an earlier iteration's task started it
    "decode_occupancy": Column("float32"),  # the task's (each row of it)
    "episodes_in_flight": Column("float32"),  # the task's mean (each row of it)
    "episodes_dropped": Column("int64"),   # the task's, on its first row
}

#: what a rollout with ``stream_order: finish`` writes besides (the source's columns of
#: its rows too, not declared: the data source's, which it returns reordered)
FINISH_COLUMNS = {
    "source_iteration": Column("int64"),   # the iteration whose prompts the row answers
    "deferred": Column("int8"),            # an earlier iteration's (owed to this one)
    "stream_wait_owed_s": Column("float32"),   # the task's, on its first row
    "stream_wait_groups_s": Column("float32"),  # the task's, on its first row
}


@register_stage
class RolloutStage(Stage):
    """Multi-turn episodes of the model with an environment or tools (see the module's
    docstring). Writes the episode after the prompt, a mask of the model's tokens, their
    sampling log-probs, ``env_reward``, ``turns``, ``turn_rewards``, ``turns_json`` and
    ``policy_version``."""

    type_name = "rollout"
    Params = RolloutParams
    model_head = "lm"
    generates = True
    #: the last call's ``Timeline``, for callers in the same process (tests, benchmarks)
    last_timeline: Timeline | None = None

    @classmethod
    def reads(cls, params, algorithm, has_model):
        # finish order returns other iterations' rows: every source column goes with them
        return ("prompt_ids", "prompt_mask", "prompt_index", "sample_index", "prompt_text",
                "prompt_fields",
                *(("group_ids",) if params.stream and params.stream_order == "finish" else ()))

    @classmethod
    def writes(cls, params, algorithm, has_model):
        agents = {"agent_calls": Column("int64"), "agent_failed": Column("int8"),
                  "agent_untrained_calls": Column("int64")} if params.agent else {}
        out = {**agents, "response_ids": Column("int64", "response"),
               "response_mask": Column("int8", "response"),
               "sample_logprobs": Column("float32", "response"),
               "policy_version": Column("int64"),
               "response_text": Column("str"),
               "env_reward": Column("float32"),
               "turns": Column("int64"),
               "env_seconds": Column("float32"),
               "turn_rewards": Column("float32", "response"),
               "turns_json": Column("str"),
               **{f"info_{key}": Column("float32") for key in params.info}}
        if params.scores:
            out.update(scores=Column("float32"), score_valid=Column("int8"))
        if params.stream:
            out.update(STREAM_COLUMNS)
            if params.stream_order == "finish":
                out.update(FINISH_COLUMNS)
        return out

    @classmethod
    def iteration_metrics(cls, params):
        # per episode, averaged over the iteration's rows
        agents = (IterationMetric("agent_calls_mean", "agent_calls"),
                  IterationMetric("agent_failed_frac", "agent_failed"),
                  IterationMetric("agent_untrained_calls", "agent_untrained_calls", "sum",
                                  digits=0)) if params.agent else ()
        streams = (
            IterationMetric("token_lag_mean", "token_lag", "token_mean",
                            over="response_mask"),
            IterationMetric("version_spread_mean", "version_spread"),
            IterationMetric("started_ahead_frac", "started_ahead"),
            IterationMetric("decode_occupancy", "decode_occupancy"),
            IterationMetric("episodes_in_flight", "episodes_in_flight"),
            IterationMetric("episodes_dropped", "episodes_dropped", "sum", digits=0),
        ) if params.stream else ()
        if params.stream and params.stream_order == "finish":
            streams += (IterationMetric("deferred_frac", "deferred"),
                        IterationMetric("stream_wait_owed_s", "stream_wait_owed_s", "sum"),
                        IterationMetric("stream_wait_groups_s", "stream_wait_groups_s",
                                        "sum"))
        return (*agents, *streams, IterationMetric("env_reward_mean", "env_reward"),
                IterationMetric("turns_mean", "turns"),
                *(IterationMetric(f"info_{key}_mean", f"info_{key}") for key in params.info))

    @classmethod
    def plan_hints(cls, params) -> PlanHints:
        return replace(super().plan_hints(params), response_tokens=params.max_tokens,
                       turns=params.max_turns, env_on_pool=params.env_placement == "pool",
                       streams=params.stream,
                       reorders=params.stream and params.stream_order == "finish")

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        if params.stream and params.agent is not None:
            return ("params.stream", "agents do not stream yet: give params.stream or "
                                     "params.agent, not both")
        for key in ("stream_in_flight", "stream_on_update", "stream_order"):
            if key in params.model_fields_set and not params.stream:
                return (f"params.{key}", "goes with params.stream: true")
        if params.agent_samples > 1 and (params.agent is None or not params.scores):
            return ("params.agent_samples", "goes with params.agent and params.scores: true "
                    "(the episode's reward marks which of its samples hold calls)")
        if params.agent is not None:
            if params.env is not None or params.tools:
                return ("params.agent", "give params.agent alone: an agent brings its own "
                        "tools and environment (not params.env or params.tools)")
            problem = agent_problem(params.agent, base_dir)
            if problem:
                return ("params.agent", problem)
        if params.env is not None and params.tools:
            return ("params.tools", "give either params.env or params.tools, not both")
        if params.env is not None:
            problem, env = imported(params.env, base_dir)
            if problem:
                return ("params.env", problem)
            if not isinstance(env, type) or not all(
                    callable(getattr(env, hook, None)) for hook in ("reset", "step")):
                return ("params.env", f"{params.env!r} is not a class with reset(record) "
                                      "and step(text) methods")
            # a class may check its own env_kwargs (rlhfflow.engine.envpackages: the
            # package installed, an environment id it knows): (key under params, message)
            check = getattr(env, "check_env_kwargs", None)
            found = check(params.env_kwargs) if callable(check) else None
            if found:
                return (f"params.{found[0]}", found[1])
        for i, ref in enumerate(params.tools):
            problem, _ = imported(ref, base_dir)
            if problem:
                return (f"params.tools[{i}]", problem)
        problem = tool_format_problem(params.tool_format, base_dir)
        if problem:
            return ("params.tool_format", problem)
        for i, key in enumerate(params.info):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                return (f"params.info[{i}]", f"expected a name of letters, digits and _ "
                                             f"(it names the column info_<key>), got {key!r}")
        if params.env_kwargs and params.env is None:
            return ("params.env_kwargs", "env_kwargs go with params.env")
        return None

    @classmethod
    def check_tokenizer(cls, params, tokenizer, base_dir):
        if params.tools and params.tools_in_prompt is True and not shows_tools(tokenizer):
            return ("params.tools_in_prompt", "true, but the model's chat template shows "
                    "no tools (its rendering does not change with tools=); set it to auto "
                    "or false and describe the tools in the prompts")
        if not params.tools or not getattr(tokenizer, "chat_template", None):
            return None
        fmt = TurnFormat(tokenizer, params.plain_separator)
        if fmt.role != "tool":
            return ("params.tools", "the model's chat template renders no 'tool' role, "
                    "which the tools' results take; use a model whose template has one, "
                    "or an environment (params.env), whose messages may be 'user' turns")
        if params.tools_in_prompt is False:
            return None
        return tool_schema_problem(params.tools, tokenizer, base_dir)

    @classmethod
    def prompt_tools(cls, params, tokenizer, base_dir):
        if not params.tools or params.tools_in_prompt is False or \
                (params.tools_in_prompt == "auto" and not shows_tools(tokenizer)):
            return None
        return tool_schemas(params.tools, base_dir)

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        if self.params.agent is not None:
            return self.run_agents(batch, ctx)
        if self.params.stream:
            return self.run_stream(batch, ctx)
        resident = ctx.models.get(self.model)
        tok, params = resident.tokenizer, self.params
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        fmt = TurnFormat(tok, params.plain_separator)
        calls = tool_format(params.tool_format, tok, ctx.settings.base_dir)
        made = self.admissions(batch, ctx.iteration, ctx, fmt, calls)
        episodes = [a.episode for a in made]
        templated = [a.templated for a in made]
        prompts = [a.prompt for a in made]
        uniforms = torch.stack([a.uniforms for a in made]) if made else \
            torch.empty(0, params.max_tokens, dtype=torch.float64)
        stops = self.stops(calls)
        loop = EpisodeLoop(params, resident.module, tok, fmt, templated, prompts, uniforms,
                           pad_id, stops)
        shipped = ctx.env_executor if params.env_placement == "pool" else None
        if shipped is not None:
            check_shippable(episodes, self.shipping_key())
            with resident.generating():
                loop.run(episodes, shipped, ships=True)
        else:
            with env_threads(params.env_workers) as pool, resident.generating():
                loop.run(episodes, pool)
        self.timed(loop.timeline, ctx, shipped is not None)
        return self.columns(episodes, tok, pad_id, resident.version)

    def timed(self, timeline: Timeline, ctx: StageContext, shipped: bool) -> None:
        """Keep the call's ``timeline`` and record its environment steps for the task
        timeline ("env-pool": steps that took none of this task's time)."""
        self.last_timeline = timeline
        if ctx.spans is not None:
            for start, stop in timeline.env_busy():
                ctx.spans("env-pool" if shipped else "env", start, stop)

    def admissions(self, batch: Batch, iteration: int, ctx: StageContext, fmt: TurnFormat,
                   calls: ToolFormat, skip=lambda key: False) -> list[Admission]:
        """The episodes of ``batch``'s rows (of ``iteration``): each environment made
        and reset with its record, its opening added; the rows whose key ``skip`` names
        left out."""
        params = self.params
        rows = len(batch["prompt_index"])
        texts = batch.get("prompt_text") or [""] * rows
        fields = batch.get("prompt_fields") or ["{}"] * rows
        keys = row_keys(batch, iteration)
        wanted = [row for row in range(rows) if not skip(keys[row])]
        if not wanted:
            return []
        uniforms = sample_uniforms(ctx.seed, iteration, batch["prompt_index"][wanted],
                                   batch["sample_index"][wanted], params.max_tokens)
        real = batch["prompt_mask"].bool()
        groups = batch["group_ids"].tolist() if "group_ids" in batch else [-1] * rows
        out = []
        for i, row in enumerate(wanted):
            templated = fmt.templated(texts[row])
            episode = Episode(self.make_env(ctx, calls))
            opening = episode.opened(settled(episode.env.reset(
                {**json.loads(fields[row]), "prompt": texts[row]})))
            if opening:
                add_messages(params, episode, opening, fmt, templated, None)
            source = {"prompt_text": texts[row], "prompt_fields": fields[row],
                      "group_ids": groups[row], "source_iteration": iteration}
            out.append(Admission(keys[row], episode,
                                 batch["prompt_ids"][row][real[row]].tolist(), templated,
                                 uniforms[i], groups[row], source))
        return out

    def stops(self, calls: ToolFormat) -> list[str]:
        """The strings that end a model turn: ``params.stop``, and a tool call's end."""
        return [*self.params.stop, *([calls.stop] if self.params.tools and calls.stop
                                     else [])]

    def run_stream(self, batch: Batch, ctx: StageContext) -> Batch:
        """This task's episodes played by the worker's episode stream
        (``rlhfflow.engine.streaming``), which keeps the next iterations' going in the
        meantime (``ctx.ahead``) and what is unfinished for the tasks that own it."""
        resident = ctx.models.get(self.model)
        tok, params = resident.tokenizer, self.params
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        fmt = TurnFormat(tok, params.plain_separator)
        calls = tool_format(params.tool_format, tok, ctx.settings.base_dir)
        rows = len(batch["prompt_index"])
        finish = params.stream_order == "finish"
        if finish:
            if ctx.staleness < 1:
                raise ValueError(f"stage {self.name!r}: stream_order: finish needs the run's "
                                 f"staleness bound (StageContext.staleness, 1 or more)")
            whole_groups(batch, self.name)
        stream = self.stream_for(resident, tok, fmt, pad_id, calls, rows)
        if finish:
            stream.recall_taken(ctx.iteration, ctx.staleness, ctx.taken)
        # finish order: episodes owed from earlier iterations first (after a resume or a
        # recovery: they start again), then this iteration's, then the later ones, each
        # started as room frees; iteration order starts its own at once
        arrivals = []
        for j, earlier in ctx.behind if finish else ():
            arrivals += self.admissions(earlier, j, ctx, fmt, calls, stream.knows)
        own = [] if finish else row_keys(batch, ctx.iteration)
        arrivals += self.admissions(batch, ctx.iteration, ctx, fmt, calls, stream.knows)
        for j, later in ctx.ahead:
            arrivals += self.admissions(later, j, ctx, fmt, calls, stream.knows)
        shipped = ctx.env_executor if params.env_placement == "pool" else None
        if shipped is not None:
            check_shippable([a.episode for a in arrivals], self.shipping_key())
        with resident.generating():
            mine = stream.begin_task(ctx.iteration, resident.version, own, arrivals,
                                     shipped or stream.threads(params.env_workers),
                                     ships=shipped is not None,
                                     behind=ctx.staleness if finish else 0)
            if finish:
                mine = stream.play_finished(rows, ctx.staleness, ctx.iteration)
            else:
                stream.play(mine)
        sources = [stream.source[row] | {"prompt": stream.prompts[row],
                                         "key": stream.keys[row]} for row in mine]
        episodes, early = stream.take(mine, ctx.iteration if finish else None)
        self.timed(stream.timeline, ctx, shipped is not None)
        out = self.columns(episodes, tok, pad_id, resident.version)
        stats = stream.harvest()
        out.update(stream_columns(episodes, early, stats, resident.version,
                                  params.max_tokens))
        if finish:
            out.update(finish_columns(sources, ctx.iteration, stats, pad_id))
        if ctx.between_tasks:  # the episodes in flight play on until the next task
            stream.between(lambda: resident.version, resident.generating)
        return out

    def stream_for(self, resident, tok, fmt: TurnFormat, pad_id: int, calls: ToolFormat,
                   rows: int) -> EpisodeStream:
        """The worker's episode stream for this stage, made at its first task (again
        if the model was replaced, dropping what the old one held). In finish order it
        holds at least a task's rows and by default twice them (``EpisodeStream.room``
        bounds it by what the tasks until an episode is owed can take)."""
        stream = getattr(self, "_stream", None)
        if stream is not None and stream.module is not resident.module:
            log.warning("stage %r: the model was replaced; %d episodes in flight are "
                        "dropped and start again", self.name, stream.close())
            stream = None
        if stream is None:
            finish = self.params.stream_order == "finish"
            target = self.params.stream_in_flight or (2 * rows if finish else rows)
            if finish:
                target = max(rows, target)
            stream = EpisodeStream(self.params, resident.module, tok, fmt, pad_id, target,
                                   self.stops(calls),
                                   recompute=self.params.stream_on_update == "recompute",
                                   held=finish)
            self._stream = stream
        return stream

    def run_agents(self, batch: Batch, ctx: StageContext) -> Batch:
        """Each row's episode played by the agent function (``params.agent``) through a
        generation service and an endpoint on this worker (``rlhfflow.serve.agents``)."""
        resident = ctx.models.get(self.model)
        tok, params = resident.tokenizer, self.params
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        rows = len(batch["prompt_index"])
        # an episode owns agent_samples consecutive rows of its prompt, and plays with
        # its first row's record, prompt and random stream (a rollout's with an env)
        firsts = episode_rows(batch, params.agent_samples, self.name)
        texts = batch.get("prompt_text") or [""] * rows
        fields = batch.get("prompt_fields") or ["{}"] * rows
        records = [{**json.loads(fields[row]), "prompt": texts[row]} for row in firsts]
        real = batch["prompt_mask"].bool()
        prompts = [batch["prompt_ids"][row][real[row]].tolist() for row in firsts]
        generators = row_generators(ctx.seed, ctx.iteration, batch["prompt_index"][firsts],
                                    batch["sample_index"][firsts])
        sampling = SamplingSettings(
            max_new_tokens=params.max_new_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, greedy=params.greedy, stop=tuple(params.stop))
        fn = load_function(params.agent, ctx.settings.base_dir)
        calls = tool_format(params.tool_format, tok, ctx.settings.base_dir)
        with resident.generating(), GenerationService(
                resident.module, eos=eos_ids(resident.module, tok), pad_id=pad_id,
                tokenizer=tok, max_in_flight=params.agent_concurrency, seed=ctx.seed,
                version=resident.version, thread=False) as service:
            runner = AgentRunner(service, tok, calls, sampling, params.agent_concurrency,
                                 params.agent_timeout_s, ctx.env_executor
                                 if params.env_placement == "pool" else None)
            outcomes = runner.run(fn, records, generators)
        k = params.agent_samples
        episodes, untrained, made, failed = [], [], [], []
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            samples, left = agent_episodes(prompt, outcome, tok, params.max_tokens,
                                           params.info, k)
            episodes += samples
            untrained += [left] + [0] * (k - 1)  # the sums count each call once
            made += [len(outcome.calls)] * k     # the means: per episode
            failed += [outcome.error is not None] * k
        bad = [o for o in outcomes if o.error is not None]
        if bad:
            kinds = sorted({o.error for o in bad})
            log.warning("stage %r: %d of %d agents failed (%s); the first: %s: %s",
                        self.name, len(bad), len(outcomes), ", ".join(kinds), bad[0].error,
                        bad[0].message)
        out = self.columns(episodes, tok, pad_id, resident.version)
        out["agent_calls"] = torch.tensor(made, dtype=torch.long)
        out["agent_failed"] = torch.tensor(failed, dtype=torch.int8)
        out["agent_untrained_calls"] = torch.tensor(untrained, dtype=torch.long)
        if k > 1 and "score_valid" in out:  # an episode's empty samples are skipped
            out["score_valid"] = torch.tensor(
                [row % k == 0 or e.turns > 0 for row, e in enumerate(episodes)],
                dtype=torch.int8)
        return out

    def make_env(self, ctx: StageContext, calls: ToolFormat | None = None) -> Environment:
        """A new environment for one episode (its tool calls parsed by ``calls``)."""
        params = self.params
        if params.env is not None:
            return load_function(params.env, ctx.settings.base_dir)(**params.env_kwargs)
        tools = {ref.rpartition(":")[2]: load_function(ref, ctx.settings.base_dir)
                 for ref in params.tools}
        settings = params.sandbox.settings()
        if any(getattr(tool, "sandboxed", False) for tool in tools.values()):
            # the backend's line on what it protects, and the warm sandboxes, at the start
            sandbox_for(settings).prepare()
        return ToolEnvironment(tools, params.tool_timeout_s, params.tool_isolation, settings,
                               calls)

    def shipping_key(self) -> str:
        """What a pool-shipping error names: the stage and its environment's key."""
        return f"stage {self.name!r}, {'params.env' if self.params.env else 'params.tools'}"

    def columns(self, episodes: list[Episode], tok, pad_id: int, version: int) -> Batch:
        """The stage's columns from the finished episodes."""
        rows, width = len(episodes), self.params.max_tokens
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.int8)
        logprobs = torch.zeros(rows, width)
        turn_rewards = torch.zeros(rows, width)
        for row, episode in enumerate(episodes):
            length = len(episode.tokens)
            ids[row, :length] = torch.tensor(episode.tokens, dtype=torch.long)
            mask[row, :length] = torch.tensor(episode.mask, dtype=torch.int8)
            logprobs[row, :length] = torch.tensor(episode.logprobs)
            for i, turn in enumerate(episode.log):
                start, end = turn["span"]
                if turn["role"] == "assistant":
                    text = tok.decode(episode.tokens[start:end], skip_special_tokens=True)
                    episode.log[i] = {"role": "assistant", "text": text, **turn}
                    if end > start:
                        turn_rewards[row, end - 1] += turn["reward"]
        out = {"turns_json": [json.dumps(e.log, ensure_ascii=False) for e in episodes],
               "turn_rewards": turn_rewards,
               "response_ids": ids, "response_mask": mask, "sample_logprobs": logprobs,
               "response_text": tok.batch_decode([e.tokens for e in episodes],
                                                 skip_special_tokens=True),
               "env_reward": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
               "turns": torch.tensor([e.turns for e in episodes], dtype=torch.long),
               "env_seconds": torch.tensor([e.env_seconds for e in episodes],
                                           dtype=torch.float32),
               "policy_version": torch.full((rows,), version, dtype=torch.long),
               **{f"info_{key}": torch.tensor([e.info.get(key, 0.0) for e in episodes],
                                              dtype=torch.float32)
                  for key in self.params.info}}
        if self.params.scores:
            out["scores"] = out["env_reward"].clone()
            out["score_valid"] = torch.ones(rows, dtype=torch.int8)
        return out


def row_keys(batch: Batch, iteration: int) -> list[Key]:
    """Each row's episode's identity across tasks: ``(iteration, prompt_index,
    sample_index)``."""
    return [(iteration, int(p), int(q)) for p, q in zip(
        batch["prompt_index"].tolist(), batch["sample_index"].tolist(), strict=True)]


def episode_rows(batch: Batch, samples: int, stage: str) -> list[int]:
    """The first row of each agent episode of ``batch``: every row with ``samples`` 1,
    else the start of each run of ``samples`` consecutive samples of one prompt (sample
    indexes ``j*samples .. j*samples + samples - 1``), which must all be in the batch."""
    rows = len(batch["prompt_index"])
    if samples == 1:
        return list(range(rows))
    prompt, sample = batch["prompt_index"].tolist(), batch["sample_index"].tolist()
    for start in range(0, rows, samples):
        run = range(start, start + samples)
        if run.stop > rows or sample[start] % samples or any(
                prompt[r] != prompt[start] or sample[r] != sample[start] + r - start
                for r in run):
            raise RunError(f"stage {stage!r}: params.agent_samples: {samples}: the rows of "
                           f"an agent's episode (prompt {prompt[start]}, from sample "
                           f"{sample[start]}) are not all in this task; make the rows of "
                           f"its micro-batches a multiple of {samples}")
    return list(range(0, rows, samples))
