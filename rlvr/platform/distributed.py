"""Many learners in one run, over torch.distributed: who this process is, and the few collectives a step needs.

Started by ``torchrun --nproc-per-node N -m rlvr train cfg.yaml`` (it sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address). Every rank is a whole learner on its own device: it samples and scores its share of the step's
prompts, the scored groups are gathered so every rank holds the step's whole batch (advantages, the loss normaliser,
dynamic sampling, curriculum and metrics are then exactly the single process's), each rank trains on its own groups,
and the summed gradients are all-reduced once per optimizer step before clipping, so every replica takes the same
step. Backends: gloo on CPUs, NCCL between GPUs (with a gloo group for the CPU bookkeeping); every collective runs
under the process group's timeout (``train.collective_timeout_s``), so a rank that dies ends the others.

Nothing here is pickled: groups, scores and texts cross as tensors (texts as UTF-8 bytes).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place in the job: rank r of ``size`` learners, ``local_rank`` on its machine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: logs, evaluations' totals, checkpoints, the summary."""
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (groups or prompts; the first n % size ranks take one more)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))


SINGLE = World()


def world_from_env(environ: dict[str, str] | None = None) -> World:
    """The job's shape as torchrun (or any launcher setting RANK / WORLD_SIZE / LOCAL_RANK) describes it; one
    process without them."""
    env = os.environ if environ is None else environ
    try:
        size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them)") from None
    if size < 1 or not 0 <= rank < size or local < 0:
        raise ValueError(f"RANK={rank} is not a rank of WORLD_SIZE={size} (torchrun sets them)")
    return World(rank, size, local)


def learner_device(device: torch.device, world: World) -> torch.device:
    """A learner's device: with several learners on GPUs, the GPU of its local rank (torchrun starts one process
    per GPU); otherwise ``device`` as given."""
    if world.size == 1 or device.type != "cuda":
        return device
    if world.local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {world.local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): "
                         "start at most one learner per GPU (torchrun --nproc-per-node <= the GPU count)")
    torch.cuda.set_device(world.local_rank)
    return torch.device("cuda", world.local_rank)


class LearnerLost(RuntimeError):
    """Another learner of the job stopped answering (died, hung, or lost its network) during a collective."""


class Collectives:
    """The process group of a job of ``world.size`` learners, with its device-side backend and a gloo group for CPU
    tensors; a single process gets an instance that does nothing (every method returns its input)."""

    def __init__(self, world: World, device: torch.device, timeout_s: float = 600.0):
        self.world, self.device, self.timeout_s = world, device, timeout_s
        self.cpu_group, self.owned = None, False
        if world.size == 1:
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():  # a script that set up its own group (accelerate) keeps it: we only join
            bound = {"device_id": device} if device.type == "cuda" else {}  # NCCL binds its communicator at once
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **bound)
            self.owned = True
        self.cpu_group = dist.group.WORLD if dist.get_backend() == "gloo" else \
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))  # CPU bookkeeping next to NCCL

    @contextlib.contextmanager
    def answering(self, what: str) -> Iterator[None]:
        """A collective that fails (a peer died or let the timeout pass) becomes one line naming this learner."""
        try:
            yield
        except (RuntimeError, dist.DistError) as err:
            detail = " ".join(str(err).split())[:200]
            raise LearnerLost(
                f"learner {self.world.rank} of {self.world.size}: {what}: another learner did not answer within "
                f"{self.timeout_s:g} s (train.collective_timeout_s) or left the job ({detail}); the launcher's report "
                "names the learner that failed first") from None

    def close(self) -> None:
        """Leave the job: a barrier first (ranks tearing down at different times abort gloo), then destroy the
        process group if this object created it.

        The barrier is gloo's monitored one (a send and a receive in this thread, under the same timeout), not
        ``dist.barrier``: gloo runs that on a worker thread holding the collectives still in flight when it started
        (FSDP's last all-gathers), and the worker lets go of them - tensors whose release takes the GIL - only after
        this thread has returned. The process group outlives destroy_process_group under sharded weights (FSDP's
        state keeps it), so a learner that exits at once could start finalizing Python first; the worker then
        cannot take the GIL, Python ends the thread inside a C++ destructor and the learner aborts (SIGABRT,
        "terminate called without an active exception")."""
        if self.world.size > 1 and dist.is_initialized():
            with self.answering("leaving the job"):
                dist.monitored_barrier(group=self.cpu_group, timeout=timedelta(seconds=self.timeout_s))
            if self.owned:
                dist.destroy_process_group()
                self.owned = False

    def broadcast_from_main(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every rank with rank 0's (the learners start as replicas)."""
        if self.world.size == 1:
            return
        with torch.no_grad():
            for t in tensors:
                with self.answering("taking rank 0's weights"):
                    dist.broadcast(t.data, src=0)

    def barrier(self, what: str) -> None:
        """Wait until every learner is here (``what``: the reason, for the error a missing learner causes)."""
        if self.world.size > 1:
            with self.answering(what):
                dist.barrier(group=self.cpu_group)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (a Ctrl-C seen by one learner stops them all at the same step)."""
        return flag if self.world.size == 1 else self.max_float(float(flag)) > 0

    # ---------------------------------------------------------------------------------------------- CPU tensors
    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's CPU ``tensor`` (any shape, dtype shared), in rank order."""
        if self.world.size == 1:
            return [tensor]
        shape = torch.tensor(list(tensor.shape), dtype=torch.long, device="cpu")
        shapes = [torch.empty_like(shape) for _ in range(self.world.size)]
        with self.answering("gathering the step's groups"):
            dist.all_gather(shapes, shape, group=self.cpu_group)  # same number of dims on every rank
        sizes = [int(s.prod()) for s in shapes]
        flat = torch.zeros(max(*sizes, 1), dtype=tensor.dtype, device="cpu")  # gloo takes no empty tensor
        flat[: tensor.numel()] = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world.size)]
        with self.answering("gathering the step's groups"):
            dist.all_gather(parts, flat, group=self.cpu_group)
        return [p[:n].view(*s.tolist()) for p, n, s in zip(parts, sizes, shapes)]

    def gather_texts(self, texts: list[str]) -> list[list[str]]:
        """Every rank's list of strings, in rank order (as UTF-8 bytes and lengths, never pickled)."""
        if self.world.size == 1:
            return [texts]
        encoded = [t.encode("utf-8") for t in texts]
        data = torch.tensor(list(b"".join(encoded)), dtype=torch.uint8, device="cpu")
        lengths = torch.tensor([len(e) for e in encoded], dtype=torch.long, device="cpu")
        out = []
        for blob, sizes in zip(self.gather(data), self.gather(lengths)):
            raw, at, texts_r = bytes(blob.tolist()), 0, []
            for n in sizes.tolist():
                texts_r.append(raw[at:at + n].decode("utf-8"))
                at += n
            out.append(texts_r)
        return out

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` summed over the ranks (the same keys on every rank), in one all-reduce."""
        if self.world.size == 1 or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device="cpu")
        with self.answering("summing the step's statistics"):
            dist.all_reduce(t, group=self.cpu_group)
        return dict(zip(keys, t.tolist()))

    def max_float(self, value: float) -> float:
        if self.world.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device="cpu")
        with self.answering("agreeing on the step"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return float(t)

    # ------------------------------------------------------------------------------------------------ gradients
    def sum_gradients(self, params: list[torch.nn.Parameter]) -> int:
        """Sum every rank's gradients of ``params`` in place (one flat buffer, one all-reduce on the device);
        returns the bytes each rank sent. A parameter without a gradient here counts as zeros; one without a
        gradient on every rank keeps none (the optimizer skips it, as in one process)."""
        if self.world.size == 1:
            return 0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        had = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [had])  # [sum of numel + P], fp32
        with self.answering("summing the gradients"):
            dist.all_reduce(flat)
        anyone = flat[-len(params):].tolist()
        at = 0
        for p, g, seen in zip(params, grads, anyone):
            n = g.numel()
            p.grad = flat[at:at + n].view_as(g).to(g.dtype) if seen else None
            at += n
        return flat.numel() * flat.element_size()
