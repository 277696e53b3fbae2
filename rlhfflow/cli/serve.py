"""``rlhfflow serve``: a model behind an OpenAI-compatible endpoint."""

from __future__ import annotations

import os
import signal
import threading

import click

from rlhfflow.cli.common import UserError, first_line

KEY_VARIABLE = "RLHFFLOW_API_KEY"


@click.command()
@click.argument("model", metavar="MODEL")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback needs an API key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to bind (0: a free one).")
@click.option("--name", default=None, metavar="NAME",
              help="The model's name in requests and responses (default: MODEL's "
                   "directory name).")
@click.option("--api-key", default=None, metavar="KEY",
              help=f"Refuse requests without 'Authorization: Bearer KEY' (default: "
                   f"${KEY_VARIABLE}; none on loopback).")
@click.option("--max-in-flight", default=32, show_default=True, type=click.IntRange(1),
              help="Requests decoded together; more wait in a queue.")
@click.option("--tool-format", default="auto", show_default=True, metavar="FORMAT",
              help="How the model writes tool calls: auto, hermes, qwen3_coder, "
                   "llama3_json, or 'file.py:Class'.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1),
              help="Completion length when a request names none.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seeds the draws of requests that bring no seed of their own.")
def serve(model: str, host: str, port: int, name: str | None, api_key: str | None,
          max_in_flight: int, tool_format: str, max_tokens: int, seed: int) -> None:
    """Serve MODEL (a model directory, a cached Hub id, or a run's checkpoint directory)
    on an OpenAI-compatible endpoint: /v1/chat/completions, /v1/completions, /v1/models.

    Concurrent requests are decoded together (continuous batching). Each choice also
    carries its token_ids and policy_versions, the response its prompt_token_ids, and
    with logprobs each token's log-prob at the request's temperature. Ctrl-C stops it.

    \b
    Examples:
      rlhfflow serve models/smollm2-135m
      rlhfflow serve models/smollm2-135m --port 8001 --name smollm2
      RLHFFLOW_API_KEY=secret rlhfflow serve models/smollm2-135m --host 0.0.0.0
    """
    from rlhfflow.engine.generation import eos_ids
    from rlhfflow.engine.models import load_model
    from rlhfflow.engine.service import GenerationService
    from rlhfflow.engine.toolformats import tool_format as make_format
    from rlhfflow.engine.toolformats import tool_format_problem
    from rlhfflow.serve.endpoint import Endpoint, EndpointSettings

    problem = tool_format_problem(tool_format, os.getcwd())
    if problem:
        raise UserError(f"--tool-format: {problem}")
    api_key = api_key or os.environ.get(KEY_VARIABLE) or None
    try:
        settings = EndpointSettings(model=name or os.path.basename(os.path.normpath(model)),
                                    host=host, port=port, api_key=api_key,
                                    max_tokens=max_tokens)
    except ValueError as exc:
        raise UserError(f"--host: {first_line(exc)} (--api-key or ${KEY_VARIABLE})") from None
    click.echo(f"rlhfflow: loading {model} ...", err=True)
    try:
        module, tokenizer = load_model(model)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise UserError(f"MODEL: {first_line(exc)}") from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        tokenizer.eos_token_id
    # this (main) thread decodes; the HTTP server answers on threads of its own
    service = GenerationService(module, eos=eos_ids(module, tokenizer), pad_id=pad or 0,
                                tokenizer=tokenizer, max_in_flight=max_in_flight, seed=seed,
                                thread=False)
    try:
        endpoint = Endpoint(service, tokenizer, settings, make_format(tool_format, tokenizer,
                                                                       os.getcwd()))
    except OSError as exc:
        service.close()
        raise UserError(f"--port: cannot bind {host}:{port}: {exc.strerror or exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # requests in flight finish first
        signal.signal(sig, lambda *_: stop.set())
    with service, endpoint:
        click.echo(f"rlhfflow: serving {settings.model} at {endpoint.base_url} "
                   f"({'API key required' if api_key else 'no API key: loopback only'}; "
                   f"Ctrl-C stops)", err=True)
        service.drive(stop.is_set)
        click.echo(f"rlhfflow: served {endpoint.requests} requests, "
                   f"{service.stats.tokens} tokens; stopped", err=True)
