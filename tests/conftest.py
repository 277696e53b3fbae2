"""Fixtures and helpers shared by the tests: tiny saved models, a model store, source
batches built like the data source builds them, and small copies of the example pipelines.

Everything is real (transformers checkpoints on disk, zarr, Dask) and seeded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process (this one, Dask workers, subprocesses): tiny models gain
# nothing from more, and several multi-threaded processes on 2 cores spin-wait each other
# into 5x slower runs. It also keeps float results independent of the machine's cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# `rlhfflow run` subprocesses import for themselves, as before the warm server: one server
# per environment a test sets up would leave a dozen behind (tests/launch/test_warm.py tests it)
os.environ.setdefault("RLHFFLOW_WARM", "0")
# Dask worker processes inherit the environment: as in the product, keep their logs quiet
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from rlhfflow.cli.common import configure_logging  # noqa: E402
from rlhfflow.config.yamlfile import apply_overrides  # noqa: E402
from rlhfflow.data.records import encode_prompts, pad_prompts, prompt_token_ids  # noqa: E402
from rlhfflow.engine.models import build_char_tokenizer, build_tiny_model, save_model  # noqa: E402
from rlhfflow.stages import Batch, ModelConfig, ModelStore  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
DATA = CONFIGS / "data"

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """Start the fork server that embedded clusters and gang tests fork their workers from
    now, while the test modules are collected: its own imports (torch, the stages) take
    well over 10 s on a loaded 2-core machine and otherwise fall inside the first
    cluster's 30 s worker start-up timeout (seen under pytest-xdist)."""
    if config.getoption("numprocesses", default=None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no tests
    import sys

    from rlhfflow.launch.forkserver import start_fork_server

    # the server's path is the one it starts with: the tests package must be on it (as
    # pytest puts it there only when it collects), for workers unpickling test functions
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    start_fork_server()


@pytest.fixture(autouse=True)
def _cli_logging():
    """Progress lines reach stderr as the ``rlhfflow`` command prints them, at the normal
    level in every test (a test of ``--quiet`` must not silence the next one)."""
    configure_logging("normal")
    yield


@pytest.fixture(scope="session")
def tokenizer():
    """The character tokenizer every tiny model uses."""
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama LM (seed 0) saved in transformers format."""
    path = tmp_path_factory.mktemp("models") / "tiny-lm"
    save_model(build_tiny_model(tokenizer, "lm", seed=0), tokenizer, path)
    return path


@pytest.fixture(scope="session")
def tiny_value_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama with a value head (seed 1), e.g. a reward model."""
    path = tmp_path_factory.mktemp("models") / "tiny-value"
    save_model(build_tiny_model(tokenizer, "value", seed=1), tokenizer, path)
    return path


@pytest.fixture
def store(tiny_lm_dir, tiny_value_dir) -> ModelStore:
    """A fresh store (nothing loaded yet): trainable actor, frozen reference, a trainable
    critic initialised from the LM (zero value head), a frozen reward model."""
    lm = str(tiny_lm_dir)
    return ModelStore({
        "actor": ModelConfig("actor", "lm", lm, trainable=True, optimizer={"lr": 1e-3}),
        "ref": ModelConfig("ref", "lm", lm),
        "critic": ModelConfig("critic", "value", init_path=lm, trainable=True,
                              optimizer={"lr": 1e-3}),
        "rm": ModelConfig("rm", "value", str(tiny_value_dir)),
    })


def peaked_model(tokenizer, seed: int, scale: float = 40.0):
    """A tiny Llama whose next-token distributions are peaked: greedy ties and near-ties,
    which another kernel or a drafter's arithmetic could break another way, become rare."""
    model = build_tiny_model(tokenizer, "lm", seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def padded_ids(rows: int = 5, length: int = 14, seed: int = 0):
    """Random ids with left padding on some rows (the prompt layout): ids, mask and the
    positions counted over real tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 30, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[-1, :2] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def make_prompt_batch(tokenizer: Any, texts: Sequence[str], samples: int = 1,
                      prompt_index: Sequence[int] | None = None,
                      max_prompt_tokens: int = 64) -> Batch:
    """Source columns for ``texts``, one row per (prompt, sample), as ``PromptSource``
    builds them. ``prompt_index`` gives each text's index in its (imaginary) data file
    (default: its position), which seeds its samples."""
    indices = list(range(len(texts))) if prompt_index is None else list(prompt_index)
    assert len(indices) == len(texts)
    rows = [(text, index, s) for text, index in zip(texts, indices, strict=True)
            for s in range(samples)]
    prompt_texts = [text for text, _, _ in rows]
    ids, mask = encode_prompts(tokenizer, prompt_texts, max_prompt_tokens)
    return {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "prompt_index": torch.tensor([index for _, index, _ in rows]),
        "sample_index": torch.tensor([s for _, _, s in rows]),
        "group_ids": torch.tensor([index for _, index, _ in rows]),
        "prompt_text": prompt_texts,
        "prompt_fields": ["{}"] * len(rows),
    }


def small_pipeline(tmp_path: Path, config: str = "ppo", *, iterations: int = 2,
                   batch_size: int = 8, max_new_tokens: int = 8,
                   overrides: Mapping[str, Any] | None = None,
                   file_name: str | None = None) -> Path:
    """Write a small copy of ``configs/{config}-tiny.yaml`` into ``tmp_path`` and return
    its path: absolute prompts path, ``batch_size`` prompts, ``iterations`` iterations,
    ``max_new_tokens`` tokens, output in ``tmp_path/out``, a dashboard on a free port,
    one torch thread per worker.
    ``overrides`` maps dotted keys (``"stages.reward.retries"``) to values."""
    data = yaml.safe_load((CONFIGS / f"{config}-tiny.yaml").read_text())
    settings = {
        "data.prompts": str(DATA / "prompts.jsonl"),
        "data.batch_size": batch_size,
        "iterations": iterations,
        "stages.generate.params.max_new_tokens": max_new_tokens,
        "output": str(tmp_path / "out"),
        "cluster.dashboard_address": "127.0.0.1:0",
        "cluster.torch_threads": 1,
    }
    data = apply_overrides(data, {**settings, **(overrides or {})})
    path = tmp_path / (file_name or f"{config}-small.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# A ChatML-like template over the character tokenizer's alphabet (it has no newline), with
# the BOS in front as Llama-3 and Gemma templates put it: rendering must not double it.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}: "
                 "{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")


def chat_tokenizer():
    """The character tokenizer with ``<|im_start|>``/``<|im_end|>`` and a chat template."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def chat_lm_dir(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer has a chat template and whose generation
    config ends a turn at ``<|im_end|>`` too (as chat models do)."""
    tok = chat_tokenizer()
    model = build_tiny_model(tok, "lm", seed=0)
    model.generation_config.eos_token_id = [tok.eos_token_id,
                                            tok.convert_tokens_to_ids("<|im_end|>")]
    path = tmp_path_factory.mktemp("models") / "chat-lm"
    save_model(model, tok, path)
    return path


@pytest.fixture(scope="module")
def cluster():
    """Two device workers in their own processes, shared by the tests of a module: the
    embedded cluster a run starts, whose workers are forks of a server that imported
    torch and the stages once (spawned workers each paid those imports, ~10 s a module)."""
    from rlhfflow.runtime.cluster import local_cluster

    with local_cluster(2, dashboard_address="127.0.0.1:0", torch_threads=1) as cluster:
        yield cluster


def torch_and_deepspeed_runs(cluster, tmp_path: Path,
                             overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The PPO pipeline (2 iterations, colocated on ``cluster``'s two workers) run twice,
    its actor trained by the torch backend and by DeepSpeed ZeRO-2 over the gang:
    ``{"torch": result, "deepspeed": result}``. Skips without DeepSpeed."""
    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.runtime.run import run_pipeline

    pytest.importorskip("deepspeed", reason="pip install 'rlhfflow[deepspeed]'")
    runs = {}
    for backend in ("torch", "deepspeed"):
        (tmp_path / backend).mkdir()
        settings = {"placement.strategy": "colocated",
                    "cluster.address": cluster.scheduler_address, **(overrides or {})}
        if backend == "deepspeed":
            settings.update({"stages.train_actor.backend": "deepspeed",
                             "stages.train_actor.deepspeed": {"zero_stage": 2}})
        path = small_pipeline(tmp_path / backend, "ppo", iterations=2, overrides=settings)
        runs[backend] = run_pipeline(load_pipeline(path), progress=False, overwrite=True)
    return runs


def example_module(example: str, name: str):
    """Import ``examples/EXAMPLE/NAME.py`` (an example is no package) under a name of its
    own, ``EXAMPLE_NAME``."""
    path = REPO / "examples" / example / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{example}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount``'s ``-o size=``, e.g. ``"6m"``) mounted at ``mount``
    (made here) for the block, unmounted after; the test is skipped where mounting needs
    a root this process lacks."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def chat_store(chat_lm_dir) -> ModelStore:
    """A store with a trainable ``actor``: the chat model of ``chat_lm_dir``."""
    return ModelStore({"actor": ModelConfig("actor", "lm", str(chat_lm_dir), trainable=True,
                                            optimizer={"lr": 1e-3})})


def chat_batch(tok, texts, samples=2, secrets=None) -> dict:
    """Source columns of chat prompts, rendered with the template as the data source
    does; each prompt's record holds its ``secret`` (default 3, which a random model
    does not say)."""
    rows = [(i, s) for i in range(len(texts)) for s in range(samples)]
    rendered = [tok.apply_chat_template([{"role": "user", "content": texts[i]}],
                                        add_generation_prompt=True, tokenize=False)
                for i, _ in rows]
    ids, mask = pad_prompts([prompt_token_ids(tok, t, templated=True) for t in rendered],
                            tok.pad_token_id)
    secrets = secrets or [3] * len(texts)
    return {"prompt_ids": ids, "prompt_mask": mask,
            "prompt_index": torch.tensor([i for i, _ in rows]),
            "sample_index": torch.tensor([s for _, s in rows]),
            "group_ids": torch.tensor([i for i, _ in rows]), "prompt_text": rendered,
            "prompt_fields": [json.dumps({"secret": secrets[i]}) for i, _ in rows]}
