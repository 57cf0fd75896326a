"""Where a job's data comes from: the registry of data sources (``data.source``).

Adding a source is one module here, registered with ``job.sources.base.register`` and
imported below; ``job.config`` and everything downstream derive the rest from the registry.
"""

from edgestream.job.sources import digits, recording, series, synthetic  # noqa: F401  (importing registers each source)
from edgestream.job.sources.base import (
    DataNames,
    DatasetSource,
    DataSource,
    declared_value_range,
    job_fleet_data,
    names,
    parse_value_range,
    register,
    source_named,
    unregister,
)

__all__ = [
    "DataNames",
    "DataSource",
    "DatasetSource",
    "declared_value_range",
    "job_fleet_data",
    "names",
    "parse_value_range",
    "register",
    "source_named",
    "unregister",
]
