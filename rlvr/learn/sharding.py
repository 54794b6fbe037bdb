"""Weights sharded across the learners of a torchrun job (FSDP2, ``train.shard_weights``).

Each decoder layer is its own FSDP2 group: a learner keeps 1/N of its weights, gradients and AdamW state, gathers
the whole layer for its forward and again for its backward, frees it after, and reduce-scatters the layer's
gradients (summed, not averaged: every learner's loss is already divided by the step's global normaliser). The
embeddings, final norm and output layer form the root group (the causal LM itself; a tied output layer is the
embedding), gathered once per forward and kept until its backward, because rlvr's fused output layer reads its
weight outside the model's ``forward``. rlvr calls the model's body, not the causal LM, so the body is called
through a method registered on the root (``register_fsdp_forward_method``): ``backbone_and_head`` hands out a
``BodyThroughRoot`` for a sharded model.

FSDP2's collectives run inside the forward and backward hooks, so every learner must call the model the same
number of times in the same order. rlvr's step ensures it: each learner pads its micro-batches to the job's largest
count with micro-batches whose loss is multiplied by 0 (the gradient they add is exactly 0), and the prompt pass
never splits off a shared prefix (which runs the body once or twice depending on the prompts). Sampling and
evaluation, whose decode loops end at different lengths on different learners, run on whole weights: every group is
gathered once before and freed after (``whole_weights``), so no collective runs inside the loop; that phase holds
the whole model, as a replica would.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from rlvr.models.architecture import UnsupportedArchitecture, output_layer, unwrap
from rlvr.platform.distributed import Collectives
from rlvr.rollout import Sampler

# glibc's mmap threshold under sharded weights (unless train.heap_threshold_kb sets one): FSDP gathers and frees a
# layer's weights and gradients for every micro-batch, and glibc keeps what a process freed for its next allocations
# unless returned (peak RSS with and without this: BENCHMARKS.md, "Full fine-tuning: replicas against sharded weights")
SHARDED_HEAP_THRESHOLD = 512 << 10


def shards(model: nn.Module) -> bool:
    """Whether ``model``'s weights are sharded across learners (FSDP2)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_weights(model: nn.Module, collectives: Collectives) -> None:
    """Shard ``model`` in place across the job's learners: each decoder layer a group, then embeddings + final norm +
    output layer as the root group. Every learner must hold the same weights first (they are cut, not sent)."""
    inner = unwrap(model)
    backbone = getattr(inner, inner.base_model_prefix)
    output_layer(inner)  # the output layer's logit map is probed once on whole weights (cached on the model)
    kinds = set(getattr(inner, "_no_split_modules", None) or ())
    layers = [m for m in backbone.modules() if type(m).__name__ in kinds]
    if not layers:
        raise UnsupportedArchitecture(f"{type(inner).__name__} names no decoder layer class (_no_split_modules), so "
                                      "its weights cannot be sharded: set train.shard_weights=false")
    mesh = init_device_mesh(collectives.device.type, (collectives.world.size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        layer.rlvr_reshard_after_forward = True
    fully_shard(inner, mesh=mesh, reshard_after_forward=False)  # the root: embeddings, norm, output layer
    inner.rlvr_reshard_after_forward = False
    inner.__dict__["rlvr_body"] = backbone  # called as a method of the root: its hooks gather the root group
    register_fsdp_forward_method(inner, "rlvr_body")
    inner.__dict__["rlvr_body_through_root"] = BodyThroughRoot(inner, backbone)
    for m in _groups(model):
        m.set_gradient_divide_factor(1.0)  # a sum: each learner's loss is over the global normaliser already
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        m.set_reduce_scatter_unused_params(True, recurse=False)  # the same reduce-scatters on every learner


class BodyThroughRoot:
    """A sharded model's body (embeddings + decoder layers + final norm), called through the root FSDP module so
    that the root group is gathered first; everything else (config, submodules) is the body's own."""

    def __init__(self, root: nn.Module, body: nn.Module):
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "body", body)

    def __call__(self, *args, **kwargs):
        return self.root.rlvr_body(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.body, name)

    def __setattr__(self, name, value):
        setattr(self.body, name, value)


def _groups(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def whole_weights(model: nn.Module) -> Iterator[None]:
    """Every sharded group gathered (one all-gather each, on every learner) and kept whole until the block ends, so
    the model can be called any number of times with no collective; nothing happens for an unsharded model. The
    weights must not change inside (no optimizer step)."""
    groups = _groups(model)
    for m in groups:
        m.unshard()
    for m in groups:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in groups:
            m.set_reshard_after_forward(m.rlvr_reshard_after_forward, recurse=False)
            m.reshard()


def whole_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every shard gathered whole (a collective: every learner calls it); a tied weight
    appears once, under its first name, as ``save_pretrained`` writes it."""
    whole, seen = {}, set()
    for k, v in model.state_dict().items():
        held = v.to_local() if isinstance(v, DTensor) else v
        if (held.data_ptr(), held.shape) not in seen:  # tied weights share their storage
            seen.add((held.data_ptr(), held.shape))
            whole[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return whole


def sampled_on_whole_weights(model: nn.Module, sampler: Sampler) -> Sampler:
    """``sampler`` with each generation on whole weights (``whole_weights``) when ``model`` is sharded."""
    return _WholeWeightsSampler(model, sampler) if shards(model) else sampler


class _WholeWeightsSampler:
    def __init__(self, model: nn.Module, sampler: Sampler):
        self.model, self.sampler = model, sampler

    def sample(self, *args, **kwargs):
        with whole_weights(self.model):
            return self.sampler.sample(*args, **kwargs)

    def sample_episodes(self, *args, **kwargs):
        with whole_weights(self.model):
            return self.sampler.sample_episodes(*args, **kwargs)

    def __getattr__(self, name):  # sync, stats, close, version, ...
        return getattr(self.sampler, name)


@torch.no_grad()
def clip_sharded_gradients(params: list[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of ``params`` (shards: DTensors; any others are whole on every learner) so their global
    L2 norm is at most ``max_norm`` (as torch.nn.utils.clip_grad_norm_ does on whole gradients); returns the norm.
    The squares are summed on the gradients' device (fp64) and cross to the host once."""
    grads = [p.grad for p in params if p.grad is not None]
    shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]

    def squares(tensors: list[torch.Tensor]) -> torch.Tensor:  # [] fp64 on the tensors' device
        return torch.stack([t.double().pow(2).sum() for t in tensors]).sum() if tensors else \
            torch.zeros((), dtype=torch.float64, device="cpu")

    sharded = squares(shards)
    if shards:  # each learner holds other shards: their squares add up over the learners
        group = next(g for g in grads if isinstance(g, DTensor)).device_mesh.get_group()
        sharded = sharded.to("cpu" if dist.get_backend(group) == "gloo" else shards[0].device)
        dist.all_reduce(sharded, group=group)
    norm = math.sqrt(float(sharded) + float(squares(whole)))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm
