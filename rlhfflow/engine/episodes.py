"""Multi-turn episodes: the model speaks, an environment answers, until the environment
says done, ``max_turns`` model turns, or ``max_tokens`` response tokens.

:class:`EpisodeLoop` decodes every row's episode in one loop with each one's KV cache kept
across its turns (``rlhfflow.engine.turns``); what answers the model, and how its messages
become tokens, is :mod:`rlhfflow.engine.environments`. The ``rollout`` stage
(``rlhfflow.stages.rollout``) runs it and writes the columns; its docstring describes the
behaviour.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhfflow import ops
from rlhfflow.engine.batch import pad_prompts
from rlhfflow.engine.environments import Environment, Episode, TurnFormat
from rlhfflow.engine.generation import eos_ids
from rlhfflow.engine.sampling import SamplingParams, sample_step

log = logging.getLogger(__name__)


class EpisodeParams(SamplingParams, Protocol):
    """What the episode loop reads of a stage's parameters (``RolloutParams`` has them)."""

    max_turns: int
    max_tokens: int
    max_new_tokens: int
    stop: list[str]
    tools: list[str]
    info: list[str]
    kv_cache: bool


def env_turn(params: EpisodeParams, episode: Episode, result: tuple, fmt: TurnFormat,
             templated: bool, eos: Sequence[int] | None) -> None:
    """Take the environment's answer ``result`` (what ``step`` returned) to the model's
    last turn (it is asked even when the episode ends there, for its reward)."""
    messages, reward, done, info = episode.took(result)
    for key in params.info:
        episode.info[key] = episode.info.get(key, 0.0) + float((info or {}).get(key, 0))
    if done or episode.turns >= params.max_turns or len(episode.tokens) >= params.max_tokens:
        episode.done = True
        return
    said = episode.said
    ended = said[-1] if said and eos is not None and said[-1] in eos else None
    add_messages(params, episode, messages, fmt, templated, ended)


def add_messages(params: EpisodeParams, episode: Episode, messages, fmt: TurnFormat,
                 templated: bool, ended_at: int | None) -> None:
    """Append the environment's messages; an episode with no room left for the
    model after them ends (cut to ``max_tokens``)."""
    tokens = fmt.tokens(messages, templated, ended_at)
    room = params.max_tokens - len(episode.tokens)
    listed = ([{"content": messages}] if messages else []) if isinstance(messages, str) \
        else messages
    episode.add(tokens[:room], None, listed, fmt.role if templated else "env")
    episode.done = len(tokens) >= room


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
    joining rows alone). ``stops``: the strings that end a model turn (by default
    ``params.stop``, and ``</tool_call>`` with tools)."""

    def __init__(self, params: EpisodeParams, module: torch.nn.Module, tok, fmt: TurnFormat,
                 templated: list[bool], prompts: list[list[int]], uniforms: torch.Tensor,
                 pad_id: int, stops: Sequence[str] | None = None) -> None:
        from rlhfflow.engine.turns import TurnBatch

        self.params, self.tok, self.fmt = params, tok, fmt
        self.templated, self.prompts, self.uniforms = templated, prompts, uniforms
        self.pad_id = pad_id
        self.eos = eos_ids(module, tok)
        # a turn ends right after one of these; by default a Hermes tool call's end
        self.stops = list(stops) if stops is not None else \
            [*self.params.stop, *(["</tool_call>"] if self.params.tools else [])]
        self.batch = TurnBatch(module)
        self.timeline = Timeline()
        self.turn: dict[int, tuple[list[int], list[float], int]] = {}  # tokens, lps, limit
        #: the version of the weights decoding now; each model token records it
        self.version = 0
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
        uniforms = self.draws(rows, drawn)
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

    def draws(self, rows: list[int], drawn: torch.Tensor) -> torch.Tensor:
        """The uniforms of ``rows``' next tokens: row r's ``drawn[i]``-th."""
        return self.uniforms[torch.tensor(rows), drawn]

    def versions_of(self, row: int, n: int) -> int | list[int]:
        """The versions of the weights that sampled the ``n`` tokens of ``row``'s turn
        that just ended (one for all of them, here)."""
        return self.version

    def end_turns(self, rows: list[int]) -> None:
        """Take ``rows``, whose turn ended, out of the batch and to the environment."""
        at = {row: i for i, row in enumerate(self.batch.rows)}
        caches = self.batch.park([at[row] for row in rows], self.params.kv_cache)
        for row, cache in zip(rows, caches, strict=True):
            tokens, logprobs, _ = self.turn.pop(row)
            episode = self.episodes[row]
            episode.said = tokens
            episode.add(tokens, logprobs, version=self.versions_of(row, len(tokens)))
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
        env_turn(self.params, episode, answer, self.fmt, self.templated[row], self.eos)
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
        blocks = [self.block(row, cache) for row, cache in zip(rows, caches, strict=True)]
        self.timeline.joins.append(tuple(rows))
        self.begin(rows)
        self.sample(self.batch.join(rows, caches, blocks, self.pad_id), rows)

    def block(self, row: int, cache) -> list[int]:
        """What ``row`` feeds when it rejoins: what follows its ``cache`` (a
        ``RowCache``; None: the whole episode)."""
        sequence = self.prompts[row] + self.episodes[row].tokens
        if cache is None:
            log.debug("rollout row %d re-prefills its %d tokens (no cache kept)", row,
                      len(sequence))
        return sequence[cache.length if cache is not None else 0:]


def _timed_step(env: Environment, text: str) -> tuple[tuple, float, float]:
    """``(answer, start, stop)``: ``env.step(text)`` (awaited when it is a coroutine)
    and when it ran (``time.time()``)."""
    start = time.time()
    answer = settled(env.step(text))
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


def settled(value: Any) -> Any:
    """``value``, or what it resolves to when an async hook returned a coroutine."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


@contextmanager
def env_threads(workers: int):
    """Threads for the environment's steps (None: they run inline)."""
    if workers == 0:
        yield None
        return
    with concurrent.futures.ThreadPoolExecutor(workers, "rollout-env") as pool:
        yield pool
