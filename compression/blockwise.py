"""Per-block scaling shared by the bucketed quantisers (QSGD, int8 blocks)."""

from __future__ import annotations

import numpy as np


def scale_per_block(values: np.ndarray, factors: np.ndarray, block_size: int) -> np.ndarray:
    """float32 ``values`` times the factor of each ``block_size`` block (the last may be short).

    Avoids materialising a repeated factor array. Overflow yields inf silently:
    decoders reject non-finite output afterwards, so numpy's warning is noise.
    """
    full = values.size // block_size
    out = np.empty(values.size, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        head = values[: full * block_size].reshape(full, block_size) * factors[:full, None]
        out[: full * block_size] = head.reshape(-1)
        if full * block_size < values.size:
            out[full * block_size :] = values[full * block_size :] * factors[full]
    return out
