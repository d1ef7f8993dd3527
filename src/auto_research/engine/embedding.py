"""A tied embedding's two gradients as one: the output layer's dense (V, H) gradient with the rows the batch saw
added in place, instead of two dense (V, H) tensors and their sum.

With tied embeddings torch makes two dense (V, H) gradients (the lookup's is zeros but for the rows seen) and adds
them into a third at the backward's end, when every other gradient is held: 2 × 113 MB more at SmolLM2's update
peak. Here the lookup hands the weight itself (``tied_weight``) to the chunked output layer (``logprobs.py``), so
the output side's gradient comes back into the lookup's backward, which adds its rows in place, each summed in token
order as torch's dense backward sums it: the same float additions, so the same gradient bit for bit.
"""

from __future__ import annotations

import types
import weakref

import torch

_OUTPUT_LAYER = weakref.WeakKeyDictionary()
"""An embedding given the one-tensor gradient → its tied output layer. Kept apart from the modules, so that a copy
of the model (``copy.deepcopy``: the rollout side's snapshot) shares nothing with it and looks up as torch does."""
_HANDED = weakref.WeakKeyDictionary()
"""An output layer → the weight that the lookup of the forward under way handed out for it."""


class _RowsSeen(torch.autograd.Function):
    """(embedding(ids, W), W as a view): the backward adds each distinct id's summed gradient (``padding_idx`` left
    out, as torch's own backward leaves it out) into the gradient that came back through the view, in place; with
    none (the output layer used W itself), it gives W those rows as a sparse gradient."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        ctx.set_materialize_grads(False)  # no (V, H) of zeros for an output side that did not use the view
        return torch.nn.functional.embedding(ids, weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad, output_side):
        if grad is None:
            return None, output_side, None
        (ids,) = ctx.saved_tensors
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            kept = ids != ctx.padding_idx
            ids, grad = ids[kept], grad[kept]
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        sums = grad.new_zeros(len(rows), grad.shape[-1]).index_add_(0, inverse, grad)
        if output_side is not None:  # (a tensor of the output layer's backward, ours to add into)
            return None, output_side.index_add_(0, rows, sums), None
        return None, torch.sparse_coo_tensor(rows[None], sums, ctx.shape, is_coalesced=True,
                                             check_invariants=False), None


def tied_weight(layer) -> torch.Tensor:
    """The weight an output layer's gradient should flow through: the one the lookup of this forward handed out
    (taken, so a forward uses it once), else the layer's own."""
    handed = _HANDED.pop(layer, None)
    return handed if handed is not None else layer.weight


def _forward(self, ids):
    output = _OUTPUT_LAYER.get(self)
    if output is None or not torch.is_grad_enabled() or not self.weight.requires_grad:
        if output is not None:
            _HANDED.pop(output, None)
        return torch.nn.Embedding.forward(self, ids)
    looked_up, _HANDED[output] = _RowsSeen.apply(ids, self.weight, self.padding_idx)
    return looked_up


def tied_rows_gradient(model) -> bool:
    """Give ``model``'s input embedding the one-tensor gradient (``_RowsSeen``) where that is safe: a plain
    ``nn.Embedding`` whose weight is the output layer's, trains, and is no FSDP shard. Call it after DDP wraps the
    model. ``update.optimizer_step`` makes a sparse gradient dense, should a weight get only the rows. Marks the
    embedding ``rows_seen_gradient``; returns whether it applied."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    inner = getattr(model, "module", model)
    embeddings = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    output = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if type(embeddings) is not torch.nn.Embedding or output is None or embeddings.max_norm is not None \
            or embeddings.scale_grad_by_freq or embeddings.sparse:
        return False
    weight = embeddings.weight
    if weight is not getattr(output, "weight", None) or not weight.requires_grad or isinstance(weight, DTensor):
        return False
    _OUTPUT_LAYER[embeddings] = output
    embeddings.forward = types.MethodType(_forward, embeddings)  # (a copy's is bound to the copy)
    embeddings.rows_seen_gradient = True
    return True
