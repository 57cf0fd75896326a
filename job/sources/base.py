"""The ``DataSource`` interface and its registry: what ``data.source`` may name.

A source declares the ``data.*`` keys it reads, what ``data.value_range = "auto"`` and
``data.max_timestamp_skew_s = "auto"`` mean for it, and how it yields the job's fleet
data. ``job.config`` asks the registry for the allowed names and calls the source's
``configure`` and ``validate`` hooks; nothing anywhere branches on a source's name.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edgestream import plugins
from edgestream.job.errors import ConfigError
from edgestream.streams import codec
from edgestream.streams.registry import Registry
from edgestream.streams.simulator import FleetData, fleet_data

if TYPE_CHECKING:
    from edgestream.job.config import JobConfig

#: ``data.max_timestamp_skew_s = "auto"`` for a generated source (digits, synthetic): one hour.
AUTO_TIMESTAMP_SKEW_S = 3600.0


@dataclasses.dataclass(frozen=True)
class DataNames:
    """What a job's data calls its classes (``class_names[i]`` is label ``i``) and its features
    (one name per flattened feature, in the order the model reads them); None where the data
    does not name them."""

    class_names: tuple[str, ...] | None = None
    feature_names: tuple[str, ...] | None = None


class DataSource(ABC):
    """One kind of job data (``data.source``), registered by name with ``register``.

    Invariant: ``fleet_data`` is deterministic from the config, so the simulators, every
    worker and the simulated clock, each loading it on their own, see the same rows, the
    same held-out split and the same device shares.
    """

    #: The registry name (set by ``register``).
    name: ClassVar[str] = ""
    #: The ``data.*`` keys only this source reads (docs/configuration.md).
    parameters: ClassVar[tuple[str, ...]] = ()
    #: What ``data.max_timestamp_skew_s = "auto"`` means: seconds, or None for no check.
    auto_timestamp_skew_s: ClassVar[float | None] = AUTO_TIMESTAMP_SKEW_S
    #: Why the simulators may not interleave garbage messages (``--garbage``); "" = they may.
    garbage_refused: ClassVar[str] = ""

    def configure(self, cfg: JobConfig) -> None:
        """``load_config``'s hook before validation: set what the source decides (a
        recording: the devices). Idempotent: a config it filled in passes again."""
        return None

    def validate(self, cfg: JobConfig) -> None:
        """Raise ``ConfigError`` for a setting this source cannot use."""
        return None

    @abstractmethod
    def fleet_data(self, cfg: JobConfig) -> FleetData:
        """The job's dataset, held-out split, device shares, value range and input statistics."""

    def replay_directory(self, cfg: JobConfig) -> Path | None:
        """The recording whose device topics are replayed instead of simulated (None: simulate)."""
        return None

    def data_names(self, cfg: JobConfig) -> DataNames:
        """The names of the job's classes and features where the source has them (the model
        card of ``edgestream export``); by default none."""
        return DataNames()


class DatasetSource(DataSource):
    """A source whose rows ``streams.datasets`` loads by the source's name: a stratified
    held-out share, the rest partitioned over the devices (``data.partition``)."""

    parameters: ClassVar[tuple[str, ...]] = ("partition", "dirichlet_alpha", "classes_per_device")

    def dataset_params(self, cfg: JobConfig) -> dict[str, Any]:
        """Keyword arguments of the ``streams.datasets`` loader."""
        return {}

    def auto_value_range(self, data: FleetData) -> tuple[tuple[np.ndarray, np.ndarray], bool]:
        """``data.value_range = "auto"``: ``((lo, hi), from_data)``; by default the min/max of
        every row, which ``declared_value_range`` widens by ``data.value_margin``."""
        parts = [data.train, data.heldout] + ([data.validation] if data.validation is not None else [])
        every = np.concatenate([p.features for p in parts]).reshape(sum(len(p) for p in parts), -1)
        return (every.min(axis=0), every.max(axis=0)), True

    def fleet_data(self, cfg: JobConfig) -> FleetData:
        data = fleet_data(
            self.name,
            cfg.devices.device_ids(),
            scheme=cfg.data.partition,
            seed=cfg.job.seed,
            heldout_fraction=cfg.data.heldout_fraction,
            heldout_seed=cfg.data.heldout_split_seed(cfg.job.seed),
            validation_fraction=cfg.data.validation_fraction,
            dirichlet_alpha=cfg.data.dirichlet_alpha,
            classes_per_device=cfg.data.classes_per_device,
            source_params=self.dataset_params(cfg),
        )
        auto, from_data = self.auto_value_range(data)
        return dataclasses.replace(data, value_range=declared_value_range(cfg, auto, from_data=from_data))


_SOURCES: Registry[DataSource] = Registry("data source")
#: Class decorator: make a ``DataSource`` selectable as ``data.source = name`` (names unique).
register = _SOURCES.register
#: Remove the source registered as ``name`` (for tests that register a toy one).
unregister = _SOURCES.unregister


def names() -> tuple[str, ...]:
    """The registered source names (installed plugins' included, ``edgestream.sources``), in
    registration order."""
    plugins.load_group(plugins.SOURCES)
    return _SOURCES.names()


def source_named(name: str) -> DataSource:
    """The source registered as ``name`` (looked up in the installed plugins when not registered
    yet); ``ConfigError`` naming the choices otherwise."""
    if name not in _SOURCES.names():
        plugins.load_group(plugins.SOURCES)
    try:
        return _SOURCES.get(name)
    except KeyError:
        raise ConfigError(f"data.source={name!r} is not one of {', '.join(names())}"
                          f"{plugins.failure_note(plugins.SOURCES)}") from None


def job_fleet_data(cfg: JobConfig) -> FleetData:
    """The job's data, from its source: deterministic from the config. With
    ``data.evaluate_on = "validation"`` the validation split stands in for the held-out one
    (``FleetData.validation_as_test``): what the job reports is then a validation score."""
    data = source_named(cfg.data.source).fleet_data(cfg)
    return data.validation_as_test() if cfg.data.evaluate_on == "validation" else data


def parse_value_range(text: str) -> tuple[float, float] | str:
    """``data.value_range``: ``"auto"``, ``"none"``, or ``"LO,HI"`` -> ``(lo, hi)``."""
    spec = str(text).strip().lower()
    if spec in ("auto", "none"):
        return spec
    parts = [p.strip() for p in spec.split(",")]
    try:
        lo, hi = (float(p) for p in parts)
    except ValueError:
        raise ConfigError(
            f"data.value_range={text!r}: use auto, none, or LO,HI (e.g. \"-50,50\")"
        ) from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError(f"data.value_range={text!r}: need finite LO < HI")
    return lo, hi


def declared_value_range(
    cfg: JobConfig, auto: tuple[np.ndarray, np.ndarray], *, from_data: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """``data.value_range`` resolved: ``none`` -> None, ``LO,HI`` -> scalars, ``auto`` -> ``auto``.

    ``auto`` is the source's own declaration; ``from_data`` says it is the min/max seen
    in the data, which is then widened by ``data.value_margin`` (later records may lie
    a little outside what the data happened to contain).
    """
    spec = parse_value_range(cfg.data.value_range)
    if spec == "none":
        return None
    if isinstance(spec, tuple):
        return np.float32(spec[0]).reshape(()), np.float32(spec[1]).reshape(())
    lo, hi = auto
    if from_data:
        # Float64 out of widen; float32 rounding never moves a bound inside the data's [min, max].
        lo, hi = codec.widen(lo, hi, cfg.data.value_margin)
        # Data near float32's limit widens past it: every float32 lies inside, so clip
        # (a plain cast would make the bound infinite, with an overflow warning).
        f32_max = float(np.finfo(np.float32).max)
        lo, hi = np.clip(lo, -f32_max, f32_max), np.clip(hi, -f32_max, f32_max)
    return np.asarray(lo, dtype=np.float32), np.asarray(hi, dtype=np.float32)
