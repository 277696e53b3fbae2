"""Agents: a function the user already has, that talks to the model through the OpenAI API.

An agent is ``async def solve(client, record)`` (or a plain ``def``): ``client`` is an
``openai.AsyncOpenAI`` (``openai.OpenAI`` for a plain function) pointed at an endpoint
that serves the policy (:mod:`rlhfflow.serve.endpoint`), ``record`` the data set's record.
It returns the episode's reward, or ``{"reward": r, "info": {key: number}}``. Code that
makes its own client takes ``client.base_url`` and ``client.api_key``.

Each episode gets a session of its own (its own ``base_url``): whatever it asks, its calls
sample at the stage's settings (temperature, top-k/p; ``max_tokens`` capped at
``max_new_tokens``) with the episode's own random stream, and every call is recorded:
prompt ids, completion ids, log-probs, policy versions. :func:`trajectory` makes the
episode one training sample when each call's prompt extends the previous call's prompt
and completion at token level (the chat template re-renders history unchanged): the
tokens between calls (the tools' answers, the template's markers) go in with mask 0, each
completion with mask 1 and the log-probs it was sampled with.

What can go wrong is counted, never a crash: an agent that raises, runs past its timeout,
makes no call, returns no number, or whose first prompt does not begin with the data
set's prompt ends its episode with no trained token and reward 0 (:class:`AgentOutcome`
says which). A call whose prompt does not extend the one before (a template that rewrites
history) ends the sample there: with ``agent_samples`` above 1 it starts the next sample
of the episode (one per call, sharing the episode's reward, each in a row of its own),
else it and the calls after it are counted as untrained.

An agent runs in the worker's process, on the event loop of the stage's task (a plain
function on a thread of its own), or with ``env_placement: pool`` in a process of the run's
CPU pool on the same machine (``run_shipped_agent``: pickled there, with a client of its
own on its session's loopback URL): it can do what that process can (files, network). A
timed-out agent cannot be stopped; its later calls are refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfflow.engine.environments import Episode
from rlhfflow.engine.service import GenerationService, SamplingSettings
from rlhfflow.engine.toolformats import ToolFormat
from rlhfflow.engine.usercode import by_value, imported
from rlhfflow.serve.endpoint import Call, Endpoint, EndpointSettings, Session

#: why an episode trained nothing (``AgentOutcome.error``)
FAILURES = ("raised", "timeout", "no_call", "reward", "prompt")


@dataclass
class AgentOutcome:
    """One episode: the calls it made (in order), its reward and info, and ``error`` (one
    of ``FAILURES``) with ``message`` when it failed."""

    calls: list[Call] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    message: str = ""


def agent_problem(ref: str, base_dir: Path | str | None) -> str | None:
    """Why ``ref`` (``file.py:function``) names no agent function, or None."""
    problem, fn = imported(ref, base_dir)
    if problem:
        return problem
    if not callable(fn):
        return f"{ref!r} is not a function"
    try:
        signature = inspect.signature(fn)
        signature.bind(object(), {})
    except (TypeError, ValueError):
        return (f"{ref!r} must take (client, record): an OpenAI client and the data set's "
                f"record, e.g. 'async def solve(client, record)'")
    try:
        import openai  # noqa: F401 - the agent's client
    except ImportError:
        return "an agent needs the 'openai' package: pip install 'rlhfflow[agents]'"
    return None


class AgentRunner:
    """Runs agents against ``service`` through a loopback endpoint with a key of its own
    (no other process on the machine can use it): ``run`` plays one episode per record."""

    def __init__(self, service: GenerationService, tokenizer, tool_format: ToolFormat,
                 sampling: SamplingSettings, concurrency: int, timeout_s: float,
                 pool: concurrent.futures.Executor | None = None) -> None:
        self.key = secrets.token_hex(16)
        self.endpoint = Endpoint(service, tokenizer,
                                 EndpointSettings(model="policy", api_key=self.key),
                                 tool_format)
        self.sampling, self.concurrency, self.timeout_s = sampling, concurrency, timeout_s
        self.pool = pool  # agents run there, in other processes on this machine

    def run(self, fn: Callable[..., Any], records: Sequence[dict[str, Any]],
            generators: Sequence[torch.Generator]) -> list[AgentOutcome]:
        """One episode per record (``generators``: each episode's random stream)."""
        threads = concurrent.futures.ThreadPoolExecutor(self.concurrency, "rlhfflow-agent")
        service = self.endpoint.service
        try:
            with self.endpoint, concurrent.futures.ThreadPoolExecutor(1) as loop_thread:
                agents = loop_thread.submit(asyncio.run, self._all(fn, records, generators,
                                                                   threads))
                if service.driven:  # this thread decodes while the agents run
                    agents.add_done_callback(lambda _: service.wake())
                    service.drive(agents.done)
                return agents.result()
        finally:  # a timed-out plain function may still run: not waited for
            threads.shutdown(wait=False, cancel_futures=True)

    async def _all(self, fn, records, generators, threads) -> list[AgentOutcome]:
        import openai

        gate = asyncio.Semaphore(self.concurrency)
        plain = not inspect.iscoroutinefunction(fn)
        # every episode's session and client first: making a client takes milliseconds,
        # and agents that start together then call together (one prefill for them all)
        started = []
        shipped = pickled_agent(fn) if self.pool is not None else None
        for generator in generators:
            session = Session(self.sampling, generator)
            url = self.endpoint.open(session)
            make = openai.OpenAI if plain else openai.AsyncOpenAI
            started.append((session, url if shipped is not None else make(
                base_url=url, api_key=self.key, max_retries=0, timeout=self.timeout_s)))
        if shipped is not None:
            fn = shipped

        async def one(record: dict[str, Any], episode) -> AgentOutcome:
            async with gate:
                return await self._episode(fn, record, *episode, threads)

        return list(await asyncio.gather(*(one(r, e) for r, e in
                                           zip(records, started, strict=True))))

    async def _episode(self, fn, record, session: Session, client, threads
                       ) -> AgentOutcome:
        outcome = AgentOutcome()
        try:
            if isinstance(fn, bytes):  # on the pool: ``client`` is the session's URL
                running = asyncio.wrap_future(self.pool.submit(
                    run_shipped_agent, fn, record, client, self.key, self.timeout_s))
                result = await asyncio.wait_for(running, self.timeout_s)
            elif inspect.iscoroutinefunction(fn):
                async with client:
                    result = await asyncio.wait_for(fn(client, record), self.timeout_s)
            else:
                running = asyncio.get_running_loop().run_in_executor(threads, fn, client,
                                                                     record)
                result = await asyncio.wait_for(running, self.timeout_s)
                client.close()
        except TimeoutError:
            outcome.error, outcome.message = "timeout", f"ran past {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - an agent's failure is counted, not raised
            text = str(exc).strip().splitlines()
            outcome.error, outcome.message = "raised", \
                f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
        else:
            outcome.reward, outcome.info, problem = _reward(result)
            if problem:
                outcome.error, outcome.message = "reward", problem
        finally:
            self.endpoint.close_session(session)
        outcome.calls = list(session.calls)
        if outcome.error is None and not outcome.calls:
            outcome.error, outcome.message = "no_call", "the agent made no call"
        return outcome


def pickled_agent(fn: Callable[..., Any]) -> bytes:
    """``fn`` pickled to run on the CPU pool: from a file the pipeline names (imported
    under a name only this process knows), by value."""
    import cloudpickle

    by_value(fn)
    return cloudpickle.dumps(fn)


def run_shipped_agent(payload: bytes, record: dict[str, Any], base_url: str, api_key: str,
                      timeout_s: float) -> Any:
    """One episode on a pool worker: the agent (``pickled_agent``) with a client of its
    own on the session's URL (the endpoint listens on the rollout worker's loopback, so
    the pool must be on the same machine). Returns what the agent returned."""
    import cloudpickle
    import openai

    fn = cloudpickle.loads(payload)
    if inspect.iscoroutinefunction(fn):
        async def episode() -> Any:
            async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                          timeout=timeout_s) as client:
                return await fn(client, record)
        return asyncio.run(episode())
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                       timeout=timeout_s) as client:
        return fn(client, record)


def _reward(result: Any) -> tuple[float, dict[str, float], str | None]:
    info: Any = {}
    if isinstance(result, dict):
        info = result.get("info") or {}
        result = result.get("reward")
    if isinstance(result, bool) or not isinstance(result, (int, float)) or \
            not math.isfinite(result):
        return 0.0, {}, (f"returned {result!r}; expected a finite number or "
                         f"{{'reward': number, 'info': {{key: number}}}}")
    if not isinstance(info, dict):
        return 0.0, {}, f"returned info {info!r}; expected a dict of numbers"
    numbers = {str(k): float(v) for k, v in info.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return float(result), numbers, None


@dataclass
class Trajectory:
    """A sample after the data set's prompt: its ``pieces`` in order, each the tokens
    between two calls (log-probs None: not the model's) or a call's completion with its
    log-probs, and the ``calls`` in it."""

    pieces: list[tuple[list[int], list[float] | None]] = field(default_factory=list)
    calls: int = 0


def trajectories(prompt: Sequence[int], calls: Sequence[Call], samples: int = 1
                 ) -> tuple[list[Trajectory], int] | None:
    """The calls as at most ``samples`` samples after ``prompt`` (see the module's
    docstring): a call extends the current sample when its prompt begins with that
    sample's tokens so far, else it starts the next one (its prompt must begin with
    ``prompt``); with the calls left out (past the last sample, or not beginning with
    ``prompt``). None when the first call's prompt does not begin with ``prompt``."""
    head = list(prompt)
    made: list[Trajectory] = []
    sequence: list[int] = []  # what a call's prompt must begin with to extend the sample
    for i, call in enumerate(calls):
        if not made or call.prompt[:len(sequence)] != sequence:
            starts = list(call.prompt[:len(head)]) == head
            if not made and not starts:
                return None
            if len(made) == samples or not starts:
                return made, len(calls) - i
            made.append(Trajectory())
            sequence = head
        out = made[-1]
        if len(call.prompt) > len(sequence):
            out.pieces.append((call.prompt[len(sequence):], None))
        out.pieces.append((call.completion.tokens, call.completion.logprobs))
        sequence = call.prompt + call.completion.tokens
        out.calls += 1
    return made, 0


def agent_episodes(prompt: list[int], outcome: AgentOutcome, tok, max_tokens: int,
                   info: Sequence[str], samples: int = 1) -> tuple[list[Episode], int]:
    """An agent's episode as ``samples`` rollout ``Episode``s, one per sample it made
    (:func:`trajectories`; each cut at ``max_tokens``, its ``info`` keys kept, the
    episode's reward on each) and empty ones after them (``Episode.turns`` 0), and the
    calls left out. A failed episode keeps its tokens with no trained one and reward 0."""
    made = trajectories(prompt, outcome.calls, samples) if outcome.calls else None
    if made is None and outcome.error is None:
        outcome.error, outcome.message = "prompt", (
            "its first call's prompt does not begin with the data set's prompt (send "
            "the record's messages first; put a system prompt in the data)")
    if made is None:
        return [Episode(None) for _ in range(samples)], len(outcome.calls)
    trajectories_made, left = made
    episodes = [_episode(sample, outcome, tok, max_tokens, info)
                for sample in trajectories_made]
    return episodes + [Episode(None) for _ in range(samples - len(episodes))], left


def _episode(made: Trajectory, outcome: AgentOutcome, tok, max_tokens: int,
             info: Sequence[str]) -> Episode:
    """One sample of an agent's episode as the rollout's ``Episode``."""
    episode = Episode(None)
    for tokens, logprobs in made.pieces:
        room = max_tokens - len(episode.tokens)
        if room <= 0:
            break
        if logprobs is not None:
            episode.add(tokens[:room], logprobs[:room])
        else:
            episode.add(tokens[:room], None, [{"role": "env", "content": tok.decode(
                tokens[:room], skip_special_tokens=True)}])
    episode.turns = made.calls
    if outcome.error is not None:
        episode.mask = [0] * len(episode.mask)
        return episode
    episode.reward = outcome.reward
    last = next((t for t in reversed(episode.log) if t["role"] == "assistant"), None)
    if last is not None:
        last["reward"] = outcome.reward
    episode.info = {key: outcome.info.get(key, 0.0) for key in info}
    return episode
