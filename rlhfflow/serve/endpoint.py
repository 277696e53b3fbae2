"""An OpenAI-compatible HTTP endpoint in front of a generation service.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (and ``GET /v1/models``) as the
OpenAI API defines them, for agents written against the ``openai`` SDK or any other
client of that API. Every request becomes ``n`` requests of one
:class:`~rlhfflow.engine.service.GenerationService`, so concurrent callers are batched
together in its decode loop. Each choice carries what training needs beside the text:
``token_ids`` (the sampled tokens), ``policy_versions`` (the policy version that sampled
each token) and, with ``logprobs``, each token's log-prob under ``log_softmax(logits /
temperature)`` (the distribution the policy loss uses; OpenAI's are at temperature 1 for
some models: here they are always the sampling distribution's); the response carries
``prompt_token_ids`` (the prompt as the chat template rendered and tokenised it).

Tools: ``tools`` are shown to the model through the chat template's ``tools=``, and the
completion is parsed for calls by the endpoint's tool format
(:mod:`rlhfflow.engine.toolformats`, Hermes by default) into ``message.tool_calls``
(``finish_reason: tool_calls``); decoding stops at the format's end-of-call string.
``tool_choice: none`` hides the tools; ``auto``, ``required`` and a named function show
them, and nothing constrains what the model writes. The endpoint remembers the text behind
the calls it issued (by call id, the last ``SAID_KEPT``): an assistant message that comes
back carrying those calls is rendered as the text the model wrote, so the history the
next prompt shows the model is what it said, not the template's re-rendering of
``tool_calls`` (which may differ in spacing or key order, or be dropped by a template
without tools).

Who can reach it: it binds to loopback (127.0.0.1) unless told otherwise, and refuses to
bind elsewhere without an API key; with a key, every request must carry it
(``Authorization: Bearer KEY``). It serves one model, under one name.

Sessions: a training run's agents call ``/sessions/ID/v1/...`` (:meth:`Endpoint.open`
gives each episode its own ``base_url``): a session fixes the sampling settings (the
stage's temperature, whatever the agent asks; ``max_tokens`` capped), draws its uniforms
from the episode's own generator, and records every call (prompt ids, completion ids,
log-probs, versions) in order. A closed session's calls are refused.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from rlhfflow.data.records import prompt_token_ids
from rlhfflow.engine.forward import stage_seed
from rlhfflow.engine.service import Completion, GenerationService, Request, SamplingSettings
from rlhfflow.engine.toolformats import ToolFormat, openai_tool_calls
from rlhfflow.errors import UserError

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: most choices one request may ask for (``n``)
MAX_CHOICES = 64
#: a request's body may be at most this large
MAX_BODY_BYTES = 16 * 2**20
#: the texts behind issued tool calls the endpoint remembers
SAID_KEPT = 10_000


class BadRequest(UserError):
    """A request the endpoint refuses (a caller's mistake): its HTTP status and OpenAI
    error fields."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


@dataclass(frozen=True)
class EndpointSettings:
    """Where and as what the endpoint serves. ``port`` 0 picks a free one;
    ``max_tokens`` is the default completion length when a request names none."""

    model: str = "rlhfflow"
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.host not in LOOPBACK and not self.api_key:
            raise ValueError(f"serving on {self.host} (not loopback) needs an API key: "
                             f"anyone who can reach the port could use the model")


@dataclass
class Call:
    """One choice of one call a session made: the prompt as tokenised, and what the
    service gave."""

    prompt: list[int]
    completion: Completion


@dataclass
class Session:
    """One episode's calls (see the module's docstring): ``sampling`` replaces what a
    request asks (its ``max_new_tokens`` caps the request's ``max_tokens``), and
    ``calls`` grow as they finish. Uniforms come from ``generator`` as one stream per
    episode, the n-th token the episode samples drawing the n-th (as a rollout's row
    does across its turns): a call starts where the calls before it ended; a call made
    while another is in flight starts after what that one may use."""

    sampling: SamplingSettings | None = None
    generator: torch.Generator | None = None
    calls: list[Call] = field(default_factory=list)
    open: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: per call choice, its prompt and completion as text (special tokens kept) and ids
    history: list[tuple[str, list[int]]] = field(default_factory=list)
    #: the id the endpoint serves it under (``open``); its calls' KV caches are kept
    #: under it, so a call that extends the last one feeds only the new tokens
    name: str = ""
    stream: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    drawn: int = 0       # tokens the finished calls sampled, in stream order
    reserved: int = 0    # the stream's end the calls in flight may reach
    in_flight: int = 0

    def draws(self, steps: int) -> tuple[torch.Tensor | None, int]:
        """The uniforms of a call of at most ``steps`` tokens, and where they start."""
        if self.generator is None:
            return None, 0
        with self.lock:
            start = self.reserved if self.in_flight else self.drawn
            end = start + steps
            if end > len(self.stream):  # drawn in order: the same as one long draw
                more = torch.rand(end - len(self.stream), generator=self.generator,
                                  dtype=torch.float64)
                self.stream = torch.cat([self.stream, more])
            self.reserved = max(self.reserved, end)
            self.in_flight += 1
            return self.stream[start:end], start

    def record(self, prompt: list[int], completion: Completion, text: str,
               start: int = 0) -> None:
        """Book a finished choice that drew from ``start``; ``text``: its prompt and
        completion as text."""
        with self.lock:
            self.calls.append(Call(prompt, completion))
            self.history.append((text, prompt + completion.tokens))
            self.in_flight = max(0, self.in_flight - 1)
            self.drawn = max(self.drawn, start + len(completion.tokens))
            if not self.in_flight:
                self.reserved = self.drawn

    def extended(self, text: str) -> tuple[str, list[int]] | None:
        """The latest earlier call whose prompt and completion ``text`` begins with."""
        with self.lock:
            return next(((done, ids) for done, ids in reversed(self.history)
                         if text.startswith(done)), None)


class Endpoint:
    """The HTTP server; ``start()`` serves on a thread and returns ``base_url``
    (``http://HOST:PORT/v1``, what ``openai.OpenAI(base_url=...)`` takes)."""

    def __init__(self, service: GenerationService, tokenizer, settings: EndpointSettings,
                 tool_format: ToolFormat) -> None:
        self.service, self.tokenizer = service, tokenizer
        self.settings, self.tool_format = settings, tool_format
        self.requests = 0
        self.sessions: dict[str, Session] = {}
        self.said: OrderedDict[str, str] = OrderedDict()  # call id -> the text behind it
        self._said_lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"endpoint": self})
        self.server = _Server((settings.host, settings.port), handler)
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/v1"

    def open(self, session: Session) -> str:
        """Serve ``session`` under a new id: its ``base_url``."""
        name = uuid.uuid4().hex
        session.name = name
        self.sessions[name] = session
        return f"{self.base_url.removesuffix('/v1')}/sessions/{name}/v1"

    def close_session(self, session: Session) -> None:
        """Stop serving ``session``; calls it makes later are refused."""
        self.sessions.pop(session.name, None)
        session.open = False
        self.service.forget(session.name)

    def start(self) -> str:
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="rlhfflow-endpoint", daemon=True)
        self._thread.start()
        return self.base_url

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Endpoint:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ routes

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.settings.model, "object": "model",
                                            "created": 0, "owned_by": "rlhfflow"}]}

    def chat(self, body: dict[str, Any], session: Session | None = None) -> dict[str, Any]:
        self._check_model(body, session)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) and "role" in m for m in messages):
            raise BadRequest("'messages' must be a non-empty list of {role, content}",
                             param="messages")
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(
                isinstance(t, dict) and t.get("type") == "function" for t in tools)):
            raise BadRequest("'tools' must be a list of {type: function, function: {...}}",
                             param="tools")
        shown = None if body.get("tool_choice") == "none" else tools
        try:
            text = self.tokenizer.apply_chat_template(
                [self._template_message(m) for m in messages], tools=shown,
                add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template's own error, to the caller
            raise BadRequest(f"the chat template cannot render these messages: {exc}",
                             param="messages") from None
        prompt = self._prompt_ids(text, True, session)
        stops = _stops(body)
        if shown and self.tool_format.stop:
            stops = (*stops, self.tool_format.stop)
        top = body.get("top_logprobs") or 0
        settings = self._sampling(body, body.get("max_completion_tokens",
                                                 body.get("max_tokens")), stops, top, session)
        completions = self._complete(prompt, settings, body, session, text)
        choices = []
        for i, done in enumerate(completions):
            content = self.tokenizer.decode(done.tokens, skip_special_tokens=True)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            reason = done.finish_reason
            if shown:
                calls, _ = openai_tool_calls(self.tool_format, content, shown)
                if calls:
                    calls = self._issued(calls, content)
                    message["tool_calls"] = calls
                    message["content"] = _before_calls(content, self.tool_format)
                    reason = "tool_calls"
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": reason,
                                      "logprobs": None, "token_ids": done.tokens,
                                      "policy_versions": done.versions}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {**self._token(t), "logprob": lp,
                     "top_logprobs": [{**self._token(a), "logprob": b} for a, b in top_at]}
                    for t, lp, top_at in zip(done.tokens, done.logprobs,
                                             done.top_logprobs or [[]] * len(done.tokens),
                                             strict=True)]}
            choices.append(choice)
        return self._response("chat.completion", "chatcmpl", prompt, completions, choices)

    def completions(self, body: dict[str, Any], session: Session | None = None
                    ) -> dict[str, Any]:
        self._check_model(body, session)
        if body.get("echo"):
            raise BadRequest("'echo' is not served", param="echo")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._prompt_ids(prompt, False, session)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be one string or one list of token ids",
                             param="prompt")
        top = body.get("logprobs") or 0
        settings = self._sampling(body, body.get("max_tokens"), _stops(body), top, session)
        completions = self._complete(ids, settings, body, session,
                                     prompt if isinstance(prompt, str) else None)
        choices = []
        for i, done in enumerate(completions):
            text = self.tokenizer.decode(done.tokens, skip_special_tokens=True)
            choice: dict[str, Any] = {"index": i, "text": text,
                                      "finish_reason": done.finish_reason, "logprobs": None,
                                      "token_ids": done.tokens,
                                      "policy_versions": done.versions}
            if body.get("logprobs") is not None:
                pieces = [self._token(t)["token"] for t in done.tokens]
                offsets = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
                choice["logprobs"] = {
                    "tokens": pieces, "token_logprobs": done.logprobs,
                    "top_logprobs": [{self._token(a)["token"]: b for a, b in at}
                                     for at in done.top_logprobs] or None,
                    "text_offset": offsets}
            choices.append(choice)
        return self._response("text_completion", "cmpl", ids, completions, choices)

    # ------------------------------------------------------------------ helpers

    def _check_model(self, body: dict[str, Any], session: Session | None = None) -> None:
        model = body.get("model")
        # a session serves the policy under whatever name the agent was written with
        if session is None and model is not None and model != self.settings.model:
            raise BadRequest(f"the model {model!r} is not served here; this endpoint serves "
                             f"{self.settings.model!r}", HTTPStatus.NOT_FOUND, "model",
                             "model_not_found")
        if body.get("stream"):
            raise BadRequest("'stream: true' is not served; ask without stream",
                             param="stream")

    def _sampling(self, body: dict[str, Any], max_tokens: Any, stops: tuple[str, ...],
                  top: Any, session: Session | None = None) -> SamplingSettings:
        if session is not None and session.sampling is not None:
            fixed = session.sampling
            cap = fixed.max_new_tokens
            if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
                cap = max(1, min(cap, max_tokens))
            if not isinstance(top, int) or not 0 <= top <= 20:
                raise BadRequest("'top_logprobs' must be an integer in [0, 20]")
            return replace(fixed, max_new_tokens=cap, stop=(*fixed.stop, *stops),
                           top_logprobs=top)
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        top_p = body.get("top_p")
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise BadRequest("'temperature' must be a number in [0, 2]", param="temperature")
        try:
            return SamplingSettings(
                max_new_tokens=int(max_tokens if max_tokens is not None
                                   else self.settings.max_tokens),
                temperature=float(temperature) if temperature > 0 else 1.0,
                greedy=float(temperature) == 0.0, top_p=float(1.0 if top_p is None else top_p),
                stop=stops, top_logprobs=int(top))
        except (TypeError, ValueError) as exc:
            raise BadRequest(str(exc)) from None

    def _complete(self, prompt: list[int], settings: SamplingSettings,
                  body: dict[str, Any], session: Session | None = None,
                  text: str | None = None) -> list:
        n = 1 if body.get("n") is None else body["n"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"'n' must be an integer in [1, {MAX_CHOICES}]", param="n")
        room = _positions(self.service.module) - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt has {len(prompt)} tokens, more than the model's "
                             f"context allows", param="messages")
        if settings.max_new_tokens > room:
            settings = replace(settings, max_new_tokens=room)
        seed = body.get("seed")
        self.requests += 1
        # one choice continues a session's conversation: its cache is kept for the next call
        key = session.name if session is not None and n == 1 else None
        draws = [session.draws(settings.max_new_tokens) if session is not None else (None, 0)
                 for _ in range(n)]
        futures = [self.service.submit(Request(
            prompt, settings, seed=None if seed is None else stage_seed(int(seed), i),
            uniforms=draws[i][0], cache_key=key))
            for i in range(n)]
        done = [future.result() for future in futures]
        if session is not None:
            text = self.tokenizer.decode(prompt) if text is None else text
            for completion, (_, start) in zip(done, draws, strict=True):
                said = self.tokenizer.decode(completion.tokens, skip_special_tokens=False)
                session.record(prompt, completion, text + said, start)
        return done

    def _prompt_ids(self, text: str, templated: bool, session: Session | None
                    ) -> list[int]:
        """``text``'s token ids. In a session, a prompt that begins with an earlier
        call's prompt and completion takes their ids as they were (the tokens the model
        saw and sampled), and only the rest is tokenised: re-tokenising the whole text
        could merge tokens across the boundary, and the history would not be what the
        model said at token level."""
        found = session.extended(text) if session is not None else None
        if found is None:
            return prompt_token_ids(self.tokenizer, text, templated=templated)
        done, ids = found
        return ids + self.tokenizer(text[len(done):], add_special_tokens=False)["input_ids"]

    def _response(self, kind: str, prefix: str, prompt: list[int], completions: list,
                  choices: list[dict[str, Any]]) -> dict[str, Any]:
        produced = sum(len(c.tokens) for c in completions)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.settings.model,
                "choices": choices, "prompt_token_ids": prompt,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": produced,
                          "total_tokens": len(prompt) + produced}}

    def _issued(self, calls: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
        """``calls`` with ids of their own, the ``text`` behind them remembered."""
        calls = [{**call, "id": f"call_{uuid.uuid4().hex[:24]}"} for call in calls]
        with self._said_lock:
            for call in calls:
                self.said[call["id"]] = text
            while len(self.said) > SAID_KEPT:
                self.said.popitem(last=False)
        return calls

    def _template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """An OpenAI message as chat templates take it: ``content`` None as ``""``, a
        list of text parts joined, tool-call arguments as objects (OpenAI sends JSON
        text); an assistant message carrying calls this endpoint issued, as the text the
        model wrote."""
        out = dict(message)
        calls = out.get("tool_calls") or []
        ids = [call.get("id") for call in calls if isinstance(call, dict)]
        with self._said_lock:
            said = {self.said.get(i) for i in ids}
        if out.get("role") == "assistant" and ids and len(said) == 1 and None not in said:
            return {"role": "assistant", "content": said.pop()}
        content = out.get("content")
        if content is None:
            out["content"] = ""
        elif isinstance(content, list):
            out["content"] = "".join(part.get("text", "") for part in content
                                     if isinstance(part, dict))
        if calls:
            out["tool_calls"] = [_template_call(call) for call in calls]
        return out

    def _token(self, token: int) -> dict[str, Any]:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "bytes": list(text.encode())}


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > 4:
        raise BadRequest("'stop' must be a string or a list of up to 4 strings", param="stop")
    return tuple(stops)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def _before_calls(text: str, fmt: ToolFormat) -> str | None:
    """The text a model wrote before its first call (None when it wrote only calls)."""
    start = getattr(fmt, "start", None)
    head = text.split(start, 1)[0] if start and start in text else ""
    return head.strip() or None


def _positions(module) -> int:
    config = getattr(module, "config", None)
    return int(getattr(config, "max_position_embeddings", None) or 2**31)


class _Server(ThreadingHTTPServer):
    """A thread per connection; a listen backlog for many agents connecting at once
    (the standard library's 5 refuses some of 16 agents that start together)."""

    daemon_threads = True
    request_queue_size = 1024


class _Handler(BaseHTTPRequestHandler):
    endpoint: Endpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("endpoint: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer({"/v1/models": lambda body, session: self.endpoint.models()},
                     read=False)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self._answer({"/v1/chat/completions": self.endpoint.chat,
                      "/v1/completions": self.endpoint.completions})

    def _route(self) -> tuple[str, Session | None]:
        """The path without the query and a session's prefix, and the session."""
        path = self.path.split("?", 1)[0].rstrip("/")
        if not path.startswith("/sessions/"):
            return path, None
        _, _, name, *rest = path.split("/")
        session = self.endpoint.sessions.get(name)
        if session is None or not session.open:
            raise BadRequest("no such session: the episode it served is over",
                             HTTPStatus.NOT_FOUND)
        return "/" + "/".join(rest), session

    def _answer(self, routes: dict[str, Any], read: bool = True) -> None:
        try:
            self._authorise()
            path, session = self._route()
            if path not in routes:
                raise BadRequest(f"no route {self.command} {self.path}", HTTPStatus.NOT_FOUND)
            body = self._body() if read else {}
            self._send(HTTPStatus.OK, routes[path](body, session))
        except BadRequest as exc:
            self._send(exc.status, {"error": {"message": str(exc), "type": exc.kind,
                                              "param": exc.param, "code": None}})
        except Exception as exc:  # noqa: BLE001 - the caller gets a 500, the server lives
            log.exception("endpoint: %s %s failed", self.command, self.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {
                "message": f"{type(exc).__name__}: {exc}", "type": "server_error",
                "param": None, "code": None}})

    def _authorise(self) -> None:
        key = self.endpoint.settings.api_key
        if not key:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise BadRequest("a valid API key is needed (Authorization: Bearer KEY)",
                             HTTPStatus.UNAUTHORIZED, kind="authentication_error")

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes",
                             HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
