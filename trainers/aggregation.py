"""The one sample-weighting rule (b_i / sum b) and the linear LR scaling rule (B_t / B_ref),
shared by BSP, ScaDLES, DLion and gossip; the robust rules (coordinate-wise median and
trimmed mean, a per-update norm bound) the aggregating strategies offer against Byzantine
workers."""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgestream.trainers.errors import AggregationError


def sample_weights(batch_sizes: Sequence[int]) -> list[float]:
    """Weights ``b_i / B`` with ``B = sum(b_i)``; every batch size must be positive."""
    if not batch_sizes:
        raise AggregationError("no batch sizes to weight")
    if any(int(b) <= 0 for b in batch_sizes):
        raise AggregationError(f"batch sizes must be > 0, got {list(batch_sizes)}")
    total = sum(int(b) for b in batch_sizes)
    return [int(b) / total for b in batch_sizes]


def weighted_mean(
    named_tensors_list: Sequence[Mapping[str, torch.Tensor]], batch_sizes: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Sample-weighted mean ``sum_i (b_i / B) * g_i`` of named tensors, in float32.

    Terms are summed in the order given, so callers that need bitwise identical
    results on every replica (BSP) must pass contributions in one agreed order
    (sorted by worker id). Inputs are never modified. All entries must carry the
    same names and shapes.
    """
    if len(named_tensors_list) != len(batch_sizes):
        raise AggregationError(
            f"{len(named_tensors_list)} contributions but {len(batch_sizes)} batch sizes"
        )
    weights = sample_weights(batch_sizes)
    reference = named_tensors_list[0]
    for index, contribution in enumerate(named_tensors_list[1:], start=1):
        if contribution.keys() != reference.keys():
            raise AggregationError(
                f"contribution {index} names {sorted(contribution)} differ from {sorted(reference)}"
            )
    result: dict[str, torch.Tensor] = {}
    for name in reference:
        shape = tuple(reference[name].shape)
        total = torch.zeros(shape, dtype=torch.float32)
        for contribution, weight in zip(named_tensors_list, weights, strict=True):
            tensor = contribution[name]
            if tuple(tensor.shape) != shape:
                raise AggregationError(f"{name!r}: shape {tuple(tensor.shape)} differs from {shape}")
            total.add_(tensor.to("cpu", torch.float32), alpha=weight)
        result[name] = total
    return result


def linear_lr_scale(global_batch: int, reference_batch: int | None) -> float:
    """ScaDLES linear scaling: the step's learning rate is ``lr * B_t / B_ref``.

    ``B_t`` is the samples aggregated into the step, ``B_ref = b_ref * N`` the global
    batch the base learning rate was tuned for. ``None`` turns scaling off (factor 1).
    """
    if reference_batch is None:
        return 1.0
    if reference_batch <= 0 or global_batch < 0:
        raise AggregationError(f"need B_ref > 0 and B_t >= 0, got B_ref={reference_batch}, B_t={global_batch}")
    return global_batch / reference_batch


# -- robust aggregation ---------------------------------------------------------------------
#
# Coordinate-wise median and trimmed mean (the rules Flower ships as FedMedian and
# FedTrimmedAvg), and a per-update L2 norm bound. Every function here is pure and
# deterministic: no reduction crosses the entries of a tensor except the norm, which is
# summed in an order fixed by the data alone (numpy's pairwise sum per tensor, exactly
# rounded across tensors), so replicas that see the same updates take the same
# decisions and produce the same bits whatever their thread counts.

#: ``aggregation=`` values of the aggregating strategies (BSP, ScaDLES, the ASP and ADSP servers).
AGGREGATION_RULES = ("mean", "trimmed_mean", "median", "krum")
#: ``norm_policy=`` values: scale an update down to the bound, or leave it out.
NORM_POLICIES = ("clip", "reject")


def _stack(named_tensors_list: Sequence[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
    shape = tuple(named_tensors_list[0][name].shape)
    rows = []
    for contribution in named_tensors_list:
        tensor = contribution[name]
        if tuple(tensor.shape) != shape:
            raise AggregationError(f"{name!r}: shape {tuple(tensor.shape)} differs from {shape}")
        rows.append(tensor.detach().to("cpu", torch.float32))
    return torch.stack(rows, dim=0)


def _check_names(named_tensors_list: Sequence[Mapping[str, torch.Tensor]]) -> None:
    if not named_tensors_list:
        raise AggregationError("no contributions to aggregate")
    reference = named_tensors_list[0]
    for index, contribution in enumerate(named_tensors_list[1:], start=1):
        if contribution.keys() != reference.keys():
            raise AggregationError(
                f"contribution {index} names {sorted(contribution)} differ from {sorted(reference)}"
            )


def coordinate_median(named_tensors_list: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Coordinate-wise median of named tensors, in float32, every contribution counting once.

    With an even number of contributions each coordinate is the mean of its two middle
    values (``numpy.median``'s convention). Unweighted on purpose: a weighted median
    would let one contribution that claims a large batch decide every coordinate.
    Inputs are never modified.
    """
    _check_names(named_tensors_list)
    count = len(named_tensors_list)
    result: dict[str, torch.Tensor] = {}
    for name in named_tensors_list[0]:
        ordered = torch.sort(_stack(named_tensors_list, name), dim=0).values
        if count % 2:
            result[name] = ordered[count // 2].clone()
        else:
            result[name] = (ordered[count // 2 - 1] + ordered[count // 2]) * 0.5
    return result


def trimmed_mean(
    named_tensors_list: Sequence[Mapping[str, torch.Tensor]],
    trim: int,
    weights: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Coordinate-wise trimmed mean of named tensors, in float32.

    For each coordinate the ``trim`` smallest and the ``trim`` largest values are left
    out and the rest averaged: so with at most ``trim`` arbitrary (Byzantine)
    contributions every coordinate of the result lies between the smallest and the
    largest value the others sent. ``trim = 0`` is the plain mean.

    ``weights`` (e.g. batch sizes; all > 0) weight the values kept at each coordinate,
    renormalised over them; None counts every contribution once. Which values are
    trimmed never depends on the weights (ties are broken by the contributions' order,
    so the result is deterministic). Raises ``AggregationError`` unless
    ``0 <= 2 * trim < len(named_tensors_list)``: at least one value must stay.
    """
    _check_names(named_tensors_list)
    count = len(named_tensors_list)
    if isinstance(trim, bool) or not isinstance(trim, int) or trim < 0:
        raise AggregationError(f"trim must be an int >= 0, got {trim!r}")
    if 2 * trim >= count:
        raise AggregationError(
            f"trim={trim} drops {2 * trim} of {count} contributions per coordinate and leaves none: "
            f"needs at least {2 * trim + 1} contributions (or a smaller trim)"
        )
    if weights is not None:
        if len(weights) != count:
            raise AggregationError(f"{count} contributions but {len(weights)} weights")
        if any(not (math.isfinite(float(w)) and float(w) > 0) for w in weights):
            raise AggregationError(f"weights must be finite and > 0, got {list(weights)}")
    kept_count = count - 2 * trim
    weight_column = None if weights is None else torch.tensor([float(w) for w in weights], dtype=torch.float32)
    result: dict[str, torch.Tensor] = {}
    for name in named_tensors_list[0]:
        ordered, order = torch.sort(_stack(named_tensors_list, name), dim=0, stable=True)
        total = torch.zeros_like(ordered[0])
        if weight_column is None:
            for rank in range(trim, count - trim):
                total.add_(ordered[rank])
            result[name] = total / kept_count
            continue
        mass = torch.zeros_like(ordered[0])
        for rank in range(trim, count - trim):
            weight = weight_column[order[rank]]
            total.add_(ordered[rank] * weight)
            mass.add_(weight)
        result[name] = total / mass
    return result


def _float64_parts(named_tensors: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> list:
    """Each tensor of a contribution, in sorted name order, flattened to float64 (numpy);
    ``AggregationError`` if a shape differs from ``reference``'s."""
    parts = []
    for name in sorted(reference):
        tensor = named_tensors[name]
        if tuple(tensor.shape) != tuple(reference[name].shape):
            raise AggregationError(f"{name!r}: shape {tuple(tensor.shape)} differs from {tuple(reference[name].shape)}")
        parts.append(tensor.detach().to("cpu").double().reshape(-1).numpy())
    return parts


def _squared_distance(a: list, b: list) -> float:
    """``||a - b||^2`` of two contributions' :func:`_float64_parts`, summed like
    :func:`update_norm` (per tensor by numpy, exactly rounded across tensors): replicas
    agree on it bit for bit."""
    return math.fsum(float(np.sum((x - y) * (x - y))) for x, y in zip(a, b, strict=True))


def krum_select(named_tensors_list: Sequence[Mapping[str, torch.Tensor]], f: int) -> list[int]:
    """Multi-Krum's choice: the indices (ascending) of the ``n - f`` contributions with the
    lowest Krum score, the sum of squared distances to their ``n - f - 2`` nearest others.

    An honest update lies among other honest ones; one that points elsewhere (a flipped
    sign, a scaled or random update) is far from all of them, scores high and is left out
    whole, not coordinate by coordinate. Needs ``n >= 2 f + 3``; ties go to the earlier
    contribution, so replicas given one order choose alike.
    """
    _check_names(named_tensors_list)
    count = len(named_tensors_list)
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise AggregationError(f"krum_f must be an int >= 0, got {f!r}")
    if count < 2 * f + 3:
        raise AggregationError(f"krum with krum_f={f} needs at least {2 * f + 3} contributions, got {count}")
    parts = [_float64_parts(c, named_tensors_list[0]) for c in named_tensors_list]  # once each, not per pair
    distances = [[0.0] * count for _ in range(count)]
    for i in range(count):
        for j in range(i + 1, count):
            distances[i][j] = distances[j][i] = _squared_distance(parts[i], parts[j])
    neighbours = count - f - 2
    scores = [math.fsum(sorted(distances[i][j] for j in range(count) if j != i)[:neighbours]) for i in range(count)]
    chosen = sorted(range(count), key=lambda i: (scores[i], i))[: count - f]
    return sorted(chosen)


def plain_mean(named_tensors_list: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The unweighted mean of named tensors, in float32, summed in the order given."""
    return trimmed_mean(named_tensors_list, 0)


def update_norm(named_tensors: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of an update over all its tensors, computed the same way on every machine.

    float32 values square exactly in float64; each tensor's squares are summed by numpy's
    pairwise sum (one thread, an order fixed by the tensor's size) and the per-tensor sums,
    in sorted name order, with ``math.fsum`` (exactly rounded). Replicas thus agree on
    whether an update is over a bound and on the factor that clips it.
    """
    partial = []
    for name in sorted(named_tensors):
        values = named_tensors[name].detach().to("cpu").double().reshape(-1).numpy()
        partial.append(float(np.sum(values * values)))
    return math.sqrt(math.fsum(partial))


def scale_tensors(named_tensors: Mapping[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """Each tensor times ``factor`` (new tensors; inputs are left alone)."""
    return {name: tensor * factor for name, tensor in named_tensors.items()}


@dataclass(frozen=True)
class Bounded:
    """One update after the norm bound: what to aggregate (None if rejected), its norm,
    and what the bound did (``"kept"``, ``"clipped"`` or ``"rejected"``)."""

    tensors: dict[str, torch.Tensor] | None
    norm: float
    action: str


@dataclass(frozen=True)
class RobustAggregation:
    """How an aggregating strategy combines updates: the rule and the per-update norm bound.

    Built from the strategy's parameters (:meth:`from_params`):

    - ``aggregation``: ``mean`` (the sample-weighted mean ``b_i / B``, the default),
      ``trimmed_mean`` (coordinate-wise, ``trim`` values dropped at each end, the rest
      counted once each), ``median`` (coordinate-wise, unweighted) or ``krum``
      (multi-Krum: the unweighted mean of the ``n - krum_f`` updates :func:`krum_select`
      keeps; whole updates are left out, and the buffer deltas of the same ones used).
    - ``trim``: for ``trimmed_mean``, how many values to drop at each end of each
      coordinate (default 1); it tolerates up to ``trim`` Byzantine contributions per
      aggregate and needs at least ``2 * trim + 1`` of them.
    - ``krum_f``: for ``krum``, how many Byzantine contributions per aggregate it
      tolerates (default 1); needs at least ``2 * krum_f + 3`` of them.
    - ``max_update_norm``: L2 bound on each update's tensors (None: no bound); the
      BatchNorm buffer deltas an update carries are not bounded (they go through the
      aggregation rule).
    - ``norm_policy``: ``clip`` scales an update above the bound down to it; ``reject``
      leaves it out of the aggregate.

    The robust rules count every contribution once, whatever batch size it claims: a
    sender's batch size is its own unverifiable claim, and weighting by it would let one
    Byzantine worker that claims a huge batch pull the result to its end of the kept
    values. (:func:`trimmed_mean` takes weights for callers who trust them.)
    """

    aggregation: str = "mean"
    trim: int = 0
    max_update_norm: float | None = None
    norm_policy: str = "clip"
    krum_f: int = 0

    @classmethod
    def from_params(
        cls,
        *,
        aggregation: str = "mean",
        trim: int | None = None,
        max_update_norm: float | None = None,
        norm_policy: str = "clip",
        krum_f: int | None = None,
    ) -> RobustAggregation:
        """Validate strategy parameters; ``AggregationError`` names the bad one."""
        if aggregation not in AGGREGATION_RULES:
            raise AggregationError(f"aggregation must be one of {list(AGGREGATION_RULES)}, got {aggregation!r}")
        if trim is not None and aggregation != "trimmed_mean":
            raise AggregationError(f"trim applies to aggregation=trimmed_mean only, got aggregation={aggregation!r}")
        if krum_f is not None and aggregation != "krum":
            raise AggregationError(f"krum_f applies to aggregation=krum only, got aggregation={aggregation!r}")
        if krum_f is None:
            krum_f = 1 if aggregation == "krum" else 0
        if isinstance(krum_f, bool) or not isinstance(krum_f, int) or krum_f < 0:
            raise AggregationError(f"krum_f must be an int >= 0, got {krum_f!r}")
        if trim is None:
            trim = 1 if aggregation == "trimmed_mean" else 0
        if isinstance(trim, bool) or not isinstance(trim, int) or trim < (1 if aggregation == "trimmed_mean" else 0):
            raise AggregationError(f"trim must be an int >= 1, got {trim!r}")
        if max_update_norm is not None:
            if isinstance(max_update_norm, bool) or not isinstance(max_update_norm, int | float):
                raise AggregationError(f"max_update_norm must be a number, got {max_update_norm!r}")
            if not (math.isfinite(max_update_norm) and max_update_norm > 0):
                raise AggregationError(f"max_update_norm must be finite and > 0, got {max_update_norm!r}")
            max_update_norm = float(max_update_norm)
        if norm_policy not in NORM_POLICIES:
            raise AggregationError(f"norm_policy must be one of {list(NORM_POLICIES)}, got {norm_policy!r}")
        return cls(aggregation=aggregation, trim=trim, max_update_norm=max_update_norm, norm_policy=norm_policy,
                   krum_f=krum_f)

    @property
    def robust(self) -> bool:
        """True for the robust rules (median, trimmed mean, Krum)."""
        return self.aggregation != "mean"

    @property
    def active(self) -> bool:
        """True when anything differs from the plain sample-weighted mean."""
        return self.robust or self.max_update_norm is not None

    @property
    def min_contributions(self) -> int:
        """Fewest contributions the rule needs at full strength (``2 * trim + 1`` for a
        trimmed mean, ``2 * krum_f + 3`` for Krum; 1 otherwise)."""
        if self.aggregation == "krum":
            return 2 * self.krum_f + 3
        return 2 * self.trim + 1

    @property
    def requirement(self) -> str:
        """The rule and the parameter that sets :attr:`min_contributions`, for messages."""
        if self.aggregation == "krum":
            return f"aggregation=krum with krum_f={self.krum_f}"
        return f"aggregation={self.aggregation} with trim={self.trim}"

    def effective_krum_f(self, count: int) -> int:
        """The ``krum_f`` used for ``count`` contributions: ``krum_f``, or less when fewer
        than ``2 * krum_f + 3`` are there (-1: too few to judge, all are kept)."""
        return min(self.krum_f, (count - 3) // 2) if count >= 3 else -1

    def effective_trim(self, count: int) -> int:
        """The trim used for ``count`` contributions: ``trim``, or less when fewer than
        ``2 * trim + 1`` are there (the most that still leaves one value)."""
        return min(self.trim, max(0, (count - 1) // 2))

    def bound(self, tensors: Mapping[str, torch.Tensor]) -> Bounded:
        """Apply the norm bound to one update's tensors."""
        if self.max_update_norm is None:
            return Bounded(dict(tensors), math.nan, "kept")
        norm = update_norm(tensors)
        if norm <= self.max_update_norm:
            return Bounded(dict(tensors), norm, "kept")
        if self.norm_policy == "reject":
            return Bounded(None, norm, "rejected")
        return Bounded(scale_tensors(tensors, self.max_update_norm / norm), norm, "clipped")

    def bound_counted(self, tensors: Mapping[str, torch.Tensor], sender: str,
                      counters: MutableMapping[str, int]) -> dict[str, torch.Tensor] | None:
        """:meth:`bound`, counted in ``counters`` (``updates_clipped`` / ``updates_rejected``,
        also per ``:<sender>``); the tensors to use, None if the update is left out."""
        bounded = self.bound(tensors)
        if bounded.action != "kept":
            counters[f"updates_{bounded.action}"] += 1
            counters[f"updates_{bounded.action}:{sender}"] += 1
        return bounded.tensors

    def combine(
        self, named_tensors_list: Sequence[Mapping[str, torch.Tensor]], batch_sizes: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        """The aggregate of the contributions, in the given order (callers that need the same
        bits on every replica pass one agreed order). ``mean``: :func:`weighted_mean` with
        ``b_i / B``; ``trimmed_mean``: unweighted, with :meth:`effective_trim`; ``median``:
        :func:`coordinate_median`."""
        if self.aggregation == "krum":
            return plain_mean([named_tensors_list[i] for i in self.select(named_tensors_list)])
        if self.aggregation == "median":
            return coordinate_median(named_tensors_list)
        if self.aggregation == "trimmed_mean":
            return trimmed_mean(named_tensors_list, self.effective_trim(len(named_tensors_list)))
        return weighted_mean(named_tensors_list, batch_sizes)

    def select(self, named_tensors_list: Sequence[Mapping[str, torch.Tensor]]) -> list[int]:
        """For ``krum``: the indices of the contributions it keeps (all when too few to
        judge); for the other rules, all."""
        f = self.effective_krum_f(len(named_tensors_list)) if self.aggregation == "krum" else -1
        if f < 0:
            return list(range(len(named_tensors_list)))
        return krum_select(named_tensors_list, f)

    def aggregate(
        self,
        named_tensors_list: Sequence[Mapping[str, torch.Tensor]],
        buffers_list: Sequence[Mapping[str, torch.Tensor] | None],
        batch_sizes: Sequence[int],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The aggregate of the updates and of their buffer deltas (None when they do not
        all carry the same names): :meth:`combine` and :func:`combine_buffers`, except that
        for ``krum`` both are the plain means of the same chosen contributions."""
        if self.aggregation != "krum":
            return (self.combine(named_tensors_list, batch_sizes),
                    combine_buffers(self, buffers_list, batch_sizes))
        chosen = self.select(named_tensors_list)
        buffers = _shared_buffers([buffers_list[i] for i in chosen])
        return (plain_mean([named_tensors_list[i] for i in chosen]),
                None if buffers is None else plain_mean(buffers))

    def global_batch(self, batch_sizes: Sequence[int]) -> int:
        """Samples behind an aggregate, for the linear LR rule ``B_t / B_ref``: the sum for
        ``mean``; for the robust rules ``count x`` the same rule applied to the claimed batch
        sizes (rounded), so one worker claiming a huge batch cannot blow up the step size."""
        if not batch_sizes:
            return 0
        if not self.robust:
            return sum(int(b) for b in batch_sizes)
        column = [{"b": torch.tensor([float(b)], dtype=torch.float32)} for b in batch_sizes]
        typical = float(self.combine(column, batch_sizes)["b"][0])
        return int(round(typical * len(batch_sizes)))

    def window_size(self, aggregate_window: int | None, workers: int) -> int | None:
        """Senders per aggregate of a server that collects updates in an :class:`UpdateWindow`:
        ``aggregate_window`` if given; else None (apply each update on arrival) for ``mean``
        and the job's ``workers`` for the robust rules. ``AggregationError`` if the window
        cannot hold the ``2 * trim + 1`` slots a trimmed mean needs."""
        if aggregate_window is None:
            if not self.robust:
                return None
            if workers < 1:
                raise AggregationError(f"aggregation={self.aggregation} needs aggregate_window "
                                       "(no workers named to size it from)")
            aggregate_window = workers
        if isinstance(aggregate_window, bool) or not isinstance(aggregate_window, int) or aggregate_window < 1:
            raise AggregationError(f"aggregate_window must be an int >= 1, got {aggregate_window!r}")
        if aggregate_window < self.min_contributions:
            raise AggregationError(
                f"{self.requirement} needs at least {self.min_contributions} "
                f"senders per aggregate, aggregate_window is {aggregate_window}"
            )
        return aggregate_window

    def describe(self) -> dict[str, Any]:
        """The settings as a JSON-able dict (stats)."""
        return {"aggregation": self.aggregation, "trim": self.trim, "krum_f": self.krum_f,
                "max_update_norm": self.max_update_norm, "norm_policy": self.norm_policy}


@dataclass
class WindowSlot:
    """What one sender put into an :class:`UpdateWindow`: its updates' tensors and buffer
    deltas folded into one (mean or sum), how many, their base versions and samples."""

    sender: str
    tensors: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] | None
    count: int
    base_versions: list[int]
    samples: int


class UpdateWindow:
    """Updates a parameter server collects before it aggregates them: one slot per sender.

    A server that applies updates one by one cannot take a median of them; with a window
    it applies one aggregate of ``size`` senders' slots instead. Every update of a sender
    within one window goes into that sender's one slot: ``fold="mean"`` averages them
    (ASP gradients: several estimates of the same descent direction), ``fold="sum"`` adds
    them (ADSP deltas: successive pieces of one worker's progress). So a fast sender, or a
    Byzantine one that sends as often as it can, still holds one value of each coordinate
    among those the median or the trimmed mean chooses from.

    Invariant: :meth:`take` returns the slots sorted by sender, and empties the window.
    """

    FOLDS = ("mean", "sum")

    def __init__(self, fold: str) -> None:
        if fold not in self.FOLDS:
            raise AggregationError(f"fold must be one of {list(self.FOLDS)}, got {fold!r}")
        self.fold = fold
        self._slots: dict[str, WindowSlot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def senders(self) -> list[str]:
        """Senders holding a slot, sorted."""
        return sorted(self._slots)

    def add(
        self,
        sender: str,
        tensors: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor] | None,
        *,
        base_version: int,
        samples: int,
    ) -> None:
        """Fold one update into ``sender``'s slot (a new slot for a new sender)."""
        own = {n: t.detach().to("cpu", torch.float32).clone() for n, t in tensors.items()}
        own_buffers = None if not buffers else {n: b.detach().to("cpu", torch.float32).clone()
                                                for n, b in buffers.items()}
        slot = self._slots.get(sender)
        if slot is None:
            self._slots[sender] = WindowSlot(sender, own, own_buffers, 1, [int(base_version)], int(samples))
            return
        if own.keys() != slot.tensors.keys():
            raise AggregationError(f"{sender}: update names {sorted(own)} differ from {sorted(slot.tensors)}")
        for name, tensor in own.items():
            slot.tensors[name].add_(tensor)
        if slot.buffers is not None and own_buffers is not None and own_buffers.keys() == slot.buffers.keys():
            for name, tensor in own_buffers.items():
                slot.buffers[name].add_(tensor)
        else:
            slot.buffers = None  # buffer names differ within the slot: no buffer sync from it
        slot.count += 1
        slot.base_versions.append(int(base_version))
        slot.samples += int(samples)

    def take(self) -> list[WindowSlot]:
        """The slots sorted by sender (mean-folded ones divided by their count); empties the window."""
        slots = [self._slots[sender] for sender in sorted(self._slots)]
        self._slots = {}
        if self.fold == "mean":
            for slot in slots:
                if slot.count > 1:
                    slot.tensors = {n: t / slot.count for n, t in slot.tensors.items()}
                    if slot.buffers is not None:
                        slot.buffers = {n: b / slot.count for n, b in slot.buffers.items()}
        return slots

    def state_dict(self) -> dict[str, Any]:
        """Tensors and primitives only (checkpoints load with ``weights_only``)."""
        return {
            "fold": self.fold,
            "slots": [
                {"sender": s.sender, "tensors": dict(s.tensors), "buffers": None if s.buffers is None else dict(s.buffers),
                 "count": s.count, "base_versions": list(s.base_versions), "samples": s.samples}
                for s in (self._slots[k] for k in sorted(self._slots))
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._slots = {}
        for item in state.get("slots", []):
            buffers = item["buffers"]
            self._slots[str(item["sender"])] = WindowSlot(
                str(item["sender"]),
                {n: t.clone() for n, t in item["tensors"].items()},
                None if buffers is None else {n: b.clone() for n, b in buffers.items()},
                int(item["count"]),
                [int(v) for v in item["base_versions"]],
                int(item["samples"]),
            )


def combine_buffers(
    rule: RobustAggregation, buffers_list: Sequence[Mapping[str, torch.Tensor] | None], batch_sizes: Sequence[int]
) -> dict[str, torch.Tensor] | None:
    """Buffer deltas aggregated by ``rule`` when every contribution carries the same
    non-empty set of names; None otherwise (no buffer sync for that aggregate)."""
    shared = _shared_buffers(buffers_list)
    return None if shared is None else rule.combine(shared, batch_sizes)


def _shared_buffers(
    buffers_list: Sequence[Mapping[str, torch.Tensor] | None],
) -> list[Mapping[str, torch.Tensor]] | None:
    """``buffers_list`` if every contribution carries the same non-empty set of names, else None."""
    if not buffers_list or any(not b for b in buffers_list) or len({frozenset(b) for b in buffers_list}) != 1:
        return None
    return list(buffers_list)
