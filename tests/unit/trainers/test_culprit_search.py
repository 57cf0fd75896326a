"""The culprit search of a refused step: only the records that make it unsound are
dead-lettered; the others are trained, scored and counted by device as if the culprits
had never been in the batch."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from edgestream.trainers.driver import DriverConfig, TrainingDriver
from edgestream.trainers.guard import CulpritSearch, StepRejection
from edgestream.trainers.local import LocalTrainer, StepResult
from edgestream.trainers.messages import Outgoing
from edgestream.trainers.models import build_model
from edgestream.trainers.strategies import StrategyContext, SyncStrategy

BAD = StepRejection("non_finite_loss", "training loss is inf")


def probe_of(bad: set[int], calls: list[np.ndarray] | None = None):
    """A probe that refuses any subset holding one of ``bad`` (as a poisoned record does)."""

    def probe(indices: np.ndarray) -> StepRejection | None:
        if calls is not None:
            calls.append(indices)
        return BAD if bad & set(indices.tolist()) else None

    return probe


def devices(*counts: int) -> np.ndarray:
    """Group keys of a batch made of one device batch per count: d0 x counts[0], d1 x ..."""
    return np.repeat(np.array([f"d{i}" for i in range(len(counts))]), counts)


def assert_partition(outcome, size: int) -> None:
    every = np.concatenate([outcome.clean, *[c.indices for c in outcome.culprits]])
    assert sorted(every.tolist()) == list(range(size))


# -- the search, with fake verdicts ------------------------------------------------------------
def test_one_bad_device_among_several_loses_only_its_bad_records():
    groups = devices(20, 20, 20, 20)
    bad = {25, 33}  # both from d1

    outcome = CulpritSearch(64).run(groups, BAD, probe_of(bad))

    assert [c.indices.tolist() for c in outcome.culprits] == [[25], [33]]
    assert all(c.resolved and c.rejection == BAD for c in outcome.culprits)
    assert set(outcome.clean.tolist()) == set(range(80)) - bad
    assert_partition(outcome, 80)
    # 4 device probes, then halving d1 only: far fewer than one probe per record
    assert outcome.probes <= 4 + 2 * 2 * 5


def test_bad_records_spread_across_devices_are_each_found():
    groups = devices(16, 16, 16)
    bad = {0, 17, 47}

    outcome = CulpritSearch(64).run(groups, BAD, probe_of(bad))

    assert [c.indices.tolist() for c in outcome.culprits] == [[0], [17], [47]]
    assert set(outcome.clean.tolist()) == set(range(48)) - bad
    assert outcome.unresolved_records == 0


def test_a_single_device_batch_is_bisected_without_a_device_probe():
    calls: list[np.ndarray] = []

    outcome = CulpritSearch(64).run(devices(32), BAD, probe_of({7}, calls))

    assert [c.indices.tolist() for c in outcome.culprits] == [[7]]
    assert len(calls) == outcome.probes == 2 * 5  # two halves per level, 32 -> 1
    assert all(len(c) < 32 for c in calls)  # the whole batch is known to fail already


def test_the_cap_dead_letters_the_remaining_suspect_group_whole():
    groups = devices(32, 32)
    bad = {40, 41, 50}

    outcome = CulpritSearch(max_probes=4).run(groups, BAD, probe_of(bad))

    assert outcome.probes <= 4
    assert_partition(outcome, 64)
    assert set(range(32)) <= set(outcome.clean.tolist())  # the innocent device is trained
    assert not bad & set(outcome.clean.tolist())  # no culprit slips through
    unresolved = [c for c in outcome.culprits if not c.resolved]
    assert unresolved and outcome.unresolved_records == sum(len(c.indices) for c in unresolved)
    assert outcome.unresolved_records > len(bad)  # innocents dead-lettered beyond the cap, counted


def test_with_no_budget_every_device_is_dead_lettered_unresolved():
    outcome = CulpritSearch(max_probes=0).run(devices(4, 4), BAD, probe_of({1}))

    assert outcome.probes == 0 and len(outcome.clean) == 0
    assert outcome.unresolved_records == 8


def test_a_group_unsound_only_as_a_whole_is_dead_lettered_whole():
    def probe(indices: np.ndarray) -> StepRejection | None:
        return BAD if len(indices) > 2 else None  # no single record is to blame

    outcome = CulpritSearch(64).run(devices(4), BAD, probe)

    assert len(outcome.clean) == 0
    (group,) = outcome.culprits
    assert not group.resolved and group.indices.tolist() == [0, 1, 2, 3]


def test_the_outcome_depends_only_on_the_verdicts():
    groups = devices(9, 30, 5)
    first = CulpritSearch(16).run(groups, BAD, probe_of({3, 20, 21, 40}))
    second = CulpritSearch(16).run(groups, BAD, probe_of({3, 20, 21, 40}))

    assert first.clean.tolist() == second.clean.tolist()
    assert [(c.indices.tolist(), c.resolved) for c in first.culprits] == \
           [(c.indices.tolist(), c.resolved) for c in second.culprits]


# -- the driver, with a tiny model -------------------------------------------------------------
class ApplyAtOnce(SyncStrategy):
    """Applies each accepted local step to its own model at once (a one-worker SGD)."""

    name: ClassVar[str] = "apply_at_once"
    role: ClassVar[str] = "worker"
    subscribes: ClassVar[tuple[str, ...]] = ()

    def can_train(self) -> bool:
        return True

    def on_local_step(self, result: StepResult) -> list[Outgoing]:
        self.trainer.apply_gradient(result.gradients)
        return []

    def on_message(self, msg) -> list[Outgoing]:
        return []


def make_driver(max_probes: int = 64) -> TrainingDriver:
    trainer = LocalTrainer(build_model("mlp", (8,), 3, seed=0, hidden=(16,)), lr=0.1)
    strategy = ApplyAtOnce(StrategyContext(worker_id="w0", trainer=trainer))
    return TrainingDriver("w0", trainer, strategy, DriverConfig(job="test", culprit_max_probes=max_probes))


def batch(per_device: int = 12, device_count: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = per_device * device_count
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=n)
    return x, y, devices(*([per_device] * device_count))


@pytest.mark.parametrize("poison", [3e38, 1e30])  # non-finite loss; a finite but enormous gradient
def test_the_driver_trains_everything_but_the_culprits_exactly(poison):
    x, y, groups = batch()
    bad = [14, 20]  # both from d1
    x[bad, 2] = poison
    clean = np.array([i for i in range(len(x)) if i not in bad])
    driver, reference = make_driver(), make_driver()

    stepped = driver.step(x, y, groups)
    expected = reference.step(x[clean], y[clean])

    assert stepped.rejection is None and expected.rejection is None
    assert [c.indices.tolist() for c in stepped.dead] == [[14], [20]]
    assert all(c.resolved for c in stepped.dead)
    assert stepped.dead[0].rejection.reason in ("non_finite_loss", "non_finite_gradient", "gradient_norm")
    assert stepped.trained.tolist() == clean.tolist() and stepped.trained_records == len(clean)
    assert stepped.records == len(x)
    # the innocent records were scored and trained as if the culprits had never been there
    assert driver.trainer.parameter_digest() == reference.trainer.parameter_digest()
    assert driver.trainer.version == 1
    assert stepped.correct_mask.tolist() == expected.correct_mask.tolist()
    assert driver.prequential.records == len(clean)
    # trained per device: d0 and d2 whole, d1 less its two culprits
    trained_devices = groups[stepped.trained]
    assert {d: int((trained_devices == d).sum()) for d in ("d0", "d1", "d2")} == {"d0": 12, "d1": 10, "d2": 12}
    assert driver.stats()["guard"]["culprit_records"] == 2


def test_without_groups_a_refused_step_dead_letters_the_whole_batch():
    x, y, _ = batch()
    x[5, 0] = 3e38
    driver = make_driver()

    stepped = driver.step(x, y)

    assert stepped.rejection is not None and stepped.dead == () and stepped.trained_records == 0
    assert driver.trainer.version == 0


def test_when_every_record_is_a_culprit_nothing_is_trained():
    x, y, groups = batch(per_device=2, device_count=2)
    y[:] = 7  # a class the 3-class model does not have: every record refuses alone
    driver = make_driver()

    stepped = driver.step(x, y, groups)

    assert stepped.rejection is not None and stepped.trained_records == 0
    assert sorted(i for c in stepped.dead for i in c.indices.tolist()) == [0, 1, 2, 3]
    assert {c.rejection.reason for c in stepped.dead} == {"bad_batch"}
    assert driver.trainer.version == 0 and driver.prequential.records == 0


def test_probes_leave_the_model_and_the_guard_untouched():
    x, y, groups = batch()
    x[0, 0] = 3e38
    driver = make_driver(max_probes=2)
    before = driver.trainer.parameter_digest()

    stepped = driver.step(x, y, groups)

    # 3 devices, 2 probes: d0 (failing) and d1 judged, d2 beyond the cap, d0 not narrowed
    assert stepped.probes == 2
    unresolved = sorted(i for c in stepped.dead if not c.resolved for i in c.indices.tolist())
    assert unresolved == list(range(12)) + list(range(24, 36))
    assert stepped.trained.tolist() == list(range(12, 24))
    assert driver.guard.accepted == 1 and driver.guard.rejected == 1  # the refused step and the retry
    assert driver.trainer.parameter_digest() != before and driver.trainer.version == 1
