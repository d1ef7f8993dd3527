"""Linear layers on weights packed once for oneDNN while decoding on the CPU (``packed_linears``).

A decode step multiplies a few rows by every weight matrix. torch's float32 product on the CPU (MKL's sgemm) lays
the weight out in its blocked format again on every call, which at a few dozen rows costs as much as the
arithmetic (SmolLM2-135M's output layer at 32 rows: 46 ms, against 13 ms on a weight reordered once by
``torch.ops.mkldnn._reorder_linear_weight``; docs/benchmarks.md, "The builtin sampler's decoding on SmolLM2").
oneDNN's call costs 20–30 µs more than MKL's, so only weights of ``onednn.MIN_ELEMENTS`` (2^18) entries or more are
packed (a 96 × 96 weight ran slower packed, 192 × 576 broke even).

Weights change with every optimizer step, so each sampling call packs afresh (SmolLM2: 0.2–0.4 s and a copy of
the weights, given back when the call ends). Only a plain float32 CPU linear layer outside autograd and autocast is
packed; anything else runs as it was.
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
    """Within: each packable linear layer of ``model`` (the module's docstring) computes from its weight packed for
    oneDNN at a batch of about ``rows`` rows (any number runs). Re-entrant: layers an enclosing call packed stay as
    they are. Elsewhere nothing changes."""
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
