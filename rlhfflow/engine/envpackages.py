"""Environments of existing packages as rollout environments: GEM (``gem-llm``,
:class:`GemEnv`) and SkyRL-gym (``skyrl-gym``, :class:`SkyRLGymEnv`), each run unchanged
behind the two hooks of :class:`~rlhfflow.engine.environments.Environment`, and
:class:`PackageEnv`, which takes either package's environments by a ``package:id`` name.

Which environment plays an episode is chosen per record: the record's field (``env_id``
for GEM, ``env_class`` as in SkyRL's data sets, ``env`` for :class:`PackageEnv`) names it,
else ``env_kwargs.env_id``; one run can mix environments. Each package's
``(observation, reward, done, info)`` becomes the rollout's step tuple; an environment
that scores only at its end gives that reward on its last step, which the rollout adds to
``env_reward`` and to the last model turn's ``turn_rewards`` (an episode cut first by
``max_turns`` or ``max_tokens`` gets none of it). The packages are extras
(``pip install 'rlhfflow[gem]'``, ``'rlhfflow[skyrl-gym]'``), imported only when an
episode starts. Validation checks them through the hook the rollout calls on an
environment class that has one, :meth:`PackageEnv.check_env_kwargs`: the package
installed, ``env_kwargs`` that fit, an ``env_id`` the package knows.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import importlib.util
import inspect
import json
import logging
import random
import threading
import zlib
from typing import Any, ClassVar

import numpy as np

from rlhfflow.errors import UserError

Message = dict[str, str]


class UnknownEnvironment(UserError):
    """A record names an environment its package does not have, or none at all."""


class PackageEnv:
    """An environment of an installed package, one per episode. The record's ``field``
    names its id, else ``env_id``; the rest of ``env_kwargs`` (``options``) goes to the
    package's constructor. Used directly, ids are ``package:id`` (``gem:game:Sudoku-v0-
    easy``, ``skyrl-gym:gsm8k``) and ``options`` holds each package's under its name
    (``{gem: {...}, skyrl-gym: {...}}``). Subclasses are one package each."""

    #: the distribution on PyPI, the module it installs, the rlhfflow extra that brings it
    package: ClassVar[str] = ""
    module: ClassVar[str] = ""
    extra: ClassVar[str] = ""
    #: the record field that names the environment
    field: ClassVar[str] = "env"

    def __init__(self, env_id: str | None = None, field: str | None = None,
                 **options: Any) -> None:
        self.env_id = env_id
        self.record_field = field or type(self).field
        self.options = options
        self.inner: PackageEnv | None = None

    @classmethod
    def known_ids(cls) -> list[str]:
        """The environment ids the package registers (the package is imported)."""
        return [f"{name}:{env_id}" for name, adapter in ADAPTERS.items()
                if importlib.util.find_spec(adapter.module) is not None
                for env_id in adapter.known_ids()]

    @classmethod
    def check_env_kwargs(cls, kwargs: dict[str, Any]) -> tuple[str, str] | None:
        """``(key under params, message)`` if this class cannot play with ``kwargs``
        (``env_kwargs``): its package is not installed, a keyword it does not take, or an
        ``env_id`` its package does not know. The rollout's ``check_params`` calls it."""
        if cls.module and importlib.util.find_spec(cls.module) is None:
            return ("env", f"{cls.__name__} needs the package {cls.package}, which is not "
                           f"installed: pip install 'rlhfflow[{cls.extra}]'")
        try:
            inspect.signature(cls).bind(**kwargs)
        except TypeError as exc:
            return ("env_kwargs", f"{cls.__name__}: {exc}")
        if cls is PackageEnv:
            for name, options in kwargs.items():
                if name in ("env_id", "field"):
                    continue
                if name not in ADAPTERS or not isinstance(options, dict):
                    return (f"env_kwargs.{name}", "expected a package's options, "
                            f"{{{', '.join(sorted(ADAPTERS))}}}: {{keyword: value}}")
                key, problem = ADAPTERS[name].check_env_kwargs(options) or ("", None)
                if problem:  # the package's own key under its options ("env": them all)
                    return (f"env_kwargs.{name}{key.removeprefix('env').removeprefix('_kwargs')}",
                            problem)
        env_id = kwargs.get("env_id")
        if env_id is not None:
            problem = cls.id_problem(env_id)
            if problem:
                return ("env_kwargs.env_id", problem)
        return None

    @classmethod
    def id_problem(cls, env_id: Any) -> str | None:
        """Why ``env_id`` names no environment of the package, or None."""
        if cls is PackageEnv:
            name, _, rest = str(env_id).partition(":")
            if name not in ADAPTERS:
                return f"{env_id!r} is not 'package:id' with a package of " \
                       f"{', '.join(sorted(ADAPTERS))}"
            adapter = ADAPTERS[name]
            if importlib.util.find_spec(adapter.module) is None:
                return f"{env_id!r} needs the package {adapter.package}, which is not " \
                       f"installed: pip install 'rlhfflow[{adapter.extra}]'"
            return adapter.id_problem(rest)
        known = cls.known_ids()
        if env_id in known:
            return None
        near = difflib.get_close_matches(str(env_id), known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return f"{cls.package} has no environment {env_id!r} ({hint}{len(known)} known: " \
               f"{', '.join(known[:8])}{', ...' if len(known) > 8 else ''})"

    def chosen(self, record: dict[str, Any]) -> str:
        """The id of the environment that plays ``record``'s episode (checked)."""
        env_id = record.get(self.record_field, self.env_id)
        if env_id is None:
            raise UnknownEnvironment(
                f"{type(self).__name__}: the record has no field {self.record_field!r} "
                "naming its environment, and params.env_kwargs.env_id gives none")
        problem = self.id_problem(env_id)
        if problem:
            raise UnknownEnvironment(f"{type(self).__name__}, the record's field "
                                     f"{self.record_field!r}: {problem}")
        return str(env_id)

    def reset(self, record: dict[str, Any]) -> list[Message] | str:
        """Make the record's environment and start its episode."""
        package, _, env_id = self.chosen(record).partition(":")
        adapter = ADAPTERS[package]
        self.inner = adapter(env_id, **self.options.get(package, {}))
        return self.inner.reset({**record, adapter.field: env_id})

    def step(self, text: str) -> tuple[list[Message] | str, float, bool, dict]:
        """The record's environment's answer to the model's turn."""
        assert self.inner is not None, "step before reset"
        return self.inner.step(text)


class GemEnv(PackageEnv):
    """A GEM environment (``gem.make(env_id, **options)``; its games, e.g.
    ``game:GuessTheNumber-v0-easy``, need nothing else; its math, code and QA sets
    download data sets). ``reset`` seeds it with the record's ``seed`` field, else a hash
    of the record, so every sample of a prompt plays the same task, and shows its first
    observation unless the prompt already holds it (a data set made by
    :meth:`prompt_records`). Each observation is one message, ``user`` (``tool`` where
    GEM's info says ``use_tool``), with GEM's ``suffix`` after it as its chat wrapper
    adds it; ``done`` is ``terminated or truncated``; ``info`` is GEM's, plus
    ``truncated`` (0/1). GEM seeds Python's and numpy's global generators: each
    episode's calls run on generators of its own, so other code's draws and other
    episodes' are not moved (the calls of all episodes take a lock in turn)."""

    package, module, extra, field = "gem-llm", "gem", "gem", "env_id"

    def __init__(self, env_id: str | None = None, field: str | None = None,
                 **options: Any) -> None:
        super().__init__(env_id, field, **options)
        self.env: Any = None
        self.randomness = OwnRandomness()

    @classmethod
    def known_ids(cls) -> list[str]:
        """GEM's registered ids."""
        return list(_import("gem.envs.registration").ENV_REGISTRY)

    @classmethod
    def prompt_records(cls, env_id: str, seeds: list[int], **options: Any
                       ) -> list[dict[str, Any]]:
        """Records of a prompt data set for ``env_id``: each seed's first observation
        (with GEM's suffix) as the ``prompt``, its ``seed`` and ``env_id``, so the
        episodes open on the task without an extra turn."""
        records = []
        for seed in seeds:
            env = cls(env_id, **options)
            opening = env.reset({"seed": seed})
            records.append({"prompt": opening[0]["content"], "seed": seed, "env_id": env_id})
        return records

    def reset(self, record: dict[str, Any]) -> list[Message]:
        """Make and reset the record's environment."""
        gem = _import("gem")
        seed = record.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            seed = zlib.crc32(json.dumps(record, sort_keys=True, default=str).encode())
        with self.randomness:
            self.env = gem.make(self.chosen(record), **self.options)
            observation, info = self.env.reset(seed=seed)
        text = _with_suffix(observation, info)
        if str(observation) in str(record.get("prompt", "")):
            return []
        return [{"role": "tool" if info.get("use_tool") else "user", "content": text}]

    def step(self, text: str) -> tuple[list[Message], float, bool, dict]:
        """GEM's ``step``, as the rollout's tuple."""
        with self.randomness:
            observation, reward, terminated, truncated, info = self.env.step(text)
        info = dict(info or {})
        message = {"role": "tool" if info.get("use_tool") else "user",
                   "content": _with_suffix(observation, info)}
        info["truncated"] = int(bool(truncated))
        return [message], float(reward), bool(terminated or truncated), info


class SkyRLGymEnv(PackageEnv):
    """A SkyRL-gym environment (``skyrl_gym.make(env_id, env_config=..., extras=...)``,
    e.g. ``gsm8k`` or ``gsm8k_multi_turn``), given the record as SkyRL's generator gives
    a data set row: ``extras`` are its fields but ``prompt`` and the one naming the
    environment (``env_class``, as in SkyRL's data), so a SkyRL data set's rows
    (``reward_spec: {ground_truth: ...}``, ``extra_info``) work as they are. ``init``
    gets the prompt as one user message; messages it adds after it are shown before the
    model's first turn. ``step``'s observations are the messages, its ``metadata`` the
    info, with the environment's ``get_metrics()`` added on the last step; ``close`` is
    called then."""

    package, module, extra, field = "skyrl-gym", "skyrl_gym", "skyrl-gym", "env_class"

    def __init__(self, env_id: str | None = None, field: str | None = None,
                 env_config: dict[str, Any] | None = None) -> None:
        super().__init__(env_id, field)
        self.env_config = env_config or {}
        self.env: Any = None

    @classmethod
    def known_ids(cls) -> list[str]:
        """SkyRL-gym's registered ids."""
        return list(_import("skyrl_gym").registry)

    def reset(self, record: dict[str, Any]) -> list[Message]:
        """Make the record's environment and ``init`` it with the prompt."""
        skyrl_gym, omegaconf = _import("skyrl_gym"), _import("omegaconf")
        env_id = self.chosen(record)
        extras = {k: copy.deepcopy(v) for k, v in record.items()
                  if k not in ("prompt", self.record_field)}
        self.env = skyrl_gym.make(env_id, env_config=omegaconf.OmegaConf.create(
            self.env_config), extras=extras)
        prompt = [{"role": "user", "content": str(record.get("prompt", ""))}]
        conversation, _ = self.env.init(copy.deepcopy(prompt))
        conversation = list(conversation or [])
        return conversation[len(prompt):] if conversation[:len(prompt)] == prompt else []

    def step(self, text: str) -> tuple[list[Message], float, bool, dict]:
        """SkyRL's ``step`` output, as the rollout's tuple."""
        out = self.env.step(text)
        done = bool(out["done"])
        info = dict(out.get("metadata") or {})
        if done:
            info.update(self.env.get_metrics() or {})
            self.env.close()
        return list(out.get("observations") or []), float(out["reward"]), done, info


#: The packages :class:`PackageEnv` dispatches to, by the prefix of a ``package:id``.
ADAPTERS: dict[str, type[PackageEnv]] = {"gem": GemEnv, "skyrl-gym": SkyRLGymEnv}


def _with_suffix(observation: Any, info: dict[str, Any]) -> str:
    """A GEM observation as its chat wrapper shows it: with ``info["suffix"]`` after."""
    text = str(observation)
    suffix = info.get("suffix")
    if suffix:
        text = f"{text}{'' if text.endswith(chr(10)) else chr(10)}{suffix}"
    return text


def _import(name: str) -> Any:
    """``importlib.import_module(name)``, with the root logger left as it was: ``gem``'s
    ``__init__`` calls ``logging.basicConfig(level=INFO)``, which would print every
    library's INFO lines in a process that configured no logging."""
    root = logging.getLogger()
    guard = logging.NullHandler() if not root.handlers else None
    if guard is not None:
        root.addHandler(guard)  # basicConfig does nothing when the root has a handler
    try:
        return importlib.import_module(name)
    finally:
        if guard is not None:
            root.removeHandler(guard)


_GLOBAL_RANDOM = threading.Lock()


class OwnRandomness:
    """A context in which Python's ``random`` and numpy's global generator are this
    object's own: entered, they hold its state (first: the state they had); left, its
    state is kept and theirs put back. One lock serialises the contexts of all threads."""

    def __init__(self) -> None:
        self.state: tuple[Any, Any] | None = None
        self.outer: tuple[Any, Any] | None = None

    def __enter__(self) -> OwnRandomness:
        _GLOBAL_RANDOM.acquire()
        self.outer = random.getstate(), np.random.get_state()
        if self.state is not None:
            random.setstate(self.state[0])
            np.random.set_state(self.state[1])
        return self

    def __exit__(self, *exc: object) -> None:
        self.state = random.getstate(), np.random.get_state()
        assert self.outer is not None
        random.setstate(self.outer[0])
        np.random.set_state(self.outer[1])
        _GLOBAL_RANDOM.release()
