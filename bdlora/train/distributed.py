"""Data-parallel training on torch.distributed (launched by ``torchrun``; ``bdlora train --nproc N`` spawns it).

Contract (issue 9):
- every rank builds the same teacher, student and controller (same seed); the student is wrapped in
  ``DistributedDataParallel`` so gradients are averaged across ranks in backward;
- rank ``r`` of ``W`` reads micro-batch ``(step * grad_accum + micro) * W + r`` of the global block order, so the
  ranks see disjoint shards and a ``W``-process run with ``--batch-size b`` consumes exactly the blocks of a
  1-process run with ``--batch-size W*b`` (same global batch, same order);
- the budget controller runs on every rank; its retentions are compared across ranks after every update and a
  divergence stops the run (``broadcast_buffers=False``, so DDP never papers over it);
- only rank 0 writes the run directory, logs, checkpoints and summary, and prints progress;
- backends: NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bdlora.base.errors import TrainingError, UsageError
from bdlora.models.arch import hidden_and_head


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_launcher() -> DistEnv:
    """The rank/world of this process as set by torchrun (or accelerate); single process when unset."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return DistEnv(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def init(env: DistEnv, device_name: str) -> torch.device | None:
    """Join the process group (NCCL on CUDA, gloo on CPU); returns the rank's device, or None when single-process."""
    if not env.enabled:
        return None
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine (allowed here: auto, cpu)")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    if use_cuda:
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def shutdown(env: DistEnv, run=None) -> None:
    """Leave the process group, dropping ``run.ddp`` (the DDP wrapper) first.

    The order matters: a DDP ``Reducer`` holds the gloo group, and when the Reducer is its last owner the group is
    destroyed inside the Reducer's destructor with the GIL held; the group's destructor joins its worker thread,
    which may still be freeing the last collective's work item, and that needs the GIL: a deadlock at exit (seen in
    1 run of 4 with two CPU-bound processes beside it). Freed here first, the Reducer leaves the group to its Python
    handle, whose destructor releases the GIL while it joins."""
    if run is not None and getattr(run, "ddp", None) is not None:
        ddp = weakref.ref(run.ddp)
        run.ddp = None
        if ddp() is not None:  # held by a reference cycle
            gc.collect()
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()


@contextlib.contextmanager
def main_first(env: DistEnv):
    """Rank 0 runs the block first (builds caches: teacher, tokenised corpus), the others then read them."""
    if env.enabled and not env.is_main:
        dist.barrier()
    try:
        yield
    finally:
        if env.enabled and env.is_main:
            dist.barrier()


def broadcast_object(env: DistEnv, obj):
    if not env.enabled:
        return obj
    box = [obj if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(env: DistEnv, flag: bool) -> bool:
    """True on every rank when it is True on one (stop requests: all ranks stop after the same step)."""
    if not env.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_over_ranks(env: DistEnv, values: list[float]) -> list[float]:
    if not env.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / env.world_size).tolist()


def check_same_retentions(env: DistEnv, retentions: list[float], step: int) -> None:
    """Fail loudly when the controller's retentions differ between ranks (they must be identical everywhere)."""
    if not env.enabled or not retentions:
        return
    t = torch.tensor(retentions, dtype=torch.float64)
    hi, lo = t.clone(), t.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    gap = float((hi - lo).abs().max())
    if gap > 0.0:
        raise TrainingError(f"step {step}: the budget controller diverged across ranks (max retention difference "
                            f"{gap:.3g}); ranks must run identical controllers")


class StudentHidden(torch.nn.Module):
    """What DDP wraps: the student's final hidden states. The LM head runs later, in the chunked KD loss; its
    gradients (kd-full) still reach DDP's reducer in the same backward."""

    def __init__(self, student: torch.nn.Module):
        super().__init__()
        self.student = student

    def forward(self, input_ids):
        return hidden_and_head(self.student, input_ids)[0]


def wrap_ddp(student: torch.nn.Module, device: torch.device):
    ids = [device.index] if device.type == "cuda" else None
    return DDP(StudentHidden(student), device_ids=ids, broadcast_buffers=False)
