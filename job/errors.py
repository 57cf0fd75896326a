"""The errors of ``job/``: a job file, its overrides or its data cannot make a job."""

from __future__ import annotations


class ConfigError(ValueError):
    """The job configuration is invalid; the message names the key and what is allowed."""
