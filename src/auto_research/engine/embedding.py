"""A tied embedding's input-side gradient as the rows the batch saw, not a second dense (V, H) tensor.

With tied input and output embeddings the one (V, H) weight gets two gradients in a backward: the output layer's,
dense, and the lookup's, which torch makes dense too (zeros but for the rows of the tokens seen) and adds to the
first at the backward's end, when every other weight's gradient is held: 113 MB more at the update's peak on
SmolLM2. Here the lookup's gradient is a coalesced sparse tensor of the rows seen, each row summed in token order
as torch's dense backward sums it, which autograd adds in place into the dense one: the same float additions in
the same order, so the same gradient bit for bit.
"""

from __future__ import annotations

import torch


class _RowsSeen(torch.autograd.Function):
    """embedding(ids, W) whose backward gives W a sparse gradient: one row per distinct id (``padding_idx`` left out,
    as torch's own backward leaves it out), the sum of its tokens' gradients in token order."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            kept = ids != ctx.padding_idx
            ids, grad = ids[kept], grad[kept]
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        sums = grad.new_zeros(len(rows), grad.shape[-1]).index_add_(0, inverse, grad)
        return None, torch.sparse_coo_tensor(rows[None], sums, ctx.shape, is_coalesced=True,
                                             check_invariants=False), None


def tied_rows_gradient(model) -> bool:
    """Give ``model``'s input embedding the rows-seen gradient (``_RowsSeen``) where that is safe: a plain
    ``nn.Embedding`` (no max_norm, no scaling by frequency, no subclass with a forward of its own) whose weight is
    the output layer's, so the output layer's dense gradient always comes too (``update.optimizer_step`` makes a
    sparse gradient dense all the same), that trains, and is not an FSDP shard. Call it after DDP wraps the model:
    DDP then expects the dense sum it gets. Marks the embedding ``rows_seen_gradient``; returns whether it applied."""
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

    def forward(ids):
        if not torch.is_grad_enabled():
            return torch.nn.functional.embedding(ids, embeddings.weight)
        return _RowsSeen.apply(ids, embeddings.weight, embeddings.padding_idx)

    embeddings.forward = forward
    embeddings.rows_seen_gradient = True
    return True
