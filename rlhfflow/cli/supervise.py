"""``rlhfflow run --supervise``: keep an unattended run going when its coordinator dies.

The coordinator is the ``rlhfflow run`` process: it holds the Dask client and the run's
bookkeeping, and nothing else notices when it is killed (the OOM killer, a segfault in a
native library, a lost SSH session). The supervisor is a small parent process that runs
the real run as a child and, when the child dies, starts it again: the run resumes from
its last checkpoint by itself (``--resume auto``), so each restart loses at most the
iterations since that checkpoint and repeats none.

What it does not restart: a clean finish (0), a mistake in what the user gave (2), a stop
the user asked for (130), nor a run that failed (1) without committing an iteration
since it started, which would only fail again at the same point (a reward function that
raises, a full disk). A death by signal is always restarted, up to ``max_restarts``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlhfflow.cli import ENVIRONMENT
from rlhfflow.launch.warm import IMPORT_TIME_PREFIXES, LOCK_FD_VAR
from rlhfflow.storage import MetricsLog

USER_MISTAKE, STOPPED = 2, 130


def last_iteration(output_dir: Path) -> int:
    """The last iteration in the run's metrics log (-1: none)."""
    records = MetricsLog(output_dir / "metrics.jsonl").read() \
        if (output_dir / "metrics.jsonl").exists() else []
    return max((r.get("iteration", -1) for r in records), default=-1)


def describe_exit(code: int) -> str:
    """``died from SIGKILL`` or ``exited with 1``."""
    if code < 0:
        try:
            return f"died from {signal.Signals(-code).name}"
        except ValueError:
            return f"died from signal {-code}"
    return f"exited with {code}"


def supervise(child_args: Sequence[str], restart_args: Sequence[str], output_dir: Path,
              max_restarts: int, say: Callable[[str], Any], lock: int | None = None) -> int:
    """Run ``rlhfflow run CHILD_ARGS`` until it ends for good; return its exit code.

    ``restart_args`` are the arguments of a restart (without ``--overwrite``, which must
    not wipe what the first attempt did). ``say`` prints the one line per restart.
    ``lock``: the descriptor of the output directory's lock this process holds; each
    child inherits it (``output_lock``), so that the run's own child is not locked out.
    """
    args, restarts = list(child_args), 0
    while True:
        before = last_iteration(output_dir)
        code = _run_child(args, lock)
        if code in (0, USER_MISTAKE, STOPPED):
            return code
        progressed = last_iteration(output_dir) > before
        if code > 0 and not progressed:
            say(f"rlhfflow: supervisor: the run {describe_exit(code)} without committing an "
                f"iteration; not restarting it")
            return code
        if restarts >= max_restarts:
            say(f"rlhfflow: supervisor: the run {describe_exit(code)}; gave up after "
                f"{restarts} restart(s) (--max-restarts {max_restarts}); run the same command "
                f"again to resume from the last checkpoint")
            return code if code > 0 else 1
        restarts += 1
        last = last_iteration(output_dir)
        when, how = (f"after iteration {last}", "resuming from its last checkpoint") \
            if last >= 0 else ("before its first iteration", "from the start")
        say(f"rlhfflow: supervisor: the run {describe_exit(code)} {when}; restarting it "
            f"({restarts}/{max_restarts}), {how}")
        args = list(restart_args)


def attempt_environment() -> dict[str, str]:
    """This process's environment, with the variables that libraries read at import as
    the command started with them: this process's imports set some (the engine sets
    ``DS_ACCELERATOR``), and an attempt with them would have another warm server key than
    the user's other runs (a server of its own, started cold, while theirs is warm)."""
    env = dict(os.environ)
    for name in set(env) | set(ENVIRONMENT):
        if name.startswith(IMPORT_TIME_PREFIXES):
            if name in ENVIRONMENT:
                env[name] = ENVIRONMENT[name]
            else:
                del env[name]
    return env


def _run_child(args: Sequence[str], lock: int | None = None) -> int:
    """One attempt. The child gets its own process group so that a Ctrl-C at the terminal
    reaches it once, through us: two SIGINTs would mean "stop at once" to it."""
    env = {**attempt_environment(), **({LOCK_FD_VAR: str(lock)} if lock is not None else {})}
    child = subprocess.Popen([sys.executable, "-m", "rlhfflow.cli.main", "run", *args],
                             process_group=0, env=env,
                             pass_fds=(lock,) if lock is not None else ())

    def forward(signum: int, frame: Any) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
