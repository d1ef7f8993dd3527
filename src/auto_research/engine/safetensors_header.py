"""Whether a safetensors file's header describes the file, read without torch (run_folder.py verifies a
checkpoint before anything heavy is loaded).

The format: 8 bytes, little-endian, the header's length N; N bytes of JSON mapping each tensor's name to its dtype,
shape and byte span in the data (and an optional ``__metadata__`` of text); the data, which the spans tile exactly,
as safetensors requires on load: a header that passes here loads there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
         "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
"""Bytes per element of each dtype safetensors names (the sub-byte ones are never written here)."""
LONGEST_HEADER = 100_000_000  # safetensors' own limit


def _read_header(path: Path) -> tuple[object, int] | str:
    """(the parsed header, the data's length), or what is wrong with the first 8 + N bytes."""
    size = path.stat().st_size
    with path.open("rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        if size < 8 or length > min(size - 8, LONGEST_HEADER):
            return f"has no safetensors header (it announces {length} bytes in a file of {size})"
        try:
            return json.loads(stream.read(length).decode("utf-8")), size - 8 - length
        except ValueError as error:
            return f"has a safetensors header that is not JSON ({error})"


def _span(name: str, entry) -> tuple[int, int] | str:
    """The byte span of one tensor, checked against its dtype and shape."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        return f"describes {name!r} without exactly a dtype, a shape and data offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    counts = isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    pair = (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in offsets))
    if dtype not in BYTES or not counts or not pair:
        return f"describes {name!r} with dtype {dtype!r}, shape {shape!r}, offsets {offsets!r}"
    if offsets[1] - offsets[0] != math.prod(shape) * BYTES[dtype]:
        return f"gives {name!r} {offsets[1] - offsets[0]} bytes for {shape} of {dtype}"
    return offsets[0], offsets[1]


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the file as safetensors (worded to follow its name), or None."""
    read = _read_header(Path(path))
    if isinstance(read, str):
        return read
    header, data = read
    if not isinstance(header, dict):
        return "has a safetensors header that is not a mapping of tensors"
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return "has __metadata__ that is not text"
    spans = [_span(name, entry) for name, entry in header.items() if name != "__metadata__"]
    problem = next((span for span in spans if isinstance(span, str)), None)
    if problem is not None:
        return problem
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            return f"has tensors that do not tile its data (a gap or an overlap at byte {begin})"
        end = stop
    if end != data:
        return f"holds {data} bytes of data, and its header describes {end}"
    return None
