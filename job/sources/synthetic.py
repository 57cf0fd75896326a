"""``data.source = "synthetic"``: generated multichannel sensor windows (``streams.datasets``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from edgestream.job.sources.base import DatasetSource, register

if TYPE_CHECKING:
    from edgestream.job.config import JobConfig


@register("synthetic")
class SyntheticSource(DatasetSource):
    """``data.synthetic_samples`` generated windows; ``auto`` value range: their min/max, widened."""

    parameters: ClassVar[tuple[str, ...]] = (*DatasetSource.parameters, "synthetic_samples")

    def dataset_params(self, cfg: JobConfig) -> dict[str, Any]:
        return {"n": cfg.data.synthetic_samples}
