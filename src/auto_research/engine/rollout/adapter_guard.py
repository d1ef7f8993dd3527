"""What a rollout server accepts of a LoRA adapter push (``POST /weights/adapter``), checked before anything touches
its engine: each factor against the served weight it adapts, and the change it makes (else ``guard.Refused(400)``)."""

from __future__ import annotations

from auto_research.engine.rollout.guard import Refused, all_finite

MAX_ADAPTER_RANK = 1024
"""The largest LoRA rank an adapter push may carry."""
ADAPTER_DELTA_BOUND = 1e4
"""The most an adapter may change one entry of a served weight, |(B @ A) · scaling|: a LoRA change is far smaller.
Finite factors can make a product that is not (A = B = 1e20, or a scaling of 1e300): merged, it served inf."""


def check_adapter(factors: dict, spec: dict) -> dict:
    """An adapter push's tensors (``remote.adapter_factors``) checked against the served model's spec: ``{weight: (A,
    B, scaling)}``, or ``Refused(400)`` naming the first that fails. Float32 factors of float32 weights only."""
    weights: dict = {}
    for key in factors:
        weight, _, part = key.rpartition("::")
        if part not in ("A", "B", "scaling") or not weight:
            raise Refused(400, f"adapter tensor {key!r}: expected <weight>::A, <weight>::B or <weight>::scaling"[:300])
        if weight not in spec:
            raise Refused(400, f"adapter tensor {key!r}: the served model has no weight {weight!r}"[:300])
        weights.setdefault(weight, {})[part] = factors[key]
    checked = {}
    for weight, parts in weights.items():
        missing = sorted({"A", "B", "scaling"} - set(parts))
        if missing:
            raise Refused(400, f"adapter of {weight!r} lacks its {' and '.join(missing)}"[:300])
        (out, inner), dtype = spec[weight]
        A, B, scaling = parts["A"], parts["B"], parts["scaling"]
        for name, tensor, wanted in (("A", A, "float32"), ("B", B, "float32"), ("scaling", scaling, "float64")):
            if str(tensor.dtype).removeprefix("torch.") != wanted or dtype != "float32":
                raise Refused(400, f"adapter of {weight!r}: {name} is {str(tensor.dtype).removeprefix('torch.')} "
                                   f"for a {dtype} weight; adapters are pushed as float32 factors (a float64 scaling) "
                                   "onto float32 weights")
            if not all_finite(tensor):
                raise Refused(400, f"adapter of {weight!r}: {name} has NaN or infinite values")
        rank = A.shape[0] if A.dim() == 2 else -1
        if not (0 < rank <= MAX_ADAPTER_RANK and list(A.shape) == [rank, inner] and list(B.shape) == [out, rank]
                and scaling.numel() == 1):
            raise Refused(400, f"adapter of {weight!r}: A {list(A.shape)}, B {list(B.shape)}, scaling of "
                               f"{scaling.numel()} values do not fit its shape {[out, inner]} (A (r, {inner}), "
                               f"B ({out}, r), 0 < r ≤ {MAX_ADAPTER_RANK}, one scaling)")
        checked[weight] = (A, B, float(scaling.reshape(())))
        if not _change_is_bounded(*checked[weight]):
            raise Refused(400, f"adapter of {weight!r}: (B @ A) · scaling is not finite, or beyond "
                               f"±{ADAPTER_DELTA_BOUND:g} (a LoRA change to a weight is far smaller)"[:300])
    return checked


def _change_is_bounded(A, B, scaling: float, rows: int = 1024) -> bool:
    """Whether (B @ A) · scaling, computed in float32 as the builtin engine merges it (B @ A first), is finite and
    within ``ADAPTER_DELTA_BOUND`` everywhere. A bound from the factors' largest values settles nearly every
    adapter without the product; the rest are computed ``rows`` rows of B at a time."""
    import torch  # noqa: PLC0415

    rank = A.shape[0]
    largest = rank * float(A.abs().max()) * float(B.abs().max())  # ≥ every |(B @ A)_ij|
    if largest <= 1e30 and abs(scaling) * largest <= ADAPTER_DELTA_BOUND:
        return True
    for start in range(0, B.shape[0], rows):
        change = (B[start: start + rows] @ A) * scaling
        if not bool(torch.isfinite(change).all()) or float(change.abs().max()) > ADAPTER_DELTA_BOUND:
            return False
    return True
