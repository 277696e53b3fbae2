"""A generation service: one running decode loop that requests enter and leave at any
step (continuous batching), with weights installed between steps.

A :class:`GenerationService` owns a model and a thread that decodes. ``submit`` queues a
:class:`Request` (prompt token ids and its own sampling settings) and returns a future
of its :class:`Completion`: the sampled tokens, each token's log-prob under the policy
that sampled it, and that policy's **version**. Up to ``max_in_flight`` requests decode
together; when one finishes (EOS, a stop string, ``max_new_tokens``) it leaves the batch
and the next queued one joins at once, so a long request never holds a batch of short
ones back, and a new prompt never waits for the slowest one in flight.

The rows share one KV state (:class:`rlhfflow.engine.turns.TurnBatch`: a join prefills
the joining prompts and merges them in; a finished row's columns are cut out), so a
request's values do not depend on what else decodes beside it beyond float rounding.

``update_weights`` hands the service new weights; they are installed between two decode
steps, the version goes up by one, and the requests in flight go on (partial rollouts):
with ``on_update="recompute"`` (the default, as AReaL does) their KV caches are rebuilt
under the new weights from their prompt and tokens so far, so every later token is the new
policy's exactly; with ``"keep"`` the cache of the old weights stays (cheaper, the keys
and values of earlier tokens are the old policy's). Each token's version says which
policy sampled it.

A request with a ``cache_key`` leaves its KV cache behind when it finishes; the next
request with that key whose prompt begins with the finished one's prompt and completion
(a conversation's next call) joins on that cache and feeds only what follows, as the
multi-turn rollout's rows keep theirs across turns. Caches of old weights are dropped at
an update; ``forget`` drops one, and the oldest go beyond ``4 * max_in_flight``.

Sampling is :func:`rlhfflow.engine.sampling.sample_step`'s arithmetic with one uniform per
output position: a request brings its own uniforms (the stages' counter-based streams) or
a seed; the same request with the same uniforms gives the same tokens whatever else is in
the batch, up to float rounding of batched matrix products.

This is the interface an HTTP endpoint (``rlhfflow.serve``) and any other engine sit
behind: requests in, tokens, log-probs and versions out.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rlhfflow import ops
from rlhfflow.engine.episodes import JOIN_WAIT_STEPS
from rlhfflow.engine.forward import stage_seed
from rlhfflow.engine.sampling import sample_step
from rlhfflow.engine.turns import RowCache, TurnBatch
from rlhfflow.errors import RunError

log = logging.getLogger(__name__)

UPDATE_POLICIES = ("recompute", "keep")
#: when nothing decodes, a prefill waits for requests arriving within this of each other
GATHER_S = 0.005
#: ... for this long at most
GATHER_MAX_S = 0.05


@dataclass(frozen=True)
class SamplingSettings:
    """How one request samples (the fields ``sample_step`` reads, and where it ends)."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    """How many of the likeliest tokens to report at each position, with their log-probs
    (OpenAI's ``top_logprobs``)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be above 0 (or greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")


@dataclass
class Request:
    """A prompt to complete. ``uniforms`` (float64, one per output position, at least
    ``max_new_tokens``) fix the draws; without them they come from ``seed`` (or from the
    service's seed and the request's number)."""

    prompt: list[int]
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    uniforms: torch.Tensor | None = None
    seed: int | None = None
    cache_key: str | None = None
    """Keep the request's KV cache under this key when it finishes; a later request with
    the key whose prompt begins with this one's prompt and completion feeds only what
    follows (a conversation's next call). ``forget`` drops it."""


@dataclass
class Completion:
    """What a request got: ``tokens`` (the EOS or the token that completed a stop string
    included), ``logprobs`` (each under ``log_softmax(logits / temperature)``, the
    distribution the policy loss uses), ``versions`` (the policy version that sampled each
    token), ``finish_reason`` (``stop``: EOS or a stop string; ``length``), when it was
    submitted, joined the batch and finished (``time.monotonic()``), and at each position
    the ``top_logprobs`` likeliest ``(token, log-prob)`` pairs when asked for."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    submitted: float
    started: float
    finished: float
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class ServiceClosed(RunError):
    """The service was closed (or its loop failed) before the request finished."""


@dataclass
class _Row:
    request: Request
    future: concurrent.futures.Future
    uniforms: torch.Tensor
    submitted: float
    started: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class ServiceStats:
    """What the loop did: decode ``steps``, ``rows_stepped`` (the sum over steps of the
    rows decoding), ``joins`` and ``joined`` (requests prefilled into the batch),
    ``finished`` requests, ``tokens`` sampled, ``updates`` installed."""

    steps: int = 0
    rows_stepped: int = 0
    joins: int = 0
    joined: int = 0
    finished: int = 0
    tokens: int = 0
    updates: int = 0
    reused: int = 0
    """Prompt tokens a join did not prefill: they were in a kept cache."""

    def occupancy(self, max_in_flight: int) -> float:
        """The decode batch's mean fill: rows per step over ``max_in_flight``."""
        return self.rows_stepped / (self.steps * max_in_flight) if self.steps else 0.0


class GenerationService:
    """Continuously batched generation on ``module`` (see the module's docstring).

    ``eos``: the ids that end a request (``rlhfflow.engine.generation.eos_ids``);
    ``tokenizer``: needed only for stop strings. Use as a context manager, or ``close()``.
    Create it where the model samples (``with resident.generating():``): the loop's
    thread runs in a copy of the creator's context variables.
    """

    def __init__(self, module: torch.nn.Module, *, eos: Sequence[int] | None, pad_id: int,
                 tokenizer=None, max_in_flight: int = 32, seed: int = 0,
                 on_update: str = "recompute", version: int = 0,
                 name: str = "generation-service", thread: bool = True) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if on_update not in UPDATE_POLICIES:
            raise ValueError(f"on_update must be one of {', '.join(UPDATE_POLICIES)}, "
                             f"got {on_update!r}")
        self.module, self.tokenizer = module, tokenizer
        self.eos = torch.as_tensor(list(eos) if eos else [], dtype=torch.long)
        self.pad_id, self.seed, self.on_update = pad_id, seed, on_update
        self.max_in_flight = max_in_flight
        self.version = version
        self.stats = ServiceStats()
        self._batch = TurnBatch(module)
        self._rows: dict[int, _Row] = {}        # row id -> its state, while decoding
        self._queue: deque[tuple[int, _Row]] = deque()
        self._updates: deque[tuple[Mapping[str, torch.Tensor], int | None,
                                   concurrent.futures.Future]] = deque()
        self._ids = itertools.count()
        self._waited = 0  # decode steps the queued requests have waited
        # cache_key -> (the tokens in the cache, the cache, the version that made it)
        self._kept: OrderedDict[str, tuple[list[int], RowCache, int]] = OrderedDict()
        self._kept_lock = threading.Lock()
        self.max_kept = 4 * max_in_flight
        self._wake = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        if thread:
            # the loop runs in the creator's context: its context variables (the lean
            # forward's sampling kernels, under ``ResidentModel.generating``) hold there
            context = contextvars.copy_context()
            self._thread = threading.Thread(target=context.run, args=(self._loop,),
                                            name=name, daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ callers' side

    def submit(self, request: Request) -> concurrent.futures.Future:
        """Queue ``request``; the future gives its :class:`Completion`."""
        if not request.prompt:
            raise ValueError("a request needs at least one prompt token")
        steps = request.sampling.max_new_tokens
        number = next(self._ids)
        if request.uniforms is not None:
            uniforms = torch.as_tensor(request.uniforms, dtype=torch.float64).flatten()
            if uniforms.numel() < steps:
                raise ValueError(f"a request's uniforms cover {uniforms.numel()} positions, "
                                 f"fewer than max_new_tokens ({steps})")
        else:
            seed = request.seed if request.seed is not None else \
                stage_seed(self.seed, "service", number)
            generator = torch.Generator().manual_seed(seed)
            uniforms = torch.rand(steps, generator=generator, dtype=torch.float64)
        row = _Row(request, concurrent.futures.Future(), uniforms, time.monotonic())
        with self._wake:
            self._check_open()
            self._queue.append((number, row))
            self._wake.notify()
        return row.future

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Submit ``requests`` and wait for all of them."""
        return [future.result() for future in [self.submit(r) for r in requests]]

    def update_weights(self, state: Mapping[str, torch.Tensor],
                       version: int | None = None) -> concurrent.futures.Future:
        """Install ``state`` (parameter name -> tensor, all or some of the model's)
        between two decode steps; the future gives the new version (``version``, or the
        current one plus one) once it is installed: every token sampled after that is
        the new weights'."""
        names = dict(self.module.named_parameters())
        unknown = [name for name in state if name not in names]
        if unknown:
            raise KeyError(f"weights the model does not have: {', '.join(unknown[:5])}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._check_open()
            self._updates.append((state, version, future))
            self._wake.notify()
        return future

    def forget(self, cache_key: str) -> None:
        """Drop the cache kept under ``cache_key`` (its conversation is over)."""
        with self._kept_lock:
            self._kept.pop(cache_key, None)

    @property
    def driven(self) -> bool:
        """Whether the caller runs the loop (``thread=False``, :meth:`drive`)."""
        return self._thread is None

    def drive(self, until: Callable[[], bool]) -> None:
        """Run the decode loop in this thread until ``until()`` is true and nothing is in
        flight (a service made with ``thread=False``; ``wake`` after what ``until``
        reads changes, or it is read every 0.5 s while idle). Measured on a 2-core
        Xeon, the same decode steps took ~30% longer on the service's own thread than on
        the thread of the task that made it (OpenMP's thread team is per calling
        thread), so a task drives its service itself. A failure of the loop fails the
        waiting requests and is raised here."""
        if self._thread is not None:
            raise RuntimeError("this service runs its loop on a thread of its own")
        self._loop(until)
        if self._failure is not None:
            raise ServiceClosed(f"the generation service failed: {self._failure!r}")

    def wake(self) -> None:
        """Let ``drive``'s loop look at its ``until`` now."""
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        """Stop the loop; requests not finished fail with :class:`ServiceClosed`."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._fail_all(None)

    def __enter__(self) -> GenerationService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._failure is not None:
            raise ServiceClosed(f"the generation service failed: {self._failure!r}")
        if self._closed:
            raise ServiceClosed("the generation service is closed")

    # ------------------------------------------------------------------ the loop

    def _loop(self, until: Callable[[], bool] | None = None) -> None:
        try:
            with torch.no_grad():
                while self._next_round(until):
                    pass
        except BaseException as exc:  # noqa: BLE001 - every waiting caller learns of it
            log.exception("the generation service failed")
            self._failure = exc
        if until is None or self._failure is not None:
            self._fail_all(self._failure)

    def _next_round(self, until: Callable[[], bool] | None = None) -> bool:
        """One round: install a pending update, let queued requests join, one decode
        step. False when the service closes (or, driven, when ``until()`` holds with
        nothing in flight)."""
        with self._wake:
            while not (self._closed or self._queue or self._updates or self._rows):
                if until is not None and until():
                    return False
                self._wake.wait(None if until is None else 0.5)
            if not self._rows:
                self._gather()
            if self._closed:
                return False
            updates = list(self._updates)
            self._updates.clear()
            joining = []
            if self._queue and self._joins_now():
                room = self.max_in_flight - len(self._rows)
                joining = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
                self._waited = 0
            elif self._queue:
                self._waited += 1
        for state, version, future in updates:
            self._install(state, version, future)
        if joining:
            self._join(joining)
        if self._batch.rows:
            self._step()
        return True

    def _gather(self) -> None:
        """With nothing decoding, wait for requests sent together, which arrive a little
        apart: while they keep coming (each within ``GATHER_S`` of the last, for
        ``GATHER_MAX_S`` at most), since one prefill of them all costs less than one
        each. Called holding ``_wake``."""
        until = time.monotonic() + GATHER_MAX_S
        seen = -1
        while not self._closed and seen != len(self._queue) < self.max_in_flight:
            seen = len(self._queue)
            left = min(GATHER_S, until - time.monotonic())
            if left <= 0:
                return
            self._wake.wait(left)

    def _joins_now(self) -> bool:
        """Whether queued requests join before this round's step: when nothing decodes,
        when they would fill the batch or are a quarter of the rows decoding, or after
        ``JOIN_WAIT_STEPS`` steps of waiting (a join is a forward of its own: many small
        ones cost more than fewer larger ones, as in the multi-turn rollout)."""
        decoding, waiting = len(self._rows), len(self._queue)
        return not decoding or decoding + waiting >= self.max_in_flight or \
            4 * waiting >= decoding or self._waited >= JOIN_WAIT_STEPS

    def _install(self, state: Mapping[str, torch.Tensor], version: int | None,
                 future: concurrent.futures.Future) -> None:
        params = dict(self.module.named_parameters())
        for name, tensor in state.items():
            params[name].copy_(tensor)
        self.version = version if version is not None else self.version + 1
        self.stats.updates += 1
        with self._kept_lock:  # caches of the old weights: a later call prefills afresh
            self._kept.clear()
        if self.on_update == "recompute" and self._batch.rows:
            self._recompute()
        future.set_result(self.version)

    def _recompute(self) -> None:
        """Rebuild the caches of the rows in flight under the weights just installed:
        each re-prefills its prompt and the tokens it sampled, and its next token is
        drawn from the new weights' logits."""
        rows = list(self._batch.rows)
        self._batch.park(list(range(len(rows))), keep_cache=False)
        blocks = [self._rows[r].request.prompt + self._rows[r].tokens for r in rows]
        # each row's last sampled token is fed with its block: the join gives the logits
        # of its next token, drawn here from the new weights
        self._sample(rows, self._batch.join(rows, [None] * len(rows), blocks, self.pad_id))

    def _join(self, joining: list[tuple[int, _Row]]) -> None:
        """Prefill the joining requests into the batch: those whose kept cache their
        prompt extends feed only the rest, in one forward; the others, in another."""
        now = time.monotonic()
        cached: list[tuple[int, RowCache, list[int]]] = []
        fresh: list[int] = []
        for number, row in joining:
            row.started = now
            self._rows[number] = row
            found = self._take_kept(row.request)
            if found is None:
                fresh.append(number)
            else:
                cache, block = found
                cached.append((number, cache, block))
                self.stats.reused += cache.length
        if cached:
            rows = [number for number, _, _ in cached]
            self._sample(rows, self._batch.join(rows, [c for _, c, _ in cached],
                                                [b for _, _, b in cached], self.pad_id))
        if fresh:
            blocks = [self._rows[number].request.prompt for number in fresh]
            self._sample(fresh, self._batch.join(fresh, [None] * len(fresh), blocks,
                                                 self.pad_id))
        self.stats.joins += 1
        self.stats.joined += len(joining)

    def _take_kept(self, request: Request) -> tuple[RowCache, list[int]] | None:
        """The kept cache ``request`` extends, and the tokens to feed on top of it."""
        if request.cache_key is None:
            return None
        with self._kept_lock:
            kept = self._kept.pop(request.cache_key, None)
        if kept is None:
            return None
        fed, cache, version = kept
        prompt = request.prompt
        if version != self.version or len(prompt) <= len(fed) or prompt[:len(fed)] != fed:
            return None
        return cache, prompt[len(fed):]

    def _step(self) -> None:
        rows = list(self._batch.rows)
        self.stats.steps += 1
        self.stats.rows_stepped += len(rows)
        logits = self._batch.step(torch.tensor([self._rows[r].tokens[-1] for r in rows]))
        self._sample(rows, logits)

    def _sample(self, rows: list[int], logits: torch.Tensor) -> None:
        """Draw each row's next token with its own settings, and let finished rows go."""
        groups: dict[SamplingSettings, list[int]] = {}
        for at, number in enumerate(rows):
            groups.setdefault(self._rows[number].request.sampling, []).append(at)
        tokens = torch.empty(len(rows), dtype=torch.long)
        logprobs = torch.empty(len(rows), dtype=torch.float64)
        for settings, ats in groups.items():
            index = torch.tensor(ats)
            part = logits[index.to(logits.device)]
            uniforms = torch.stack([self._rows[rows[at]].uniforms[
                len(self._rows[rows[at]].tokens)] for at in ats])
            token = sample_step(part, uniforms, settings).cpu()
            every = torch.log_softmax(ops.tempered(part, settings.temperature), -1)
            lp = every.gather(-1, token[:, None].to(part.device))[:, 0].cpu()
            tokens[index], logprobs[index] = token, lp.double()
            if settings.top_logprobs:
                values, ids = every.topk(settings.top_logprobs, -1)
                for at, v, i in zip(ats, values.tolist(), ids.tolist(), strict=True):
                    self._rows[rows[at]].top.append(list(zip(i, v, strict=True)))
        finished = []
        for number, token, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            row = self._rows[number]
            row.tokens.append(token)
            row.logprobs.append(lp)
            row.versions.append(self.version)
            reason = self._finish_reason(row, token)
            if reason is not None:
                finished.append((number, reason))
        self.stats.tokens += len(rows)
        if finished:
            self._finish(finished)

    def _finish_reason(self, row: _Row, token: int) -> str | None:
        settings = row.request.sampling
        if self.eos.numel() and bool((self.eos == token).any()):
            return "stop"
        if settings.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            if any(stop in text for stop in settings.stop):
                return "stop"
        if len(row.tokens) >= settings.max_new_tokens:
            return "length"
        return None

    def _finish(self, finished: list[tuple[int, str]]) -> None:
        at = {number: i for i, number in enumerate(self._batch.rows)}
        keep = [number for number, _ in finished
                if self._rows[number].request.cache_key is not None]
        drop = [number for number, _ in finished
                if self._rows[number].request.cache_key is None]
        # positions shift as rows leave: the kept ones first, then the rest, each parked
        # by its position among the rows still there
        if keep:
            caches = self._batch.park([at[number] for number in keep], keep_cache=True)
            for number, cache in zip(keep, caches, strict=True):
                self._keep(self._rows[number], cache)
        if drop:
            at = {number: i for i, number in enumerate(self._batch.rows)}
            self._batch.park([at[number] for number in drop], keep_cache=False)
        now = time.monotonic()
        for number, reason in finished:
            row = self._rows.pop(number)
            self.stats.finished += 1
            row.future.set_result(Completion(
                row.request.prompt, row.tokens, row.logprobs, row.versions, reason,
                row.submitted, row.started, now, row.top))

    def _keep(self, row: _Row, cache: RowCache | None) -> None:
        """Keep a finished request's cache under its key (the oldest kept go first)."""
        if cache is None:
            return
        fed = (row.request.prompt + row.tokens)[:cache.length]
        with self._kept_lock:
            self._kept[row.request.cache_key] = (fed, cache, self.version)
            self._kept.move_to_end(row.request.cache_key)
            while len(self._kept) > self.max_kept:
                self._kept.popitem(last=False)

    def _fail_all(self, failure: BaseException | None) -> None:
        error = ServiceClosed("the generation service closed before the request finished"
                              if failure is None else
                              f"the generation service failed: {failure!r}")
        with self._wake:
            waiting = [row for _, row in self._queue] + list(self._rows.values())
            self._queue.clear()
            updates = [future for *_, future in self._updates]
            self._updates.clear()
        self._rows.clear()
        for row in waiting:
            if not row.future.done():
                row.future.set_exception(error)
        for future in updates:
            if not future.done():
                future.set_exception(error)
