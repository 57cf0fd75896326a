"""CheckpointStore and the refusal rule: no unsound state saved or restored, newest good one wins."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgestream.trainers.checkpoint import (
    FORMAT_VERSION,
    LEGACY_NAME,
    MAGIC,
    MODEL_VERSION_KEY,
    REASON_SUFFIX,
    REJECTED_DIR,
    CheckpointStore,
    checkpoint_name,
    find_unsound_tensor,
    load_checkpoint,
    restore_training_checkpoint,
    save_checkpoint,
    save_training_checkpoint,
)
from edgestream.trainers.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointRefused,
    CheckpointUnsound,
    NoUsableCheckpoint,
)
from edgestream.trainers.local import LocalTrainer, StepResult
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.models import build_model
from edgestream.trainers.strategies import StrategyContext, SyncStrategy, create

Worker = tuple[LocalTrainer, SyncStrategy]


# -- helpers ------------------------------------------------------------------------------


def _worker(seed: int = 0, members: tuple[str, ...] = ("w0",)) -> Worker:
    trainer = LocalTrainer(build_model("mlp", (8,), 3, seed=seed), lr=0.1, momentum=0.9)
    return trainer, create("bsp", StrategyContext("w0", trainer, members=members))


def _train(worker: Worker, steps: int, seed: int = 0) -> None:
    """BSP steps of a one-member job: the own gradient coming back completes each step."""
    trainer, strategy = worker
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        features = rng.normal(size=(16, 8)).astype(np.float32)
        labels = rng.integers(0, 3, size=16)
        for outgoing in strategy.on_local_step(trainer.compute_gradient(features, labels)):
            strategy.on_message(outgoing.message)


def _trained(seed: int = 0, steps: int = 2) -> Worker:
    worker = _worker(seed)
    _train(worker, steps, seed)
    return worker


def _fingerprint(worker: Worker) -> dict[str, Any]:
    """Everything a restore may change: parameters, version, optimizer and strategy state."""
    trainer, strategy = worker
    return {
        "digest": trainer.parameter_digest(),
        "version": trainer.version,
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "strategy": copy.deepcopy(strategy.state_dict()),
    }


def _assert_same_tree(left: Any, right: Any) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and torch.equal(left, right)
    elif isinstance(left, dict):
        assert left.keys() == right.keys()
        for key in left:
            _assert_same_tree(left[key], right[key])
    elif isinstance(left, list | tuple):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            _assert_same_tree(a, b)
    else:
        assert left == right


def _write_unchecked(path: Path, worker: Worker, meta: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint in the on-disk format, bypassing every check save_checkpoint makes.

    Stands for a file written by an older or buggy writer (e.g. the 5e34 weights of the
    crash loop).
    """
    trainer, strategy = worker
    state = trainer.state_dict()
    payload_obj = {
        "format": FORMAT_VERSION,
        "model": state["model"],
        "optimizer": state["optimizer"],
        "strategy": strategy.state_dict(),
        "offsets_json": json.dumps({}),
        "meta_json": json.dumps({**(meta or {}), MODEL_VERSION_KEY: state["version"]}),
    }
    buffer = io.BytesIO()
    torch.save(payload_obj, buffer)
    payload = buffer.getvalue()
    path.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
    return path


def _poison_parameters(trainer: LocalTrainer, value: float) -> None:
    params = trainer.get_parameters()
    params["1.weight"][0, :3] = value
    trainer.set_parameters(params)


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# -- refusing unsound state ----------------------------------------------------------------


def _nan_in_model(worker: Worker) -> str:
    _poison_parameters(worker[0], float("nan"))
    return r"model\['1.weight'\]: 3 non-finite values"


def _inf_in_momentum(worker: Worker) -> str:
    momentum = worker[0].get_momentum()
    momentum["3.bias"][1] = float("inf")
    worker[0].set_momentum(momentum)
    # SGD's state is keyed by parameter index; 3.bias is the fourth parameter.
    return r"optimizer\['state'\]\[3\]\['momentum_buffer'\]: 1 non-finite value\b"


def _nan_in_strategy(worker: Worker) -> str:
    """A two-member BSP worker holding its own NaN gradient as pending (waiting for w1)."""
    trainer, strategy = worker
    shapes = trainer.parameter_shapes()
    gradients = {name: torch.zeros(shape) for name, shape in shapes.items()}
    gradients["3.weight"][0, 0] = float("nan")
    result = StepResult(gradients=gradients, loss=1.0, batch_size=16, base_version=trainer.version)
    for outgoing in strategy.on_local_step(result):
        strategy.on_message(outgoing.message)
    return r"strategy\['pending'\]\[0\]\['tensors'\]\['3.weight'\]: 1 non-finite value\b"


@pytest.mark.parametrize("poison", [_nan_in_model, _inf_in_momentum, _nan_in_strategy])
def test_unsound_state_is_refused_naming_the_tensor_and_nothing_is_written(
    tmp_path: Path, poison: Callable[[Worker], str]
) -> None:
    worker = _worker(members=("w0", "w1"))
    trainer, strategy = worker
    # A sound step first, so momentum exists and a previous checkpoint is on disk.
    grads = {name: torch.full(shape, 0.01) for name, shape in trainer.parameter_shapes().items()}
    trainer.apply_gradient(grads)
    store = CheckpointStore(tmp_path, keep=3)
    first = store.save(trainer, strategy, offsets={"s:0": 1})
    expected = poison(worker)

    with pytest.raises(CheckpointRefused, match=expected) as caught:
        store.save(trainer, strategy, offsets={"s:0": 2})

    assert caught.value.path == tmp_path / checkpoint_name(2)
    assert _names(tmp_path) == [first.name]
    assert load_checkpoint(first).offsets == {"s:0": 1}


def test_save_checkpoint_refuses_nan_and_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, {"w": torch.ones(4)}, {}, {}, {}, {"n": 1})

    with pytest.raises(CheckpointRefused, match=r"model\['w'\]: 2 non-finite values"):
        save_checkpoint(path, {"w": torch.tensor([1.0, float("nan"), float("-inf"), 0.0])}, {}, {}, {}, {"n": 2})

    assert load_checkpoint(path).meta == {"n": 1}
    assert _names(tmp_path) == ["c.ckpt"]


def test_max_abs_refuses_absurd_but_finite_state_and_none_means_no_bound(tmp_path: Path) -> None:
    trainer, strategy = _trained()
    _poison_parameters(trainer, 5e34)

    with pytest.raises(CheckpointRefused, match=r"model\['1.weight'\]: 3 values beyond max_abs=1000"):
        CheckpointStore(tmp_path / "bounded", max_abs=1e3).save(trainer, strategy, offsets={})
    unbounded = CheckpointStore(tmp_path / "unbounded").save(trainer, strategy, offsets={})

    assert not (tmp_path / "bounded").exists() or _names(tmp_path / "bounded") == []
    assert float(load_checkpoint(unbounded).model_state["1.weight"].abs().max()) == pytest.approx(5e34)


def test_integer_tensors_and_scalars_are_not_judged() -> None:
    state = {"count": torch.tensor([10**12]), "lr": float("inf"), "w": torch.ones(2)}

    assert find_unsound_tensor({"optimizer": state}, max_abs=10.0) is None


def test_invalid_store_parameters_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(ValueError, match="max_abs"):
        CheckpointStore(tmp_path, max_abs=float("nan"))


# -- keeping the last few -----------------------------------------------------------------


def test_keep_three_keeps_exactly_the_three_newest_after_five_saves(tmp_path: Path) -> None:
    trainer, strategy = _worker()
    store = CheckpointStore(tmp_path, keep=3)

    written = [store.save(trainer, strategy, offsets={"s:0": i}) for i in range(5)]

    assert [p.name for p in written] == [checkpoint_name(i) for i in range(1, 6)]
    assert _names(tmp_path) == [checkpoint_name(3), checkpoint_name(4), checkpoint_name(5)]
    assert load_checkpoint(written[-1]).offsets == {"s:0": 4}


def test_names_are_never_reused_after_pruning_or_deletion(tmp_path: Path) -> None:
    trainer, strategy = _worker()
    store = CheckpointStore(tmp_path, keep=1)
    for _ in range(3):
        store.save(trainer, strategy, offsets={})

    restarted = CheckpointStore(tmp_path, keep=1)  # a new process: only the disk to go by
    after_restart = restarted.save(trainer, strategy, offsets={})
    for name in _names(tmp_path):
        (tmp_path / name).unlink()
    after_wipe = restarted.save(trainer, strategy, offsets={})

    assert after_restart.name == checkpoint_name(4)
    assert after_wipe.name == checkpoint_name(5)  # the store remembers the names it used
    assert _names(tmp_path) == [checkpoint_name(5)]


def test_pruning_touches_only_its_own_names_and_removes_orphaned_temp_files(tmp_path: Path) -> None:
    trainer, strategy = _worker()
    foreign = ["evaluations.jsonl", "checkpoint-7.bin", "checkpoint-000000001.bin.bak"]
    for name in foreign:
        (tmp_path / name).write_text("keep me")
    orphan = tmp_path / f".{checkpoint_name(1)}.abc123.tmp"  # a save killed mid-write
    orphan.write_bytes(b"half")
    store = CheckpointStore(tmp_path, keep=1)

    for _ in range(3):
        store.save(trainer, strategy, offsets={})

    assert _names(tmp_path) == sorted([*foreign, checkpoint_name(3)])


# -- restoring with fallback --------------------------------------------------------------


def test_restore_picks_the_newest(tmp_path: Path) -> None:
    source = _trained(steps=1)
    store = CheckpointStore(tmp_path)
    store.save(*source, offsets={"s:0": 1})
    _train(source, 2, seed=1)
    store.save(*source, offsets={"s:0": 3}, meta={"steps": 3})
    target = _worker(seed=7)

    result = CheckpointStore(tmp_path).restore(*target)

    assert result.path == tmp_path / checkpoint_name(2)
    assert result.skipped == ()
    assert (result.checkpoint.offsets, result.checkpoint.meta["steps"]) == ({"s:0": 3}, 3)
    _assert_same_tree(_fingerprint(target), _fingerprint(source))


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip_a_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(_truncate, "digest mismatch"), (_flip_a_byte, "digest mismatch"), (lambda d: b"", "bad magic")],
)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[bytes], bytes], reason: str
) -> None:
    source = _trained(steps=1)
    store = CheckpointStore(tmp_path)
    store.save(*source, offsets={"s:0": 1})
    good = _fingerprint(source)
    _train(source, 1, seed=1)
    newest = store.save(*source, offsets={"s:0": 2})
    newest.write_bytes(damage(newest.read_bytes()))
    target = _worker(seed=7)

    with caplog.at_level(logging.WARNING, logger="edgestream.trainers.checkpoint"):
        result = CheckpointStore(tmp_path).restore(*target)

    assert result.path == tmp_path / checkpoint_name(1)
    assert [s.path for s in result.skipped] == [newest]
    assert reason in result.skipped[0].reason
    assert any(str(newest) in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    _assert_same_tree(_fingerprint(target), good)


@pytest.mark.parametrize(("value", "max_abs", "reason"), [(float("nan"), None, "non-finite"), (5e34, 1e6, "beyond max_abs")])
def test_an_unsound_newest_checkpoint_falls_back_to_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: float, max_abs: float | None, reason: str
) -> None:
    source = _trained(steps=1)
    CheckpointStore(tmp_path).save(*source, offsets={"s:0": 1})
    good = _fingerprint(source)
    _train(source, 1, seed=1)
    _poison_parameters(source[0], value)
    bad = _write_unchecked(tmp_path / checkpoint_name(2), source)
    target = _worker(seed=7)

    with caplog.at_level(logging.WARNING, logger="edgestream.trainers.checkpoint"):
        result = CheckpointStore(tmp_path, max_abs=max_abs).restore(*target)

    assert result.path == tmp_path / checkpoint_name(1)
    assert result.skipped[0].path == bad
    assert "model['1.weight']: 3" in result.skipped[0].reason and reason in result.skipped[0].reason
    assert any(str(bad) in r.getMessage() for r in caplog.records)
    _assert_same_tree(_fingerprint(target), good)


def _other_architecture(path: Path) -> None:
    """Fits the strategy but not the model: torch copies the matching tensors first."""
    trainer = LocalTrainer(build_model("mlp", (8,), 5, seed=3), lr=0.1, momentum=0.9)
    strategy = create("bsp", StrategyContext("w0", trainer, members=("w0",)))
    _train((trainer, strategy), 1, seed=3)
    save_training_checkpoint(path, trainer, strategy, offsets={})


def _strategy_missing_fields(path: Path) -> None:
    """Fits the trainer (which loads it) and half the strategy (counters), then a KeyError."""
    trainer, _ = _trained(seed=4, steps=3)
    state = trainer.state_dict()
    save_checkpoint(
        path,
        state["model"],
        state["optimizer"],
        {"counters": {"forged": 99}, "staleness": {"5": 1}},
        {},
        {MODEL_VERSION_KEY: state["version"]},
    )


def _non_finite(path: Path) -> None:
    worker = _trained(seed=5, steps=1)
    _poison_parameters(worker[0], float("inf"))
    _write_unchecked(path, worker)


def _negative_version(path: Path) -> None:
    """Model, optimizer and strategy all fit; the version is refused last of all."""
    trainer, strategy = _trained(seed=6, steps=1)
    state = trainer.state_dict()
    save_checkpoint(path, state["model"], state["optimizer"], strategy.state_dict(), {}, {MODEL_VERSION_KEY: -1})


def test_rejected_candidates_leave_trainer_and_strategy_exactly_as_they_were(tmp_path: Path) -> None:
    writers = [_other_architecture, _strategy_missing_fields, _non_finite, _negative_version]
    for seq, write in enumerate(writers, start=1):
        write(tmp_path / checkpoint_name(seq))
    target = _trained(seed=8, steps=2)
    before = _fingerprint(target)

    with pytest.raises(NoUsableCheckpoint):
        CheckpointStore(tmp_path).restore(*target)

    _assert_same_tree(_fingerprint(target), before)
    # And the worker still trains (optimizer state rolled back, not just equal-looking).
    _train(target, 1, seed=9)
    assert target[0].version == before["version"] + 1


def test_a_part_way_failure_rolls_back_with_the_single_file_restore_too(tmp_path: Path) -> None:
    _strategy_missing_fields(tmp_path / "c.ckpt")
    target = _trained(seed=8, steps=2)
    before = _fingerprint(target)

    with pytest.raises(CheckpointCorrupt, match="does not fit"):
        restore_training_checkpoint(tmp_path / "c.ckpt", *target)

    _assert_same_tree(_fingerprint(target), before)


def test_restore_training_checkpoint_refuses_non_finite_state(tmp_path: Path) -> None:
    _non_finite(tmp_path / "c.ckpt")
    target = _worker(seed=8)
    before = _fingerprint(target)

    with pytest.raises(CheckpointUnsound, match=r"model\['1.weight'\]: 3 non-finite") as caught:
        restore_training_checkpoint(tmp_path / "c.ckpt", *target)

    assert isinstance(caught.value, CheckpointCorrupt)
    _assert_same_tree(_fingerprint(target), before)


def test_all_bad_raises_no_usable_checkpoint_listing_each_file_and_the_way_out(tmp_path: Path) -> None:
    source = _trained(steps=1)
    store = CheckpointStore(tmp_path)
    first = store.save(*source, offsets={})
    second = store.save(*source, offsets={})
    first.write_bytes(_truncate(first.read_bytes()))
    _poison_parameters(source[0], float("nan"))
    third = _write_unchecked(tmp_path / checkpoint_name(3), source)
    second.write_bytes(b"")

    with pytest.raises(NoUsableCheckpoint) as caught:
        CheckpointStore(tmp_path).restore(*_worker(seed=7))

    error = caught.value
    assert error.path == tmp_path
    assert [path for path, _ in error.rejected] == [third, second, first]
    message = str(error)
    assert "\n" not in message  # one line: the CLI prints only a message's first line
    for path, why in [(third, "non-finite"), (second, "bad magic"), (first, "digest mismatch")]:
        assert f"{path.name}: " in message and why in message
    assert message.endswith(f"a restart cannot help: to start this worker from scratch (initial model, topics "
                            f"re-read from the consumer group's committed offsets) move them aside, e.g. "
                            f"`mv {tmp_path} {tmp_path}.rejected` (keep them for inspection), or put a good "
                            f"checkpoint file back into {tmp_path}")
    assert not isinstance(error, CheckpointNotFound)
    # Nothing moved: a restart meets the same files and fails the same way.
    assert _names(tmp_path) == [checkpoint_name(i) for i in (1, 2, 3)]
    with pytest.raises(NoUsableCheckpoint):
        CheckpointStore(tmp_path).restore(*_worker(seed=7))


def test_a_foreign_payload_is_rejected_with_torchs_reason_without_its_boilerplate(tmp_path: Path) -> None:
    payload = b"not a torch payload"
    path = tmp_path / checkpoint_name(1)
    path.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)

    with pytest.raises(CheckpointCorrupt) as caught:
        load_checkpoint(path)

    assert caught.value.detail == "payload does not load safely: Unsupported operand 110"


def test_a_long_multi_line_reason_is_collapsed_and_clipped_in_the_message(tmp_path: Path) -> None:
    reason = "state does not fit this job: Error(s) in loading state_dict for MLP:\n\t" + "size mismatch " * 40

    message = str(NoUsableCheckpoint(tmp_path, [(tmp_path / checkpoint_name(1), reason)]))

    assert "\n" not in message and "\t" not in message
    assert f"({checkpoint_name(1)}: state does not fit this job: Error(s) in loading state_dict for MLP: size" in message
    clipped = message.split(": ", 2)[-1].split("); a restart")[0]
    assert clipped.endswith("...") and len(clipped) <= NoUsableCheckpoint.REASON_CHARS + len(checkpoint_name(1)) + 2


def test_a_legacy_file_outside_the_directory_is_named_in_full_with_the_way_out(tmp_path: Path) -> None:
    legacy = tmp_path / LEGACY_NAME
    directory = tmp_path / "checkpoints"

    message = str(NoUsableCheckpoint(directory, [(legacy, "bad magic")]))

    assert f"({legacy}: bad magic)" in message
    assert f"`mv {directory} {directory}.rejected`, and {legacy} too" in message


@pytest.mark.parametrize("make_dir", [True, False])
def test_no_checkpoint_files_is_not_found(tmp_path: Path, make_dir: bool) -> None:
    directory = tmp_path / "state"
    if make_dir:
        directory.mkdir()
        (directory / "evaluations.jsonl").write_text("{}\n")

    with pytest.raises(CheckpointNotFound) as caught:
        CheckpointStore(directory).restore(*_worker())

    assert caught.value.path == directory


def test_rejected_files_do_not_push_good_ones_out(tmp_path: Path) -> None:
    worker = _trained(steps=1)
    store = CheckpointStore(tmp_path, keep=3)
    good = store.save(*worker, offsets={})
    for seq in (2, 3):
        (tmp_path / checkpoint_name(seq)).write_bytes(b"garbage")
    restarted = CheckpointStore(tmp_path, keep=3)
    assert restarted.restore(*_worker(seed=7)).path == good

    moved_at_restore = _names(tmp_path)
    restarted.save(*worker, offsets={})
    restarted.save(*worker, offsets={})
    kept_while_fewer_than_three_good = _names(tmp_path)
    restarted.save(*worker, offsets={})

    # The rejected files were moved into rejected/ at once, each with its reason.
    assert moved_at_restore == [checkpoint_name(1), REJECTED_DIR]
    rejected = tmp_path / REJECTED_DIR
    assert _names(rejected) == [f"{checkpoint_name(s)}{suffix}" for s in (2, 3) for suffix in ("", REASON_SUFFIX)]
    assert (rejected / checkpoint_name(2)).read_bytes() == b"garbage"
    assert "bad magic" in (rejected / (checkpoint_name(3) + REASON_SUFFIX)).read_text()
    # Numbers go on above the rejected ones (never reused); only good files count toward keep.
    assert kept_while_fewer_than_three_good == [checkpoint_name(i) for i in (1, 4, 5)] + [REJECTED_DIR]
    assert _names(tmp_path) == [checkpoint_name(i) for i in (4, 5, 6)] + [REJECTED_DIR]
    assert len(_names(rejected)) == 4  # pruning never touches rejected/


def test_keep_three_with_a_rejected_newest_leaves_three_good_files_beside_rejected(tmp_path: Path) -> None:
    """The issue's case: 4 files with checkpoint_keep = 3 after a corrupt newest one."""
    worker = _trained(steps=1)
    store = CheckpointStore(tmp_path, keep=3)
    for _ in range(3):
        store.save(*worker, offsets={})
    newest = store.save(*worker, offsets={})  # 2, 3, 4 kept
    newest.write_bytes(_truncate(newest.read_bytes()))

    restarted = CheckpointStore(tmp_path, keep=3)
    result = restarted.restore(*_worker(seed=7))
    restarted.save(*worker, offsets={})

    assert result.path == tmp_path / checkpoint_name(3)
    assert [s.path for s in result.skipped] == [newest]
    assert _names(tmp_path) == [checkpoint_name(i) for i in (2, 3, 5)] + [REJECTED_DIR]
    assert _names(tmp_path / REJECTED_DIR) == [checkpoint_name(4), checkpoint_name(4) + REASON_SUFFIX]


# -- the legacy single file -----------------------------------------------------------------


def test_a_legacy_checkpoint_bin_alone_restores(tmp_path: Path) -> None:
    source = _trained(steps=2)
    save_training_checkpoint(tmp_path / LEGACY_NAME, *source, offsets={"s:0": 7})
    target = _worker(seed=7)

    result = CheckpointStore(tmp_path).restore(*target)

    assert result.path == tmp_path / LEGACY_NAME
    assert result.checkpoint.offsets == {"s:0": 7}
    _assert_same_tree(_fingerprint(target), _fingerprint(source))


def test_the_legacy_file_is_the_oldest_candidate_and_is_pruned_once_keep_newer_exist(
    tmp_path: Path,
) -> None:
    source = _trained(steps=1)
    save_training_checkpoint(tmp_path / LEGACY_NAME, *source, offsets={"s:0": 0})
    store = CheckpointStore(tmp_path, keep=2)

    first = store.save(*source, offsets={"s:0": 1})
    restored_while_both = CheckpointStore(tmp_path).restore(*_worker(seed=7))
    legacy_after_one = (tmp_path / LEGACY_NAME).exists()
    store.save(*source, offsets={"s:0": 2})

    assert first.name == checkpoint_name(1)
    assert restored_while_both.path == first
    assert legacy_after_one
    assert _names(tmp_path) == [checkpoint_name(1), checkpoint_name(2)]


def test_a_corrupt_newest_falls_back_to_the_legacy_file(tmp_path: Path) -> None:
    source = _trained(steps=1)
    save_training_checkpoint(tmp_path / LEGACY_NAME, *source, offsets={"s:0": 0})
    newest = CheckpointStore(tmp_path).save(*source, offsets={"s:0": 1})
    newest.write_bytes(_truncate(newest.read_bytes()))

    result = CheckpointStore(tmp_path).restore(*_worker(seed=7))

    assert result.path == tmp_path / LEGACY_NAME
    assert [s.path for s in result.skipped] == [newest]


def test_a_nan_gradient_message_in_the_strategy_is_found_in_its_state() -> None:
    """The label format of nested strategy state: what an operator reads in the refusal."""
    trainer, strategy = _worker(members=("w0", "w1"))
    grads = {n: torch.zeros(s) for n, s in trainer.parameter_shapes().items()}
    grads["1.bias"][5] = float("nan")
    msg = UpdateMessage(kind="gradient", sender="w1", step=0, base_version=0, batch_size=4, tensors=grads)
    strategy.on_message(msg)

    problem = find_unsound_tensor({"strategy": strategy.state_dict()})

    assert problem == "strategy['pending'][0]['tensors']['1.bias']: 1 non-finite value"


def test_a_legacy_file_outside_the_store_directory_is_found_and_pruned(tmp_path: Path) -> None:
    source = _trained(steps=1)
    legacy = save_training_checkpoint(tmp_path / LEGACY_NAME, *source, offsets={"s:0": 0})
    store = CheckpointStore(tmp_path / "checkpoints", keep=1, legacy_path=legacy)

    restored = store.restore(*_worker(seed=7))
    store.save(*source, offsets={"s:0": 1})

    assert restored.path == legacy
    assert not legacy.exists()
    assert _names(tmp_path / "checkpoints") == [checkpoint_name(1)]


def test_skipped_entries_unpack_as_path_and_reason(tmp_path: Path) -> None:
    source = _trained(steps=1)
    store = CheckpointStore(tmp_path)
    store.save(*source, offsets={})
    newest = store.save(*source, offsets={})
    newest.write_bytes(b"")

    [(path, reason)] = CheckpointStore(tmp_path).restore(*_worker(seed=7)).skipped

    assert path == newest and "bad magic" in reason
