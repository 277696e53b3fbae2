"""``rollout``: multi-turn episodes. The model speaks, an environment answers, until the
environment says done, ``max_turns`` model turns, or ``max_tokens`` response tokens.

Each row of the batch is one episode. What answers the model is either an environment
class the pipeline names (``env: "envs.py:Guess"``, resolved against the pipeline file
like reward functions), with the two hooks of :class:`Environment`, or a list of plain
Python functions (``tools: ["tools.py:add"]``) that the model calls by writing::

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

(:class:`ToolEnvironment`; a turn without a tool call ends the episode).

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
the whole episode again, the same tokens).

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

Not done yet: drafters do not draft for the rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import torch
from pydantic import Field

from rlhfflow import ops
from rlhfflow.data.records import pad_prompts
from rlhfflow.engine.sampling import sample_step, sample_uniforms
from rlhfflow.errors import RlhfflowError, UserError
from rlhfflow.stages.base import Batch, Column, Stage, StageContext, StageParams, register_stage
from rlhfflow.stages.generate import eos_ids
from rlhfflow.stages.inference import USER_MODULE_PREFIX, load_function

Message = dict[str, str]
log = logging.getLogger(__name__)


class Environment(Protocol):
    """What an environment class provides. One instance plays one episode (the stage
    creates it with ``params.env_kwargs``)."""

    def reset(self, record: dict[str, Any]) -> list[Message] | str:
        """Start an episode for a prompt record (its fields, and ``prompt``: the prompt's
        text as the model sees it). Returns messages shown after the prompt, before the
        model's first turn; usually none (``[]`` or ``""``)."""

    def step(self, text: str) -> tuple[list[Message] | str, float, bool, dict]:
        """Answer the model's turn ``text``: ``(messages, reward, done, info)``. The
        messages (a string is one message) are shown to the model unless ``done``; the
        rewards of an episode are summed into ``env_reward``."""


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class EnvironmentNotShippable(RlhfflowError, TypeError):
    """An environment that cannot be pickled to the pool (``env_placement: pool``)."""


class ToolEnvironment:
    """Plain functions as an environment. Every ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` in the model's turn calls ``name(**arguments)``, and its result
    (``str`` of a string, else JSON) comes back as one message; ``info`` counts the
    turn's ``calls`` and those that came back as ``errors``. Mistakes come back as
    the message ``error: ...`` instead of raising: JSON that does not parse, an unknown
    tool, an exception, a call slower than ``timeout_s`` (whose thread is left to
    finish; Python cannot stop it). A turn with no tool call ends the episode; tools
    give no reward (a ``score`` stage judges the episode)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], timeout_s: float) -> None:
        self.tools = tools
        self.timeout_s = timeout_s

    def reset(self, record: dict[str, Any]) -> list[Message]:
        """Tools need no opening."""
        return []

    def step(self, text: str) -> tuple[list[Message], float, bool, dict]:
        """Run the turn's tool calls, in order."""
        calls = TOOL_CALL.findall(text)
        if not calls:
            if "<tool_call>" in text:  # cut before its end (the turn's token limit)
                return [{"content": "error: a <tool_call> without </tool_call>"}], \
                    0.0, False, {"calls": 1, "errors": 1}
            return [], 0.0, True, {"calls": 0, "errors": 0}
        results = [self.call(body) for body in calls]
        # (a tool's own result that starts with "error: " counts as an error too)
        errors = sum(result.startswith("error: ") for result in results)
        return [{"content": result} for result in results], 0.0, False, \
            {"calls": len(calls), "errors": errors}

    def call(self, body: str) -> str:
        """The text a tool call's JSON ``body`` returns to the model."""
        try:
            request = json.loads(body)
        except json.JSONDecodeError as exc:
            return f"error: the tool call is not JSON: {exc.msg}"
        if not isinstance(request, dict) or not isinstance(request.get("name"), str):
            return 'error: expected {"name": "...", "arguments": {...}}'
        name, arguments = request["name"], request.get("arguments", {})
        if name not in self.tools:
            return f"error: unknown tool {name!r} (known: {', '.join(sorted(self.tools))})"
        if not isinstance(arguments, dict):
            return "error: 'arguments' must be a JSON object"
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            result = pool.submit(self.tools[name], **arguments).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            return f"error: tool {name!r} took more than {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001  (the tool's failure is the model's answer)
            return f"error: {type(exc).__name__}: {exc}"
        finally:
            pool.shutdown(wait=False)
        return result if isinstance(result, str) else json.dumps(result, default=str)


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
                                            "these strings (with tools, </tool_call> too)")
    env: str | None = Field(None, description="the environment class, 'file.py:Class' "
                                              "(relative to the pipeline file) or "
                                              "'package.module:Class'")
    env_kwargs: dict[str, Any] = Field({}, description="keyword arguments of the "
                                                       "environment class")
    tools: list[str] = Field([], description="tool functions the model calls with "
                                             "<tool_call>{\"name\": ..., \"arguments\": "
                                             "{...}}</tool_call>, 'file.py:function' each")
    tool_timeout_s: Annotated[float, Field(
        gt=0, description="seconds a tool call may take; slower: an error message")] = 10.0
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
                            "env_workers. A run without a pool (in process, `stage test`) "
                            "steps in the task")
    plain_separator: str = Field("\n", description="around environment messages when the "
                                                   "prompt was not rendered with a chat "
                                                   "template")


class EnvironmentMisbehaved(UserError):
    """An environment's ``reset`` or ``step`` returned something of the wrong shape: one
    line naming its file and class, the hook and what was expected."""


@dataclass
class Episode:
    """One row's episode so far: its response tokens, which are the model's, their
    log-probs, the model's last turn, the uniforms it used, the model turns taken, the
    reward, and ``log``: the turns as who said what (``add``, ``took``)."""

    env: Any
    tokens: list[int] = field(default_factory=list)
    said: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    drawn: int = 0
    turns: int = 0
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    done: bool = False
    env_seconds: float = 0.0
    log: list[dict[str, Any]] = field(default_factory=list)

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None,
            messages: Sequence[Message] = (), role: str = "env") -> None:
        """Append the model's tokens (with log-probs) or the environment's (None, with
        the ``messages`` they render, whose role defaults to ``role``), and log the turn
        with its span of response tokens."""
        start = len(self.tokens)
        self.tokens += tokens
        self.mask += [1 if logprobs is not None else 0] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        span = [start, len(self.tokens)]
        if logprobs is not None:
            self.log.append({"role": "assistant", "span": span, "reward": 0.0})
        elif messages:
            self.log += [{"role": m.get("role", role), "text": m["content"], "span": span}
                         for m in messages]
        elif tokens:  # no message, but the template's turn markers
            self.log.append({"role": role, "text": "", "span": span})

    def took(self, result: Any) -> tuple[list[Message] | str, float, bool, dict]:
        """The environment's ``step`` result, checked (``EnvironmentMisbehaved``), its
        reward added to the episode's and to the model turn it answers."""
        problem = step_problem(result)
        if problem:
            raise EnvironmentMisbehaved(f"{env_name(self.env)}.step returned {problem}")
        messages, reward, done, info = result
        reward = float(reward)
        self.reward += reward
        turn = next((t for t in reversed(self.log) if t["role"] == "assistant"), None)
        if turn is not None:
            turn["reward"] += reward
            if info:
                turn["info"] = json.loads(json.dumps(info, default=str))
        return messages, reward, bool(done), info

    def opened(self, messages: Any) -> list[Message] | str:
        """The environment's ``reset`` result, checked (``EnvironmentMisbehaved``)."""
        problem = messages_problem(messages)
        if problem:
            raise EnvironmentMisbehaved(
                f"{env_name(self.env)}.reset returned {problem}; expected a string or a "
                "list of {'role', 'content': str} dicts (the messages before the model's "
                "first turn)")
        return messages


def env_name(env: Any) -> str:
    """``file.py:Class`` of an environment instance, for messages."""
    cls = type(env)
    try:
        where = Path(inspect.getsourcefile(cls) or cls.__module__).name
    except TypeError:
        where = cls.__module__
    return f"{where}:{cls.__qualname__}"


def messages_problem(messages: Any) -> str | None:
    """Why ``messages`` (what ``reset`` or ``step`` shows the model) is not a string or
    a list of ``{"role": ..., "content": str}`` dicts, or None."""
    if isinstance(messages, str):
        return None
    if not isinstance(messages, list | tuple):
        return f"messages of type {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
                or not isinstance(m.get("role", ""), str):
            return f"message {i} {m!r:.60}"
    return None


EXPECTED_STEP = ("expected a tuple (messages, reward, done, info): messages a string or "
                 "a list of {'role', 'content': str} dicts, reward a number, done a "
                 "bool, info a dict or None")


def step_problem(result: Any) -> str | None:
    """What is wrong with a ``step`` result (``"..., expected ..."``), or None."""
    if not isinstance(result, tuple | list) or len(result) != 4:
        shown = f"a {len(result)}-tuple" if isinstance(result, tuple | list) \
            else type(result).__name__
        return f"{shown} {result!r:.60}; {EXPECTED_STEP}"
    messages, reward, done, info = result
    problem = messages_problem(messages)
    if problem is None and (isinstance(reward, bool) or not _is_number(reward)):
        problem = f"reward {reward!r:.40}"
    if problem is None and not (isinstance(done, bool | int)  # numpy's bool too
                                or getattr(getattr(done, "dtype", None), "kind", "") == "b"):
        problem = f"done {done!r:.40}"
    if problem is None and info is not None and not isinstance(info, dict):
        problem = f"info {info!r:.40}"
    return None if problem is None else f"{problem}; {EXPECTED_STEP}"


def _is_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


class TurnFormat:
    """How environment messages become tokens after a model turn: the chat template's
    rendering of them, or plain text. Built once per call from the tokenizer."""

    PLACEHOLDER = "\x00turn\x00"

    def __init__(self, tokenizer, separator: str) -> None:
        self.tokenizer = tokenizer
        self.separator = separator
        self.template = bool(getattr(tokenizer, "chat_template", None))
        if self.template:
            self.role = "tool" if self._renders("tool") else "user"
            opening = [{"role": "user", "content": "x"}]
            ended = self._render([*opening, self._said(self.PLACEHOLDER)], False)
            self.base = ended
            # what closes an assistant turn after its text (e.g. "<|im_end|>")
            self.close = ended[ended.index(self.PLACEHOLDER) + len(self.PLACEHOLDER):]
            self.opening = opening
            asked = self._render(opening, True)
            self.generation_prompt = asked[len(self._render(opening, False)):]

    def _said(self, text: str) -> Message:
        return {"role": "assistant", "content": text}

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _renders(self, role: str) -> bool:
        try:
            text = self._render([{"role": "user", "content": "x"}, self._said("y"),
                                 {"role": role, "content": self.PLACEHOLDER}], True)
        except Exception:  # noqa: BLE001  (a template may raise on a role it lacks)
            return False
        return self.PLACEHOLDER in text

    def templated(self, prompt_text: str) -> bool:
        """Whether a prompt was rendered with the chat template: it ends with the
        template's generation prompt (the assistant's header)."""
        return self.template and bool(self.generation_prompt) and \
            prompt_text.endswith(self.generation_prompt)

    def tokens(self, messages: list[Message] | str, templated: bool,
               ended_at: int | None) -> list[int]:
        """Tokens of the environment's ``messages`` after a model turn, up to the start
        of the model's next turn. ``ended_at``: the token that ended the model's turn,
        if it ended at an EOS (the template's own end of turn is then not repeated)."""
        if isinstance(messages, str):
            messages = [{"content": messages}] if messages else []
        if not templated:
            text = "".join(self.separator + m["content"] for m in messages) + self.separator
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        turns = [{"role": m.get("role", self.role), "content": m["content"]} for m in messages]
        full = self._render([*self.opening, self._said(self.PLACEHOLDER), *turns], True)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders an earlier turn differently once "
                             "later turns follow; the rollout stage cannot join its turns")
        close = self.close
        if ended_at is not None:
            said = self.tokenizer.decode([ended_at], skip_special_tokens=False)
            close = close.removeprefix(said) if said else close
        return self.tokenizer(close + full[len(self.base):],
                              add_special_tokens=False)["input_ids"]


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
        return ("prompt_ids", "prompt_mask", "prompt_index", "sample_index", "prompt_text",
                "prompt_fields")

    @classmethod
    def writes(cls, params, algorithm, has_model):
        out = {"response_ids": Column("int64", "response"),
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
        return out

    @classmethod
    def response_tokens(cls, params) -> int:
        return params.max_tokens

    @classmethod
    def model_turns(cls, params) -> int:
        return params.max_turns

    @classmethod
    def env_on_pool(cls, params) -> bool:
        return params.env_placement == "pool"

    @classmethod
    def check_params(cls, params, has_model, base_dir):
        if params.env is not None and params.tools:
            return ("params.tools", "give either params.env or params.tools, not both")
        if params.env is not None:
            problem, env = _imported(params.env, base_dir)
            if problem:
                return ("params.env", problem)
            if not isinstance(env, type) or not all(
                    callable(getattr(env, hook, None)) for hook in ("reset", "step")):
                return ("params.env", f"{params.env!r} is not a class with reset(record) "
                                      "and step(text) methods")
        for i, ref in enumerate(params.tools):
            problem, _ = _imported(ref, base_dir)
            if problem:
                return (f"params.tools[{i}]", problem)
        for i, key in enumerate(params.info):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                return (f"params.info[{i}]", f"expected a name of letters, digits and _ "
                                             f"(it names the column info_<key>), got {key!r}")
        if params.env_kwargs and params.env is None:
            return ("params.env_kwargs", "env_kwargs go with params.env")
        return None

    @classmethod
    def check_tokenizer(cls, params, tokenizer, base_dir):
        if not params.tools or not getattr(tokenizer, "chat_template", None):
            return None
        fmt = TurnFormat(tokenizer, params.plain_separator)
        if fmt.role != "tool":
            return ("params.tools", "the model's chat template renders no 'tool' role, "
                    "which the tools' results take; use a model whose template has one, "
                    "or an environment (params.env), whose messages may be 'user' turns")
        return tool_schema_problem(params.tools, tokenizer, base_dir)

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        tok, params = resident.tokenizer, self.params
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        fmt = TurnFormat(tok, params.plain_separator)
        rows = len(batch["prompt_index"])
        texts = batch.get("prompt_text") or [""] * rows
        fields = batch.get("prompt_fields") or ["{}"] * rows
        templated = [fmt.templated(text) for text in texts]
        episodes = [Episode(self.make_env(ctx)) for _ in range(rows)]
        for row, episode in enumerate(episodes):
            opening = episode.opened(_settled(episode.env.reset(
                {**json.loads(fields[row]), "prompt": texts[row]})))
            if opening:
                self.answer(episode, opening, fmt, templated[row], None)
        uniforms = sample_uniforms(ctx.seed, ctx.iteration, batch["prompt_index"],
                                   batch["sample_index"], params.max_tokens)
        real = batch["prompt_mask"].bool()
        prompts = [batch["prompt_ids"][row][real[row]].tolist() for row in range(rows)]
        loop = EpisodeLoop(self, resident.module, tok, fmt, templated, prompts, uniforms,
                           pad_id)
        shipped = ctx.env_executor if params.env_placement == "pool" else None
        if shipped is not None:
            self.check_shippable(episodes)
            with resident.generating():
                loop.run(episodes, shipped, ships=True)
        else:
            with _env_pool(params.env_workers) as pool, resident.generating():
                loop.run(episodes, pool)
        self.last_timeline = loop.timeline
        if ctx.spans is not None:  # "env-pool": steps that took none of this task's time
            for start, stop in loop.timeline.env_busy():
                ctx.spans("env-pool" if shipped is not None else "env", start, stop)
        out = self.columns(episodes, tok, pad_id, resident.version)
        out["env_seconds"] = torch.tensor([e.env_seconds for e in episodes],
                                          dtype=torch.float32)
        return out

    def make_env(self, ctx: StageContext) -> Environment:
        """A new environment for one episode."""
        params = self.params
        if params.env is not None:
            return load_function(params.env, ctx.settings.base_dir)(**params.env_kwargs)
        tools = {ref.rpartition(":")[2]: load_function(ref, ctx.settings.base_dir)
                 for ref in params.tools}
        return ToolEnvironment(tools, params.tool_timeout_s)

    def check_shippable(self, episodes: list[Episode]) -> None:
        """Make the environments ready to travel to the pool: the pipeline's own files
        they come from go by value (a pool worker cannot import them by their name here),
        and an environment that does not pickle is one line naming ``params.env``."""
        import cloudpickle

        params = self.params
        if not episodes:
            return
        env = episodes[0].env
        made_of = env.tools.values() if isinstance(env, ToolEnvironment) else [type(env)]
        for thing in made_of:
            module = sys.modules.get(getattr(thing, "__module__", None) or "")
            # a file the pipeline names is imported under a name only this process knows
            if module is not None and module.__name__.startswith(USER_MODULE_PREFIX):
                cloudpickle.register_pickle_by_value(module)
        try:
            cloudpickle.dumps(env)
        except Exception as exc:  # noqa: BLE001  (anything pickling raises is the answer)
            key = "params.env" if params.env is not None else "params.tools"
            raise EnvironmentNotShippable(
                f"stage {self.name!r}, {key}: the environment cannot be pickled to run on "
                f"the pool (env_placement: pool): {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}") from None

    def env_turn(self, episode: Episode, answer: tuple, fmt: TurnFormat, templated: bool,
                 eos: Sequence[int] | None) -> None:
        """Take the environment's ``answer`` (what ``step`` returned) to the model's last
        turn (it is asked even when the episode ends there, for its reward)."""
        params = self.params
        messages, reward, done, info = episode.took(answer)
        for key in params.info:
            episode.info[key] = episode.info.get(key, 0.0) + float((info or {}).get(key, 0))
        if done or episode.turns >= params.max_turns or len(episode.tokens) >= params.max_tokens:
            episode.done = True
            return
        said = episode.said
        ended = said[-1] if said and eos is not None and said[-1] in eos else None
        self.answer(episode, messages, fmt, templated, ended)

    def answer(self, episode: Episode, messages, fmt: TurnFormat, templated: bool,
               ended_at: int | None) -> None:
        """Append the environment's messages; an episode with no room left for the
        model after them ends (cut to ``max_tokens``)."""
        tokens = fmt.tokens(messages, templated, ended_at)
        room = self.params.max_tokens - len(episode.tokens)
        listed = ([{"content": messages}] if messages else []) if isinstance(messages, str) \
            else messages
        episode.add(tokens[:room], None, listed, fmt.role if templated else "env")
        episode.done = len(tokens) >= room

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
               "policy_version": torch.full((rows,), version, dtype=torch.long),
               **{f"info_{key}": torch.tensor([e.info.get(key, 0.0) for e in episodes],
                                              dtype=torch.float32)
                  for key in self.params.info}}
        if self.params.scores:
            out["scores"] = out["env_reward"].clone()
            out["score_valid"] = torch.ones(rows, dtype=torch.int8)
        return out


@dataclass
class Timeline:
    """What one call of the stage did when, for tests and the task timeline: ``env``
    holds ``(row, turn, start, stop)`` per environment step (``time.time()`` seconds),
    ``steps`` per decode forward the rows in it and the rows whose environment step was
    in flight meanwhile, ``joins`` the rows of each join."""

    env: list[tuple[int, int, float, float]] = field(default_factory=list)
    steps: list[tuple[int, frozenset[int]]] = field(default_factory=list)
    joins: list[tuple[int, ...]] = field(default_factory=list)

    def env_busy(self) -> list[tuple[float, float]]:
        """The intervals in which at least one environment step ran (the union of
        ``env``'s), for the task timeline."""
        merged: list[tuple[float, float]] = []
        for start, stop in sorted((start, stop) for _, _, start, stop in self.env):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        return merged


#: A row that waits to rejoin joins at the latest after this many decode steps of others.
JOIN_WAIT_STEPS = 8


class EpisodeLoop:
    """Every row's episode to its end, with one KV cache kept across turns
    (``rlhfflow.engine.turns.TurnBatch``). Rows whose turn ended leave the decode batch and
    go to the environment (on ``pool``'s threads, while the others decode); an answered
    row waits to rejoin until the waiting rows are a quarter of those decoding, nothing
    else decodes, or it waited ``JOIN_WAIT_STEPS`` steps (a join is one forward of the
    joining rows alone)."""

    def __init__(self, stage: RolloutStage, module: torch.nn.Module, tok, fmt: TurnFormat,
                 templated: list[bool], prompts: list[list[int]], uniforms: torch.Tensor,
                 pad_id: int) -> None:
        from rlhfflow.engine.turns import TurnBatch

        self.stage, self.params, self.tok, self.fmt = stage, stage.params, tok, fmt
        self.templated, self.prompts, self.uniforms = templated, prompts, uniforms
        self.pad_id = pad_id
        self.eos = eos_ids(module, tok)
        self.stops = [*self.params.stop, *(["</tool_call>"] if self.params.tools else [])]
        self.batch = TurnBatch(module)
        self.timeline = Timeline()
        self.turn: dict[int, tuple[list[int], list[float], int]] = {}  # tokens, lps, limit
        self.last: dict[int, int] = {}      # the row's last sampled token (not fed yet)
        self.parked: dict[int, Any] = {}    # row -> its RowCache (or None) while away
        self.in_flight: dict[concurrent.futures.Future, int] = {}
        self.ready: dict[int, int] = {}     # answered rows -> the step they became ready

    def run(self, episodes: list[Episode], pool: concurrent.futures.Executor | None,
            ships: bool = False) -> None:
        """Play ``episodes`` to their end, their environment steps on ``pool`` (None:
        inline). ``ships``: the pool runs them in other processes, so each step takes
        the environment there and brings it back (``_shipped_step``)."""
        self.episodes, self.pool, self.ships = episodes, pool, ships
        rows = [row for row, episode in enumerate(episodes) if not episode.done]
        if rows:
            ids, mask = pad_prompts([self.prompts[r] + episodes[r].tokens for r in rows],
                                    self.pad_id)
            self.begin(rows)
            self.sample(self.batch.start(rows, ids, mask), rows)
        while self.batch.rows or self.in_flight or self.ready:
            self.collect(wait=not self.batch.rows and not self.ready)
            if self.ready and self.joins_now():
                self.join()
            if self.batch.rows:
                self.step()

    def begin(self, rows: list[int]) -> None:
        """Open a model turn for each of ``rows``."""
        params = self.params
        for row in rows:
            room = params.max_tokens - len(self.episodes[row].tokens)
            self.turn[row] = ([], [], min(params.max_new_tokens, room))

    def step(self) -> None:
        """One decode step of every decoding row."""
        rows = list(self.batch.rows)
        self.timeline.steps.append((len(rows), frozenset(self.in_flight.values())))
        logits = self.batch.step(torch.tensor([self.last[row] for row in rows]))
        self.sample(logits, rows)

    def sample(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Draw each of ``rows``' next token from its ``logits`` (``generate``'s
        arithmetic, the row's uniform for its n-th model token of the episode), and end
        the turns that end with it."""
        params = self.params
        drawn = torch.tensor([self.episodes[r].drawn + len(self.turn[r][0]) for r in rows])
        uniforms = self.uniforms[torch.tensor(rows), drawn]
        token = sample_step(logits, uniforms, params).to(logits.device)
        logprob = torch.log_softmax(ops.tempered(logits, params.temperature), -1).gather(
            -1, token[:, None])[:, 0].cpu()
        ended = []
        for row, t, lp in zip(rows, token.cpu().tolist(), logprob.tolist(), strict=True):
            tokens, logprobs, limit = self.turn[row]
            tokens.append(t)
            logprobs.append(lp)
            self.last[row] = t
            if len(tokens) >= limit or (self.eos is not None and t in self.eos) or (
                    self.stops and any(stop in self.tok.decode(
                        tokens, skip_special_tokens=True) for stop in self.stops)):
                ended.append(row)
        if ended:
            self.end_turns(ended)

    def end_turns(self, rows: list[int]) -> None:
        """Take ``rows``, whose turn ended, out of the batch and to the environment."""
        at = {row: i for i, row in enumerate(self.batch.rows)}
        caches = self.batch.park([at[row] for row in rows], self.params.kv_cache)
        for row, cache in zip(rows, caches, strict=True):
            tokens, logprobs, _ = self.turn.pop(row)
            episode = self.episodes[row]
            episode.said = tokens
            episode.add(tokens, logprobs)
            episode.drawn += len(tokens)
            episode.turns += 1
            self.parked[row] = cache
            text = self.tok.decode(tokens, skip_special_tokens=True)
            if self.pool is None:
                self.answered(row, _timed_step(episode.env, text))
            elif self.ships:
                self.in_flight[self.pool.submit(_shipped_step, _pickled(episode.env, text))] = row
            else:
                self.in_flight[self.pool.submit(_timed_step, episode.env, text)] = row

    def collect(self, wait: bool) -> None:
        """Take the environment's answers that arrived (``wait``: at least one)."""
        if not self.in_flight:
            return
        done = [future for future in self.in_flight if future.done()]
        if not done and wait:
            done, _ = concurrent.futures.wait(self.in_flight,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
        for future in sorted(done, key=self.in_flight.__getitem__):
            row = self.in_flight.pop(future)
            timed = future.result()
            if self.ships:  # the environment as the step left it, and the step's answer
                import cloudpickle

                self.episodes[row].env, *timed = cloudpickle.loads(timed)
            self.answered(row, tuple(timed))

    def answered(self, row: int, timed: tuple[tuple, float, float]) -> None:
        """Book the environment's answer to ``row``; a row that goes on waits to rejoin."""
        answer, start, stop = timed
        episode = self.episodes[row]
        episode.env_seconds += stop - start
        self.timeline.env.append((row, episode.turns, start, stop))
        self.stage.env_turn(episode, answer, self.fmt, self.templated[row],
                            self.eos)
        if episode.done:
            self.parked.pop(row)
        else:
            self.ready[row] = len(self.timeline.steps)

    def joins_now(self) -> bool:
        """Whether the rows waiting to rejoin join before the next decode step."""
        decoding = len(self.batch.rows)
        oldest = min(self.ready.values())
        return not decoding or 4 * len(self.ready) >= decoding or \
            len(self.timeline.steps) - oldest >= JOIN_WAIT_STEPS

    def join(self) -> None:
        """Bring the waiting rows back: each feeds what follows its cache (its last
        token and the environment's answer; the whole episode when no cache is kept)."""
        rows = sorted(self.ready)
        self.ready.clear()
        caches = [self.parked.pop(row) for row in rows]
        blocks = []
        for row, cache in zip(rows, caches, strict=True):
            sequence = self.prompts[row] + self.episodes[row].tokens
            if cache is None:
                log.debug("rollout row %d re-prefills its %d tokens (kv_cache is off)",
                          row, len(sequence))
            blocks.append(sequence[cache.length if cache is not None else 0:])
        self.timeline.joins.append(tuple(rows))
        self.begin(rows)
        self.sample(self.batch.join(rows, caches, blocks, self.pad_id), rows)


def _timed_step(env: Environment, text: str) -> tuple[tuple, float, float]:
    """``(answer, start, stop)``: ``env.step(text)`` (awaited when it is a coroutine)
    and when it ran (``time.time()``)."""
    start = time.time()
    answer = _settled(env.step(text))
    return answer, start, time.time()


def _pickled(env: Environment, text: str) -> bytes:
    """An environment and the model's turn as ``_shipped_step`` takes them: pickled here,
    where the pipeline's own modules are registered to go by value."""
    import cloudpickle

    return cloudpickle.dumps((env, text))


def _shipped_step(payload: bytes) -> bytes:
    """One environment step on a pool worker: ``payload`` is the pickled ``(env, text)``;
    returns the pickled ``(env, answer, start, stop)``, the environment as the step left
    it (it plays on in the next step, wherever that runs)."""
    import cloudpickle

    env, text = cloudpickle.loads(payload)
    answer, start, stop = _timed_step(env, text)
    return cloudpickle.dumps((env, answer, start, stop))


def _settled(value: Any) -> Any:
    """``value``, or what it resolves to when an async hook returned a coroutine."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


@contextmanager
def _env_pool(workers: int):
    """Threads for the environment's steps (None: they run inline)."""
    if workers == 0:
        yield None
        return
    with concurrent.futures.ThreadPoolExecutor(workers, "rollout-env") as pool:
        yield pool


def tool_schema_problem(refs: Sequence[str], tokenizer, base_dir: Path | str | None
                        ) -> tuple[str, str] | None:
    """``(key, message)`` if the chat template, when it shows tools to the model (its
    rendering changes with a ``tools`` argument), cannot be given the tools: a function
    whose JSON schema cannot be built from its type hints and docstring
    (``transformers.utils.get_json_schema``), or a template that fails on them."""
    from transformers.utils import get_json_schema

    opening = [{"role": "user", "content": "x"}]

    def render(tools):
        return tokenizer.apply_chat_template(opening, tools=tools, tokenize=False,
                                             add_generation_prompt=True)

    probe = {"type": "function", "function": {
        "name": "probe", "description": "a probe",
        "parameters": {"type": "object", "properties": {}}}}
    try:
        if render([probe]) == render(None):
            return None  # the template shows no tools: the prompt must describe them
    except Exception:  # noqa: BLE001  (checked below with the real schemas)
        pass
    schemas = []
    for i, ref in enumerate(refs):
        try:
            schemas.append(get_json_schema(load_function(ref, base_dir)))
        except Exception as exc:  # noqa: BLE001  (transformers' parsing exceptions)
            return (f"params.tools[{i}]", f"the chat template shows tools to the model, "
                    f"but {ref!r} has no JSON schema: {_first_line(exc)} (give it type "
                    "hints and a docstring with an Args: section)")
    try:
        render(schemas)
    except Exception as exc:  # noqa: BLE001  (the template's own error)
        return ("params.tools", f"the model's chat template cannot render these tools: "
                                f"{type(exc).__name__}: {_first_line(exc)}")
    return None


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _imported(ref: str, base_dir: Path | str | None) -> tuple[str | None, Any]:
    """``(problem, object)``: what ``ref`` names, or one line on why it cannot be used."""
    module, sep, attr = ref.rpartition(":")
    if not sep or not module or not attr:
        return f"expected 'file.py:name' or 'package.module:name', got {ref!r}", None
    if module.endswith(".py"):
        path = Path(module) if Path(module).is_absolute() or base_dir is None \
            else Path(base_dir) / module
        if not path.is_file():
            return f"file not found: {path}", None
    try:
        return None, load_function(ref, base_dir)
    except Exception as exc:  # noqa: BLE001  (the user's module failed to import)
        lines = str(exc).strip().splitlines()
        return f"cannot import {ref!r}: {type(exc).__name__}: " \
               f"{lines[0] if lines else ''}", None
