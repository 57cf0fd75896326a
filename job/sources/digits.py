"""``data.source = "digits"``: scikit-learn's bundled 8x8 digits, pixels in [0, 1]."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgestream.job.sources.base import DataNames, DatasetSource, register
from edgestream.streams.simulator import FleetData

if TYPE_CHECKING:
    from edgestream.job.config import JobConfig

#: The digits' image side: 8x8 pixels, flattened row by row.
SIDE = 8


@register("digits")
class DigitsSource(DatasetSource):
    """The digits, held out and partitioned over the devices."""

    def auto_value_range(self, data: FleetData) -> tuple[tuple[np.ndarray, np.ndarray], bool]:
        # Pixels are scaled to [0, 1] by the loader: that is the declaration, not an estimate.
        return (np.float32(0.0).reshape(()), np.float32(1.0).reshape(())), False

    def data_names(self, cfg: JobConfig) -> DataNames:
        # Label i is the digit i; pixel names as scikit-learn gives them (row, then column).
        return DataNames(class_names=tuple(str(d) for d in range(10)),
                         feature_names=tuple(f"pixel_{r}_{c}" for r in range(SIDE) for c in range(SIDE)))
