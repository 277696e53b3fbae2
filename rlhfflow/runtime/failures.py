"""How a run fails: the error that stops it, and the one line a full disk becomes."""

from __future__ import annotations

import errno

from rlhfflow.errors import RunError

__all__ = ["RunError", "disk_full", "is_disk_full"]


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
