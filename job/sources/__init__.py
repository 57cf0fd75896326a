"""Where a job's data comes from: the registry of data sources (``data.source``)."""
