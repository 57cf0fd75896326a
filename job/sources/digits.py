"""``data.source = "digits"``: scikit-learn's bundled 8x8 digits, pixels in [0, 1]."""

from __future__ import annotations

import numpy as np

from edgestream.job.sources.base import DatasetSource, register
from edgestream.streams.simulator import FleetData


@register("digits")
class DigitsSource(DatasetSource):
    """The digits, held out and partitioned over the devices."""

    def auto_value_range(self, data: FleetData) -> tuple[tuple[np.ndarray, np.ndarray], bool]:
        # Pixels are scaled to [0, 1] by the loader: that is the declaration, not an estimate.
        return (np.float32(0.0).reshape(()), np.float32(1.0).reshape(())), False
