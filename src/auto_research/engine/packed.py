"""Linear layers on weights packed once for oneDNN while decoding on the CPU (``packed_linears``).

A decode step multiplies a few rows (the samples still decoding) by every weight matrix of the model. torch's
float32 matrix product on the CPU (MKL's sgemm) lays the weight out in its blocked format again on every call,
and at a few dozen rows that costs as much as the arithmetic: on SmolLM2-135M, 32 rows against the 49,152-wide
output layer ran at 39–46 GFLOP/s, a quarter of the 171 GFLOP/s this CPU reaches on large products. oneDNN's
linear takes a weight reordered once into its own layout (``torch.ops.mkldnn._reorder_linear_weight``: the
kernels torch's compiler uses for frozen inference on the CPU) and ran the same product in 13 ms instead of
46 (``benchmarks/decode_roofline.py`` measures the whole decode).

oneDNN's call costs 20–30 µs more than MKL's, so a small matrix runs slower packed: at 32 rows a 96 × 96 weight took
35 µs packed against 19 plain, 192 × 576 broke even, 576 × 576 gained 1.15–1.3× and 1536 × 576 1.4–1.8×. Only
weights of ``onednn.MIN_ELEMENTS`` (2^18) entries or more are packed, so a tiny model decodes as it did.

The layout lasts for one sampling call: weights change with every optimizer step, so each call packs afresh
(SmolLM2: 0.2–0.4 s, and a copy of the weights, 0.54 GB, given back to the system when the call ends). Packing
applies only where it computes what ``nn.Linear`` computes up to the order of its sums: a plain ``nn.Linear`` (or
``onednn.OneDNNLinear``) with a float32 weight on the CPU that is an ordinary tensor (not an FSDP shard or a
quantized tensor), outside autograd and autocast (whose bfloat16 products it would not follow). Anything else runs
as it was.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from auto_research.engine import onednn
from auto_research.engine.heap import release_free_memory


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """A (out, in) float32 weight reordered for oneDNN's product at a batch of about ``rows`` rows (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, max(1, rows))


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the ``pack``-ed weight, for any number of rows."""
    return onednn.kernel(x, packed, bias)


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's packed linear (every x86 and ARM CPU build has)."""
    if not onednn.available():
        return False
    try:
        return bool(packed_product(torch.ones(1, 3), pack(torch.ones(2, 3), 1)).eq(3).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _packable(module: torch.nn.Module) -> bool:
    return (onednn.is_linear(module) and module.weight.numel() >= onednn.MIN_ELEMENTS
            and onednn.takes(module.weight, module.bias)
            and "forward" not in vars(module))  # packed by an enclosing call, or patched by someone else


def _packed_forward(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plain, x: torch.Tensor):
    if x.dtype != torch.float32 or torch.is_grad_enabled():  # nothing to differentiate through: the layer's own
        return plain(x, weight, bias)
    return packed_product(x, packed, bias)


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int):
    """Within: each packable linear layer of ``model`` (see the module's docstring: float32 on the CPU, at least
    ``onednn.MIN_ELEMENTS`` weights, outside autograd and autocast) computes from its weight packed for oneDNN at a batch
    of about ``rows`` rows (any number runs). Re-entrant: layers an enclosing call packed stay as they are.
    Elsewhere (a GPU, bfloat16, grad or autocast enabled, a build without oneDNN, ``torch.backends.mkldnn``
    disabled) nothing changes."""
    if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or not torch.backends.mkldnn.enabled
            or not available()):
        yield
        return
    patched = []
    try:
        for module in model.modules():
            if _packable(module):
                weight = module.weight.detach()
                packed = pack(weight, rows)
                bias = module.bias.detach() if module.bias is not None else None
                plain = onednn.linear if type(module) is onednn.OneDNNLinear else F.linear
                module.forward = functools.partial(_packed_forward, packed, weight, bias, plain)
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
        if patched:
            # The packed copies go back to the system, not to glibc's free lists: kept there, they sat under the
            # step's next phase (SmolLM2: the peak rose by 0.2 GB, in the reference's forward after sampling).
            del packed
            release_free_memory()
