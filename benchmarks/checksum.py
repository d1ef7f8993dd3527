"""What a checksum of the shared-memory weight buffer costs (engine/rollout/transfer.py), and which hash to take.

    python benchmarks/checksum.py              # SmolLM2-135M's fp32 slots (621 MiB), 5 rounds

1. Each candidate hash over every slot of a buffer laid out as SmolLM2-135M's pushed weights (the output layer
   under its own name too, as pushed), one core: XXH3-64 (``xxhash``), zlib's crc32 and adler32, hashlib's sha1,
   sha256 and blake2b (64-bit digest). Rounds rotate the hashes, so each sees the same machine load.
2. The push's own figures through a real buffer in /dev/shm: the trainer's copy into the slots, its checksums
   (``transfer.checksum`` of each slot, read back) and the server's check of them (``SharedBuffer._verify``).

Minimums and medians over the rounds, in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

HIDDEN, INTERMEDIATE, VOCAB, LAYERS, KV = 576, 1536, 49152, 30, 192


def smollm2_spec() -> dict:
    """``{name: (shape, "float32")}`` of SmolLM2-135M's pushed weights."""
    spec = {"model.embed_tokens.weight": ([VOCAB, HIDDEN], "float32"), "lm_head.weight": ([VOCAB, HIDDEN], "float32"),
            "model.norm.weight": ([HIDDEN], "float32")}
    shapes = {"self_attn.q_proj": [HIDDEN, HIDDEN], "self_attn.k_proj": [KV, HIDDEN], "self_attn.v_proj": [KV, HIDDEN],
              "self_attn.o_proj": [HIDDEN, HIDDEN], "mlp.gate_proj": [INTERMEDIATE, HIDDEN],
              "mlp.up_proj": [INTERMEDIATE, HIDDEN], "mlp.down_proj": [HIDDEN, INTERMEDIATE],
              "input_layernorm": [HIDDEN], "post_attention_layernorm": [HIDDEN]}
    for layer in range(LAYERS):
        spec.update({f"model.layers.{layer}.{name}.weight": (shape, "float32") for name, shape in shapes.items()})
    return spec


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    import torch
    import xxhash

    from auto_research.engine.rollout.transfer import SharedBuffer, SharedWriter, checksum

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    spec = smollm2_spec()
    tensors = {name: torch.randn(shape) for name, (shape, _) in spec.items()}
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.mkdtemp())
    buffer = SharedBuffer(spec, "benchmark", folder)
    writer = SharedWriter(buffer.offer())
    slots = [writer.views[name].reshape(-1).view(torch.uint8).numpy() for name in spec]
    print(f"{sum(slot.nbytes for slot in slots) / 2**20:.0f} MiB in {len(slots)} slots, {rounds} rounds")
    hashes = {"xxh3_64": xxhash.xxh3_64_intdigest, "zlib.crc32": zlib.crc32, "zlib.adler32": zlib.adler32,
              "sha1": lambda data: hashlib.sha1(data).digest(), "sha256": lambda data: hashlib.sha256(data).digest(),
              "blake2b-64": lambda data: hashlib.blake2b(data, digest_size=8).digest()}
    seconds: dict = {name: [] for name in [*hashes, "copy into the slots", "the trainer's checksums",
                                           "the server's check"]}
    try:
        for _ in range(rounds):
            for name, function in hashes.items():
                seconds[name].append(timed(lambda: [function(slot) for slot in slots]))
            seconds["copy into the slots"].append(timed(lambda: [writer.views[name].copy_(tensor)
                                                                 for name, tensor in tensors.items()]))
            written: list = []
            seconds["the trainer's checksums"].append(timed(lambda: written.extend(checksum(writer.views[name])
                                                                                   for name in spec)))
            seconds["the server's check"].append(timed(lambda: buffer._verify(list(spec), written)))
    finally:
        writer.close()
        buffer.close()
    for name, values in seconds.items():
        print(f"{name:26s} min {min(values):.3f}  median {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
