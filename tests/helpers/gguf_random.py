"""Random GGUF blocks for the weight-format tests: random codes, and float16 scales of a weight's
size (random bytes would give NaNs and infinities)."""
import numpy as np

from minipaged.kernels.gguf_blocks import FORMATS

# where each format's float16 scales sit in its block (Q4_1's d and m, Q4_K's d and dmin, ...)
HALVES = {"Q8_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, out: int, blocks: int, seed: int) -> np.ndarray:
    """uint8 (out, blocks * bytes): ``out`` rows of ``blocks`` blocks of format ``name``."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (out * blocks, fmt.bytes), dtype=np.uint8)
    for at in HALVES[name]:
        scale = (rng.standard_normal(out * blocks) * 0.05).astype(np.float16)
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(out, blocks * fmt.bytes)
