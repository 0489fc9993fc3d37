"""The process group of one parallel model: `init_world` forms it (gloo on CPU, NCCL on CUDA)
or raises `WorldError` saying why it cannot (the port is taken, a rank never came, fewer CUDA
devices than ranks); `World` carries the rank, the size and the collectives the parallel
layers use (`all_reduce`, its started form `start_all_reduce`, `all_gather`)."""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


class WorldError(RuntimeError):
    """The process group cannot form, or a rank left it; the message names the cause and the
    setting at fault. Fatal to a serving engine (`ends_engine`, read by
    `engine.device.cuda.fatal_device_error`): a world that lost a rank, or whose ranks are out
    of step, runs no collective again; `failure` is how /health's reason begins."""

    ends_engine = True
    failure = "the parallel model's world broke"


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the group: `rank` of `size`, on `device` (cuda:rank on a GPU).
    A world of size 1 runs no collective (every method returns its input)."""

    rank: int
    size: int
    device: torch.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `x` over the ranks, in place; every rank gets the same
        values (the collective reduces each element once and broadcasts it). WorldError
        where a rank has left (`collective`)."""
        if self.size > 1:
            with collective("an all-reduce"):
                dist.all_reduce(x)
        return x

    def start_all_reduce(self, x: torch.Tensor) -> Pending:
        """`all_reduce(x)` started, not waited for: the caller computes meanwhile (on a GPU the
        collective runs on NCCL's stream beside the compute stream; on gloo in its worker
        thread) and must neither read nor write `x` until `Pending.wait` returns it summed. The
        ranks start and wait their collectives in the same order."""
        if self.size == 1:
            return Pending(x, None)
        with collective("an all-reduce"):
            return Pending(x, dist.all_reduce(x, async_op=True))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with collective("an all-gather"):
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


class Pending:
    """A started all-reduce (`World.start_all_reduce`) of `tensor`."""

    def __init__(self, tensor: torch.Tensor, work: Any) -> None:
        self.tensor, self.work = tensor, work

    def wait(self) -> torch.Tensor:
        """The tensor, summed over the ranks once the collective is done (on a GPU: once the
        current stream has waited for it); WorldError where a rank has left. Waiting again
        returns it at once."""
        if self.work is not None:
            with collective("an all-reduce"):
                self.work.wait()
            self.work = None
        return self.tensor


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Run one collective (`what`, for the message): the backend's error where a peer is gone
    (its connection closed, a timeout) becomes a WorldError saying a rank left the world, so
    that the caller fails the step at once instead of waiting."""
    try:
        yield
    except RuntimeError as exc:
        raise WorldError(
            f"a rank left the world during {what}: {str(exc).splitlines()[0]}"
        ) from exc


def init_world(
    rank: int,
    world_size: int,
    backend: str = "auto",
    init_method: str = "tcp://127.0.0.1:29500",
    timeout_s: float = 60.0,
) -> World:
    """Join the process group `init_method` (a `tcp://host:port` rank 0 listens on) as `rank`
    of `world_size`. `backend` "auto": NCCL where CUDA is available, else gloo; on NCCL rank r
    runs on cuda:r. Raises WorldError when the world cannot form within `timeout_s` seconds (a
    rank that never joins), when rank 0's port is taken, or when NCCL has fewer CUDA devices
    than ranks; ValueError for a rank outside the world or an unknown backend."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} (0 <= rank < size)")
    if backend == "auto":
        backend = BACKENDS["cuda" if torch.cuda.is_available() else "cpu"]
    if backend not in BACKENDS.values():
        raise ValueError(f"backend must be one of auto, {', '.join(BACKENDS.values())}")
    device = torch.device("cpu")
    if backend == "nccl":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < world_size:
            raise WorldError(
                f"a world of {world_size} ranks needs {world_size} CUDA devices, found {found} "
                "(--tensor-parallel-size must not exceed the visible GPUs)"
            )
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    if rank == 0 and world_size > 1:
        check_port_free(init_method)
    # A failed `init_process_group` leaves torch's group counter moved on, and a world formed
    # later in this process would then wait under names its freshly started peers never use:
    # put it back on failure (torch keeps it on a private object).
    counter: Any = getattr(distributed_c10d, "_world", None)
    count = getattr(counter, "group_count", None)
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    except (RuntimeError, OSError) as exc:  # torch raises DistStoreError (a RuntimeError)
        if count is not None and not dist.is_initialized():
            counter.group_count = count
        raise WorldError(
            f"rank {rank} of {world_size} could not join the world at {init_method} within "
            f"{timeout_s:g} s: {str(exc).splitlines()[0]} (did every rank start, with the same "
            "address?)"
        ) from None
    return World(rank, world_size, device)


def close_world() -> None:
    """Leave the process group (nothing when none was formed)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_port_free(init_method: str) -> None:
    """WorldError where rank 0 cannot listen on `init_method`'s port (torch would otherwise
    wait for its timeout, or join a stranger's world)."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.port is None:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((url.hostname or "", url.port))
        except OSError as exc:
            raise WorldError(
                f"rank 0 cannot listen on {init_method}: port {url.port} is in use "
                f"({exc.strerror}); choose another port"
            ) from None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a world on one machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
