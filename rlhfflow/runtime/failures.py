"""How a run fails: the error that stops it, the one line a full disk or an exhausted
memory becomes, and the one a failed stage task becomes."""

from __future__ import annotations

import errno
from collections.abc import Sequence

from rlhfflow.errors import RunError, is_out_of_memory

__all__ = ["RunError", "disk_full", "is_disk_full", "is_out_of_memory", "out_of_memory",
           "stage_failure"]


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC, however a library wraps it (safetensors and zarr keep only the message)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text


def disk_full(exc: BaseException, who: str) -> str:
    filename = getattr(exc, "filename", None)
    where = f" writing {filename}" if filename else ""
    return (f"no space left on device: {who} failed{where}; free space and run the same "
            f"command again to resume from the last checkpoint")


def out_of_memory(exc: BaseException, who: str) -> str:
    """The one line an allocation that failed in ``who`` becomes: what ran out, the
    allocation's own words (their first line), and how to give the run more."""
    said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    # torch's CPU allocator starts with where in its sources it failed: not the user's
    said = said.split("] ", 1)[1] if said.startswith("[enforce fail") and "] " in said else said
    return (f"out of memory: {who} could not allocate ({type(exc).__name__}: {said}); give "
            f"the workers more memory (cluster.memory_limit, fewer workers on the machine) "
            f"or the stages less to hold (more data.micro_batches, a smaller "
            f"data.batch_size), then run the same command again to resume from the last "
            f"checkpoint")


def stage_failure(stage: str, cause: BaseException, iteration: int | None, retries: int,
                  workers: Sequence[str]) -> tuple[str, BaseException | None]:
    """The one-line ``RunError`` message that a task of ``stage`` failing with ``cause``
    (after ``retries`` retries) becomes, and the cause to chain it to (None: the line says
    all). A full disk and an exhausted memory say so (not a lost worker to replace: a
    fresh one needs the same memory for the same batch, so retrying would fail again after
    reloading the models); anything else names the stage, the iteration (``None``: a
    setup stage) and the cause, chained to it. ``workers``: the ones the task ran on,
    named in the out-of-memory line (none for a run in-process)."""
    if is_disk_full(cause):
        return disk_full(cause, f"stage {stage!r}"), None
    where = f" in iteration {iteration}" if iteration is not None else " (setup)"
    if is_out_of_memory(cause):
        on = f" on worker {', '.join(workers)}" if workers else ""
        return out_of_memory(cause, f"stage {stage!r}{on}{where}"), None
    tried = f" after {retries + 1} attempts" if retries else ""
    return (f"stage {stage!r} failed{where}{tried}: {type(cause).__name__}: {cause}",
            cause)
