"""Float32 matrix products on the CPU through oneDNN instead of MKL, where this CPU runs them faster.

On the AMD EPYC cores this project is measured on, MKL's sgemm runs torch's float32 ``F.linear`` well below the
machine's rate (96–143 GFLOP/s in a SmolLM2-135M step); oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``,
the kernel torch's compiler uses for frozen inference) computes the same product from the same plain weight at
140–200, and a SmolLM2 step fell from 20.1 to 17.9 s (docs/generation-level.md; ``benchmarks/onednn.py``). A
weight's gradient is oneDNN's too, since MKL runs on one thread a computing thread (``machine.one_blas_thread``).

- ``OneDNNLinear``: the class every plain ``nn.Linear`` of at least ``MIN_ELEMENTS`` weights of a loaded model
  takes (``use_onednn``). Where oneDNN does not compute what ``nn.Linear`` computes (not float32, not the CPU,
  under autocast, an FSDP shard, ``torch.backends.mkldnn`` disabled or not built) it is ``nn.Linear`` exactly.
- ``product``: the chunked output layer's logits (``logprobs.py``), which call no module.

The results equal torch's up to the order of the sums (through SmolLM2's 30 layers, log-probs within 4e-5).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


MIN_ELEMENTS = 1 << 18
"""The smallest weight (in entries) computed by oneDNN: below it oneDNN's fixed cost per call (20–30 µs more than
MKL's) outweighs its faster product at a few rows; the sampler's packed layers (``packed.py``) use the same bound."""


def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's ``F.linear`` as it is: ``weight`` plain (out, in), or reordered once (``packed.pack``)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's linear (every x86 and ARM CPU build has)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(kernel(torch.ones(1, 3), torch.ones(2, 3), None).eq(3).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _plain_float32_cpu(tensor: torch.Tensor) -> bool:
    return (type(tensor.data) is torch.Tensor and tensor.dtype == torch.float32 and tensor.device.type == "cpu"
            and tensor.layout == torch.strided)


def takes(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether oneDNN's product can stand for a linear layer with this weight and bias: ordinary (not an FSDP
    shard or a quantized tensor), strided, float32 tensors on the CPU; also what the sampler packs (``packed.py``)."""
    return _plain_float32_cpu(weight) and weight.dim() == 2 and (bias is None or _plain_float32_cpu(bias))


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether oneDNN computes ``F.linear(x, weight, bias)`` here: outside autocast, whose bfloat16 products it would
    not follow, on a non-empty plain float32 CPU input, a weight and bias it ``takes``, oneDNN built and enabled."""
    return (type(x) is torch.Tensor and _plain_float32_cpu(x) and x.numel() > 0 and takes(weight, bias)
            and not torch.is_autocast_enabled("cpu") and torch.backends.mkldnn.enabled and available())


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with no gradient: oneDNN's for a weight of ``MIN_ELEMENTS`` or more where it
    ``applies``, else torch's."""
    if weight.numel() >= MIN_ELEMENTS and applies(x, weight, bias):
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


class _Linear(torch.autograd.Function):
    """y = x Wᵀ + b by oneDNN; backward dx = g W and dW = gᵀ x by oneDNN, db = Σ g by torch (saves what
    ``F.linear`` saves: x and W)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kernel(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = kernel(grad, weight.t(), None)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            rows = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[1]:  # gᵀ · x as oneDNN's x' · W'ᵀ with x' = gᵀ, W' = xᵀ (rows-long copies)
                grad_weight = kernel(rows.t(), x.reshape(-1, x.shape[-1]).t().contiguous(), None)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN (with its gradient) where it ``applies``."""
    if not applies(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return kernel(x, weight, bias)


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose products run through oneDNN where it ``applies`` (see the module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn(model: torch.nn.Module) -> int:
    """Make each plain ``nn.Linear`` of ``model`` with at least ``MIN_ELEMENTS`` weights an ``OneDNNLinear`` (only
    its class changes); returns how many. Nothing changes in a build without oneDNN."""
    return _retype(model, torch.nn.Linear, OneDNNLinear, MIN_ELEMENTS) if available() else 0


def use_torch(model: torch.nn.Module) -> int:
    """Undo ``use_onednn``: every ``OneDNNLinear`` of ``model`` an ``nn.Linear`` again (before FSDP shards it: its
    gathering of weights around each forward is tested on torch's own layers); returns how many."""
    return _retype(model, OneDNNLinear, torch.nn.Linear)


def _retype(model: torch.nn.Module, old: type, new: type, minimum: int = 0) -> int:
    """The class ``new`` for each module of class ``old`` exactly with at least ``minimum`` weights; how many."""
    changed = [module for module in model.modules() if type(module) is old and module.weight.numel() >= minimum]
    for module in changed:
        module.__class__ = new
    return len(changed)


def is_linear(module) -> bool:
    """A plain ``nn.Linear``, or one that only computes through oneDNN."""
    return type(module) in (torch.nn.Linear, OneDNNLinear)
