"""Cost models of the simulated clock by name, from a TOML file, or either with overrides.

A **spec** names one ``trainers.simclock.CostModel`` (what `--cost-model SPEC` of the
simulated benchmarks and `edgestream costs SPEC` take):

- ``NAME``: a preset (:data:`PRESETS`: ``default``, ``edge-compute``, ``edge-network``);
- ``PATH``: a ``.toml`` file (a spec with a ``/`` or ending in ``.toml`` is a path);
- either followed by ``:KEY=VALUE,KEY=VALUE`` overrides, e.g.
  ``default:latency_s=0.05,slowdowns=1/2/4/8``. A list is written with ``/`` between its
  entries (``links_mbit=100/20/5``; an empty value is the empty list), so it fits inside
  the comma list.

The file format (read with ``tomllib``), every key optional (a missing one keeps the
default ``CostModel()``'s value)::

    name = "lab-pis"                  # default: the file's stem
    description = "four Pi 4 on a switch"
    compute_base_s = 0.03             # a step on b records: (base + per_record * b) * slowdown_i
    compute_per_record_s = 0.001
    latency_s = 0.001                 # per message, sender to log
    bandwidth_mbit = 1000             # the server's link, and every worker link not listed
    slowdowns = [1, 1, 2, 4]          # per worker ([] or absent: all 1)
    links_mbit = [1000, 1000, 100]    # per worker host link ([] or absent: none, downloads free)
    fill = "error"                    # a list shorter than the workers: "error", "cycle", "ones"
    eval_fraction = 0.333             # scoring a model on n records: eval_fraction x a step on n

Overrides take the same keys. Unknown keys, values of the wrong type, non-finite or
negative numbers, a zero bandwidth and an unknown ``fill`` are refused with a
:class:`CostModelError` (a ``ValueError``) naming the file or spec and the key; so are an
unknown preset (the message lists them), a missing file and a file that is not TOML.

Pure logic: no Kafka, no torch of its own (``trainers.simclock`` is imported for
``CostModel``).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edgestream.trainers.simclock import FILLS, CostModel, CostModelError

__all__ = [
    "FILE_KEYS",
    "FILLS",
    "PRESETS",
    "CostModelError",
    "NamedCostModel",
    "describe",
    "fit",
    "from_table",
    "load_file",
    "parse_overrides",
    "preset_names",
    "resolve",
    "to_table",
    "to_toml",
    "with_worker_lists",
]

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""

#: The keys a file (and an override) may set: the model's numbers, its lists, and its label.
NUMBER_KEYS = ("compute_base_s", "compute_per_record_s", "latency_s", "bandwidth_mbit", "eval_fraction")
LIST_KEYS = ("slowdowns", "links_mbit")
TEXT_KEYS = ("fill", "name", "description")
FILE_KEYS = (*NUMBER_KEYS, *LIST_KEYS, *TEXT_KEYS)
#: Keys that are bandwidths (must be > 0, not only >= 0).
BANDWIDTH_KEYS = frozenset({"bandwidth_mbit", "links_mbit"})
#: The list separator inside an override (``slowdowns=1/2/4``): a comma separates overrides.
LIST_SEPARATOR = "/"


@dataclass(frozen=True)
class NamedCostModel:
    """A cost model with the label it goes by (a table's column, a JSON key) and where it
    came from: ``preset``, a file's path, or the spec that overrode one of them."""

    name: str
    model: CostModel
    description: str = ""
    source: str = "preset"


# -- presets ---------------------------------------------------------------------------------
#
# Order-of-magnitude figures, not measurements; a file or overrides give measured ones.
#
# edge-compute: a Raspberry-Pi-4-class device (4 Cortex-A72 cores at 1.5 GHz) training on
# its own CPU, hosts on a wired LAN. Such a core runs a deep-learning framework's small
# kernels roughly an order of magnitude slower than a desktop core, and a step dispatches a
# few dozen of them (forward, backward, optimiser) plus the Python around them: tens of ms
# before any record (30 ms). Per record, a small CNN's forward and backward pass are a few
# MFLOP to tens of MFLOP, at the low GFLOP/s such a CPU sustains in practice: about 1 ms.
# The links are the Pi 4's gigabit Ethernet on a switch: 1000 Mbit/s, about 1 ms per
# message (sub-millisecond LAN round trip plus the client's send path). A step on 64
# records (94 ms) then dwarfs a 20 kB gradient's transfer (1.2 ms): compute-dominated.
#
# edge-network: devices with cheap compute (a step of this repository's MLP takes 0.3 ms
# on the development machine, benchmarks/results/strategies.json "calibrated"; 2 ms +
# 20 us/record leaves headroom for a larger model or a slower core) behind a slow shared
# uplink: a few Mbit/s (5: a congested Wi-Fi or a cellular uplink) and tens of ms per
# message (50 ms: a cellular network's one-way latency is of that order). A 20 kB gradient
# takes 82 ms to the log against a 3.3 ms step on 64 records: network-dominated.
PRESETS: dict[str, NamedCostModel] = {p.name: p for p in (
    NamedCostModel("default", CostModel(),
                   "the simulator's default, CostModel()"),
    NamedCostModel("edge-compute",
                   CostModel(compute_base_s=0.03, compute_per_record_s=0.001, latency_s=0.001,
                             bandwidth_bytes_per_s=1000 * MBIT),
                   "compute-dominated: a Raspberry-Pi-class device training on its CPU, hosts on a gigabit LAN"),
    NamedCostModel("edge-network",
                   CostModel(compute_base_s=0.002, compute_per_record_s=2e-5, latency_s=0.05,
                             bandwidth_bytes_per_s=5 * MBIT),
                   "network-dominated: cheap compute behind a slow uplink (congested Wi-Fi, cellular)"),
)}


def preset_names() -> list[str]:
    """The presets' names, in :data:`PRESETS` order."""
    return list(PRESETS)


# -- reading ---------------------------------------------------------------------------------


def _number(key: str, value: Any, origin: str, bandwidth: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CostModelError(f"{origin}: {key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise CostModelError(f"{origin}: {key} must be a finite number >= 0, got {value!r}")
    if bandwidth and value == 0:
        raise CostModelError(f"{origin}: {key} must be > 0 (a bandwidth), got {value!r}")
    return value


def _fields(table: Mapping[str, Any], origin: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``table`` (a file's, or parsed overrides) as ``CostModel`` field updates and the
    label's keys (``name``, ``description``); every key and value checked."""
    unknown = [key for key in table if key not in FILE_KEYS]
    if unknown:
        raise CostModelError(f"{origin}: unknown key {unknown[0]!r}; the keys are {', '.join(FILE_KEYS)}")
    updates: dict[str, Any] = {}
    label: dict[str, str] = {}
    for key, value in table.items():
        if key in NUMBER_KEYS:
            number = _number(key, value, origin, key in BANDWIDTH_KEYS)
            if key == "bandwidth_mbit":
                updates["bandwidth_bytes_per_s"] = number * MBIT
            else:
                updates[key] = number
        elif key in LIST_KEYS:
            if not isinstance(value, list | tuple):
                raise CostModelError(f"{origin}: {key} must be a list of numbers (one per worker), got {value!r}")
            numbers = tuple(_number(f"{key}[{i}]", v, origin, key in BANDWIDTH_KEYS) for i, v in enumerate(value))
            if key == "links_mbit":
                updates["link_bandwidths_bytes_per_s"] = tuple(m * MBIT for m in numbers)
            else:
                updates["slowdowns"] = numbers
        else:  # fill, name, description
            if not isinstance(value, str):
                raise CostModelError(f"{origin}: {key} must be a string, got {value!r}")
            if key == "fill":
                if value not in FILLS:
                    raise CostModelError(f"{origin}: fill must be one of {', '.join(repr(f) for f in FILLS)}, "
                                         f"got {value!r}")
                updates["fill"] = value
            else:
                if key == "name" and not value.strip():
                    raise CostModelError(f"{origin}: name must not be empty")
                label[key] = value
    return updates, label


def from_table(table: Mapping[str, Any], origin: str = "cost model", base: CostModel | None = None) -> CostModel:
    """The cost model a file's table describes: ``base`` (default ``CostModel()``) with the
    table's keys set. ``origin`` names the source in errors."""
    updates, _ = _fields(table, origin)
    return _build(base or CostModel(), updates, origin)


def _build(base: CostModel, updates: Mapping[str, Any], origin: str) -> CostModel:
    try:
        return replace(base, **updates)
    except CostModelError as exc:  # what the dataclass itself refuses
        raise CostModelError(f"{origin}: {exc}") from None


def load_file(path: str | Path) -> NamedCostModel:
    """A cost model file (the format in this module's docstring); its name is the file's
    ``name`` key, else the file's stem."""
    path = Path(path)
    origin = f"cost model file {str(path)!r}"
    if not path.exists():
        raise CostModelError(f"{origin} does not exist")
    if not path.is_file():
        raise CostModelError(f"{origin} is not a file")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise CostModelError(f"{origin} is not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CostModelError(f"{origin} cannot be read: {exc}") from None
    updates, label = _fields(table, origin)
    return NamedCostModel(label.get("name", path.stem), _build(CostModel(), updates, origin),
                          label.get("description", ""), str(path))


def parse_overrides(text: str, origin: str) -> dict[str, Any]:
    """``key=value,key=value`` as a table like a file's: numbers as floats, lists written
    ``a/b/c`` (empty: the empty list), ``fill``, ``name`` and ``description`` as text.
    Only the syntax is checked here; :func:`from_table` checks keys and values."""
    table: dict[str, Any] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise CostModelError(f"{origin}: override {item.strip()!r} is not KEY=VALUE")
        if key in table:
            raise CostModelError(f"{origin}: {key} is given twice")
        if key in LIST_KEYS:
            table[key] = [_parse_number(key, v, origin) for v in value.split(LIST_SEPARATOR)] if value else []
        elif key in NUMBER_KEYS:
            table[key] = _parse_number(key, value, origin)
        else:  # text keys, and unknown ones (refused by name in _fields)
            table[key] = value
    if not table:
        raise CostModelError(f"{origin}: nothing after ':' (give KEY=VALUE overrides, or no ':')")
    return table


def _parse_number(key: str, text: str, origin: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise CostModelError(f"{origin}: {key} must be a number, got {text.strip()!r}") from None


def _is_path(base: str) -> bool:
    return base.endswith(".toml") or "/" in base or base.startswith(".")


def resolve(spec: str) -> NamedCostModel:
    """The cost model a spec names: ``NAME`` (a preset), a path to a ``.toml`` file, either
    followed by ``:KEY=VALUE,...`` overrides. With overrides the name is the override's
    ``name`` if given, else the whole spec."""
    spec = spec.strip()
    origin = f"cost model {spec!r}"
    if not spec:
        raise CostModelError(f"empty cost model spec; give a preset ({', '.join(PRESETS)}) or a .toml file")
    if spec.endswith(".toml") and Path(spec).is_file():  # a path that may contain ':' itself
        base, overrides = spec, ""
    else:
        base, _, overrides = spec.partition(":")
    if _is_path(base):
        named = load_file(base)
    elif base in PRESETS:
        named = PRESETS[base]
    else:
        raise CostModelError(f"unknown cost model {base!r}: the presets are {', '.join(PRESETS)}; "
                             f"or give a path to a .toml file (`edgestream costs` lists them)")
    if spec == base:
        return named
    table = parse_overrides(overrides, origin)
    updates, label = _fields(table, origin)
    description = label.get("description", f"{named.description} (with {overrides.strip()})".lstrip())
    return NamedCostModel(label.get("name", spec), _build(named.model, updates, origin), description, spec)



# -- using one -------------------------------------------------------------------------------


def with_worker_lists(model: CostModel, slowdowns: Sequence[float] = (),
                      link_bandwidths_bytes_per_s: Sequence[float] = (),
                      link_changes: Sequence[tuple[float, int, float]] = ()) -> CostModel:
    """``model`` with a benchmark's own per-worker lists where it sets none of its own: its
    ``slowdowns`` if non-empty, else ``slowdowns``; the same for the host links; the
    benchmark's ``link_changes`` are added to the model's."""
    return replace(
        model,
        slowdowns=model.slowdowns or tuple(float(x) for x in slowdowns),
        link_bandwidths_bytes_per_s=model.link_bandwidths_bytes_per_s or tuple(float(x) for x in
                                                                              link_bandwidths_bytes_per_s),
        link_changes=(*model.link_changes, *link_changes),
    )


def fit(named: NamedCostModel, workers: int) -> CostModel:
    """``named``'s model for ``workers`` workers (``CostModel.for_workers``: its fill rule);
    a refusal names the cost model."""
    try:
        return named.model.for_workers(workers)
    except CostModelError as exc:
        raise CostModelError(f"cost model {named.name!r} {str(exc).removeprefix('cost model ')}") from None


# -- showing one -----------------------------------------------------------------------------


def _mbit(bytes_per_s: float) -> float:
    return bytes_per_s / MBIT


def to_table(model: CostModel) -> dict[str, Any]:
    """``model`` in the file's keys (``link_changes``, which a file cannot hold, left out)."""
    return {
        "compute_base_s": model.compute_base_s,
        "compute_per_record_s": model.compute_per_record_s,
        "latency_s": model.latency_s,
        "bandwidth_mbit": _mbit(model.bandwidth_bytes_per_s),
        "eval_fraction": model.eval_fraction,
        "slowdowns": list(model.slowdowns),
        "links_mbit": [_mbit(b) for b in model.link_bandwidths_bytes_per_s],
        "fill": model.fill,
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(float(value))


def to_toml(named: NamedCostModel) -> str:
    """``named`` as a cost model file (:func:`load_file` reads it back to the same model, up
    to the Mbit/s conversion's rounding)."""
    table = {"name": named.name, **({"description": named.description} if named.description else {}),
             **to_table(named.model)}
    lines = [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    if named.model.link_changes:
        lines.insert(0, f"# link_changes (not in the file format): {list(named.model.link_changes)}")
    return "\n".join(lines) + "\n"


def describe(model: CostModel) -> str:
    """One line: step, latency, bandwidth, and the per-worker lists if any."""
    text = (f"step {model.compute_base_s * 1e3:g} ms + {model.compute_per_record_s * 1e3:g} ms/record, "
            f"latency {model.latency_s * 1e3:g} ms, {_mbit(model.bandwidth_bytes_per_s):g} Mbit/s")
    if model.slowdowns:
        text += f", slowdowns {' '.join(f'{x:g}' for x in model.slowdowns)}"
    if model.link_bandwidths_bytes_per_s:
        text += f", links {' '.join(f'{_mbit(b):g}' for b in model.link_bandwidths_bytes_per_s)} Mbit/s"
    if (model.slowdowns or model.link_bandwidths_bytes_per_s) and model.fill != "error":
        text += f" (fill {model.fill})"
    return text
