"""Data-parallel training: a *gang* of processes sharing one torch.distributed process
group (gloo on CPU, NCCL on GPU), and the DeepSpeed engine built on it.

A process joins at most one gang for its whole life (torch keeps one default group per
process, and a group cannot be re-created after it is destroyed: docs/design/worker.md).
Nothing here knows of Dask: the executor decides the members and calls ``join_gang``
on each of them at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gang:
    """This process's place in its data-parallel group."""

    rank: int
    size: int
    members: tuple[str, ...]
    backend: str

    def shard(self, rows: int) -> torch.Tensor:
        """The row positions ``0..rows-1`` this rank takes (near-equal contiguous split)."""
        return torch.tensor_split(torch.arange(rows), self.size)[self.rank]


_GANG: Gang | None = None


def current_gang() -> Gang | None:
    """The gang this process joined, if any."""
    return _GANG


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the gang's rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def join_gang(members: tuple[str, ...], me: str, master: str, port: int,
              timeout_s: float, device: str = "cpu") -> Gang:
    """Join the gang ``members`` (blocks until all have joined; rank = position of ``me``).

    Joining the same gang again is a no-op; joining another one fails, since a process
    group cannot be replaced in a live process.
    """
    global _GANG
    if _GANG is not None:
        if _GANG.members == members:
            return _GANG
        raise RuntimeError(f"this worker is already in gang {list(_GANG.members)}; it "
                           f"cannot join {list(members)} (restart the workers)")
    rank = members.index(me)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # what DeepSpeed (and any torch.distributed user) reads instead of a launcher
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(len(members)), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR=master, MASTER_PORT=str(port))
    dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=len(members),
                            timeout=datetime.timedelta(seconds=timeout_s))
    _GANG = Gang(rank, len(members), members, backend)
    return _GANG


def allreduce_gradients(params: list[torch.nn.Parameter], gang: Gang,
                        extra: Sequence[float] = ()) -> list[float]:
    """Sum the gradients of ``params`` over the gang, in place, in one collective (each
    rank's loss is already scaled to its share of the whole batch); ``extra`` numbers
    ride along in the same collective, and their sums are returned."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    dtype = grads[0].dtype if grads else torch.float32
    flat = torch.cat([g.reshape(-1) for g in grads] +
                     [torch.tensor(list(extra), dtype=dtype)])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset: offset + n].view_as(p)
        offset += n
    return flat[offset:].tolist()


def allreduce_sum(values: list[float], gang: Gang | None) -> list[float]:
    """Element-wise sum of ``values`` over the gang (``values`` alone without one)."""
    if gang is None or gang.size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


# --------------------------------------------------------------------------- DeepSpeed


#: A torch extension build holds its directory's ``lock`` file for ~45 s on 2 idle cores,
#: a few minutes under load; one older than this was left by a killed build.
STALE_BUILD_LOCK_S = 900.0


def clear_stale_build_locks(root: Path, max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """Remove the ``lock`` files of torch extension builds under ``root`` that are older
    than ``max_age_s``. torch waits for such a lock to vanish, forever: a build killed
    mid-way (Ctrl-C during the first DeepSpeed run) would otherwise hang every later run.
    Returns the locks removed (each also reported on stderr)."""
    import time

    removed = []
    for lock in root.glob("*/lock") if root.is_dir() else ():
        try:
            if time.time() - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                removed.append(lock)
                logger.warning("rlhfflow: removed %s, left by an interrupted build of a torch "
                               "extension", lock)
        except FileNotFoundError:  # another process removed it first
            continue
    return removed


def deepspeed_engine(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     zero_stage: int, grad_clip: float | None, extra: dict[str, Any],
                     device: str = "cpu"):
    """Wrap ``module`` and its torch ``optimizer`` in a DeepSpeed engine (ZeRO
    ``zero_stage``) on the gang's process group; no launcher involved."""
    if not dist.is_initialized():
        raise RuntimeError("DeepSpeed needs a process group: the stage runs outside a gang")
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed compiles a CPU comm op once (~45 s); keep it out of the home directory's
    # default when a project cache is set, and reuse it across runs
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          str(Path.home() / ".cache" / "rlhfflow" / "torch_extensions"))
    clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    try:
        import deepspeed
    except ImportError:
        raise RuntimeError("backend: deepspeed needs DeepSpeed: pip install "
                           "'rlhfflow[deepspeed]' (see the README)") from None
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": zero_stage},
              "gradient_clipping": float(grad_clip or 0.0),
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    config.update(extra)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


# --------------------------------------------------------------------------- FSDP2
# Sharded training is torch's FSDP2 (``fully_shard``): each parameter is a DTensor split
# along its first dimension over the gang, its gradient and AdamW moments are split the
# same way, and a layer's whole weights exist only while its forward or backward runs.
# Chosen over DeepSpeed ZeRO-3 on this CPU (gloo, 2 processes, a tiny Llama, AdamW, 3
# steps): FSDP2 matched one unsharded process to 6e-7, ZeRO-3 ran but differed by 1.4e-4
# and first builds a comm extension; FSDP2 is also what runs on GPUs unchanged (NCCL).


def return_freed_memory() -> bool:
    """Have glibc hand freed blocks of 64 KiB and more back to the system (``mallopt``
    ``M_MMAP_THRESHOLD``, what ``MALLOC_MMAP_THRESHOLD_=65536`` sets at start-up) in this
    process from now on; False where the C library is not glibc. A sharded rank frees and
    makes again a layer's gathered weights and gradients at every layer: with glibc's
    dynamic threshold they stay in its heap and its RSS went above an unsharded rank's
    (benchmarks/sharded_memory.py), and a run planned to fit ``cluster.memory_limit``
    was ended by its nanny at 1.21 GiB of a plan of 0.93. The cost: each such tensor
    is a fresh mmap (a tiny sharded GRPO run's iterations took 2.5x as long)."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 65536))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def shard_module(module: torch.nn.Module, gang: Gang) -> None:
    """Shard ``module``'s parameters over ``gang`` in place (FSDP2): each block of its
    first ``ModuleList`` (a transformer's layers) is gathered on its own, the rest
    (embeddings, final norm, heads) with the root. Every rank calls this at once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if gang.backend == "nccl" else "cpu"
    if device == "cpu":  # the layers' buffers in host memory leave when freed
        return_freed_memory()
    mesh = init_device_mesh(device, (gang.size,))
    blocks = next((m for m in module.modules() if isinstance(m, torch.nn.ModuleList)), ())
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter, gradient or moment)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded ``tensor`` (``tensor`` itself when not sharded)."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The keys of a state dict whose tensor is an earlier key's storage (tied weights,
    e.g. an LM head that is the input embedding), each to the first key of that storage;
    a sharded tensor by its part on this rank."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    for key, value in state.items():
        part = local_part(value)
        if part.numel() == 0:
            continue
        found = first.setdefault((part.data_ptr(), tuple(part.shape)), key)
        if found != key:
            tied[key] = found
    return tied


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded ``tensor`` (a collective: every rank calls it at once)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def like_shard(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (a rank's part, as ``local_part`` gave it) as a DTensor laid out as the
    sharded ``param``; a tensor of another shape (AdamW's step count) as it is."""
    if not is_sharded(param) or local.shape != param.to_local().shape or local.dim() == 0:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


def assemble(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """A parameter from its ranks' parts in rank order (FSDP2 splits along dim 0)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)
