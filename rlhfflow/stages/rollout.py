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
model's tokens (0 elsewhere); ``env_reward`` is the episode's summed environment reward
and ``turns`` its model turns; ``info_<key>`` (for each key of ``params.info``) the sum
over the episode of the number ``step`` returned under that key in its ``info``. The run's
metrics average them over the iteration's episodes (``env_reward_mean``, ``turns_mean``,
``info_<key>_mean``).

Sampling is ``generate``'s, per row: the row's uniforms come from the same generator
(``sampling.sample_uniforms``) and its n-th model token of the episode draws the n-th,
so with one turn the stage gives ``generate``'s tokens. Turns are joined with the
tokenizer's chat template when the prompt was rendered with it (environment messages
take the role ``tool`` if the template renders it, else ``user``), else as plain text
with ``plain_separator`` around them.

Not done yet: each turn re-runs the prompt and the episode so far through the model
(no KV cache kept across turns), environments step inside the stage's task (not as
tasks of their own on a CPU pool), and the environment's reward is per episode.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Protocol

import torch
from pydantic import Field

from rlhfflow.data.records import pad_prompts
from rlhfflow.engine.sampling import sample_uniforms
from rlhfflow.stages.base import Batch, Column, Stage, StageContext, StageParams, register_stage
from rlhfflow.stages.generate import cut_at_stop, eos_ids, generate
from rlhfflow.stages.inference import load_function

Message = dict[str, str]


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
    plain_separator: str = Field("\n", description="around environment messages when the "
                                                   "prompt was not rendered with a chat "
                                                   "template")


@dataclass
class Episode:
    """One row's episode so far: its response tokens, which are the model's, their
    log-probs, the model's last turn, the uniforms it used, the model turns taken and the
    reward."""

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

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Append the model's tokens (with log-probs) or the environment's (None)."""
        self.tokens += tokens
        self.mask += [1 if logprobs is not None else 0] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)


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
    sampling log-probs, ``env_reward``, ``turns`` and ``policy_version``."""

    type_name = "rollout"
    Params = RolloutParams
    model_head = "lm"
    generates = True

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
               **{f"info_{key}": Column("float32") for key in params.info}}
        if params.scores:
            out.update(scores=Column("float32"), score_valid=Column("int8"))
        return out

    @classmethod
    def response_tokens(cls, params) -> int:
        return params.max_tokens

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

    def run(self, batch: Batch, ctx: StageContext) -> Batch:
        resident = ctx.models.get(self.model)
        tok, params = resident.tokenizer, self.params
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        eos = eos_ids(resident.module, tok)
        fmt = TurnFormat(tok, params.plain_separator)
        rows = len(batch["prompt_index"])
        texts = batch.get("prompt_text") or [""] * rows
        fields = batch.get("prompt_fields") or ["{}"] * rows
        templated = [fmt.templated(text) for text in texts]
        episodes = [Episode(self.make_env(ctx)) for _ in range(rows)]
        for row, episode in enumerate(episodes):
            opening = episode.env.reset({**json.loads(fields[row]), "prompt": texts[row]})
            if opening:
                self.answer(episode, opening, fmt, templated[row], None)
        uniforms = sample_uniforms(ctx.seed, ctx.iteration, batch["prompt_index"],
                                   batch["sample_index"], params.max_tokens)
        real = batch["prompt_mask"].bool()
        prompts = [batch["prompt_ids"][row][real[row]].tolist() for row in range(rows)]
        while active := [r for r, e in enumerate(episodes) if not e.done]:
            self.model_turn(resident.module, tok, [episodes[r] for r in active],
                            [prompts[r] for r in active], uniforms[active], eos, pad_id)
            for r in active:
                self.env_turn(episodes[r], tok, fmt, templated[r], eos)
        return self.columns(episodes, tok, pad_id, resident.version)

    def make_env(self, ctx: StageContext) -> Environment:
        """A new environment for one episode."""
        params = self.params
        if params.env is not None:
            return load_function(params.env, ctx.settings.base_dir)(**params.env_kwargs)
        tools = {ref.rpartition(":")[2]: load_function(ref, ctx.settings.base_dir)
                 for ref in params.tools}
        return ToolEnvironment(tools, params.tool_timeout_s)

    def model_turn(self, module: torch.nn.Module, tok, episodes: list[Episode],
                   prompts: list[list[int]], uniforms: torch.Tensor,
                   eos: Sequence[int] | None, pad_id: int) -> None:
        """One turn of the model on the active episodes: the prompt and the episode so far
        run through the model again (no KV cache is kept across turns)."""
        params = self.params
        budgets = torch.tensor([params.max_tokens - len(e.tokens) for e in episodes])
        steps = min(params.max_new_tokens, int(budgets.max()))
        drawn = torch.tensor([e.drawn for e in episodes])
        # each row's next uniforms; those past its budget are never kept
        index = (drawn[:, None] + torch.arange(steps)).clamp(max=params.max_tokens - 1)
        ids, mask = pad_prompts([p + e.tokens for p, e in zip(prompts, episodes,
                                                              strict=True)], pad_id)
        turn = params.model_copy(update={"max_new_tokens": steps})
        out = generate(module, ids, mask, uniforms.gather(1, index), turn, eos, pad_id)
        stops = [*params.stop, *(["</tool_call>"] if params.tools else [])]
        if stops:
            cut_at_stop(out, tok, stops, pad_id)
        lengths = torch.minimum(out["response_mask"].long().sum(-1), budgets)
        for row, episode in enumerate(episodes):
            length = int(lengths[row])
            episode.said = out["response_ids"][row, :length].tolist()
            episode.add(episode.said, out["sample_logprobs"][row, :length].tolist())
            episode.drawn += length
            episode.turns += 1

    def env_turn(self, episode: Episode, tok, fmt: TurnFormat, templated: bool,
                 eos: Sequence[int] | None) -> None:
        """The environment answers the model's last turn (and is asked even when the
        episode ends there, for its reward)."""
        params = self.params
        said = episode.said
        messages, reward, done, info = episode.env.step(
            tok.decode(said, skip_special_tokens=True))
        episode.reward += float(reward)
        for key in params.info:
            episode.info[key] = episode.info.get(key, 0.0) + float(info.get(key, 0))
        if done or episode.turns >= params.max_turns or len(episode.tokens) >= params.max_tokens:
            episode.done = True
            return
        ended = said[-1] if said and eos is not None and said[-1] in eos else None
        self.answer(episode, messages, fmt, templated, ended)

    def answer(self, episode: Episode, messages, fmt: TurnFormat, templated: bool,
               ended_at: int | None) -> None:
        """Append the environment's messages; an episode with no room left for the
        model after them ends (cut to ``max_tokens``)."""
        tokens = fmt.tokens(messages, templated, ended_at)
        room = self.params.max_tokens - len(episode.tokens)
        episode.add(tokens[:room], None)
        episode.done = len(tokens) >= room

    def columns(self, episodes: list[Episode], tok, pad_id: int, version: int) -> Batch:
        """The stage's columns from the finished episodes."""
        rows, width = len(episodes), self.params.max_tokens
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.int8)
        logprobs = torch.zeros(rows, width)
        for row, episode in enumerate(episodes):
            length = len(episode.tokens)
            ids[row, :length] = torch.tensor(episode.tokens, dtype=torch.long)
            mask[row, :length] = torch.tensor(episode.mask, dtype=torch.int8)
            logprobs[row, :length] = torch.tensor(episode.logprobs)
        out = {"response_ids": ids, "response_mask": mask, "sample_logprobs": logprobs,
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
