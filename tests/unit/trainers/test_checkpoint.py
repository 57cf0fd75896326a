"""Checkpoints: atomic writes, exact round trips, typed errors for missing or corrupt files."""

from __future__ import annotations

import os

import pytest
import torch

from edgestream.trainers.checkpoint import (
    MAGIC,
    load_checkpoint,
    restore_training_checkpoint,
    save_checkpoint,
    save_training_checkpoint,
)
from edgestream.trainers.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound
from tests.unit.trainers.fakes import drive_bsp


def _assert_same_tree(left, right) -> None:
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


@pytest.fixture
def bsp_pair(bus, make_node, digits):
    """Two BSP workers after four synchronous steps, one of them mid-step (gradient pending)."""
    shards = digits.shards(2)
    nodes = [
        make_node(name, "bsp", members=("w0", "w1"), data=shards[i], model="digits_cnn")
        for i, name in enumerate(("w0", "w1"))
    ]
    drive_bsp(bus, nodes, target_version=4)
    features, labels = next(nodes[1].batches)
    bus.publish("w1", nodes[1].strategy.on_local_step(nodes[1].trainer.compute_gradient(features, labels)))
    for msg in bus.deliver("w0"):
        nodes[0].strategy.on_message(msg)
    return nodes


def test_training_checkpoint_round_trip_restores_model_optimizer_strategy_and_offsets(
    tmp_path, bsp_pair, make_node
):
    worker = bsp_pair[0]
    path = tmp_path / "w0.ckpt"
    offsets = {"gradients.job:0": 41, "sensors.dev1:0": 1234}

    save_training_checkpoint(path, worker.trainer, worker.strategy, offsets, meta={"job": "digits"})
    restored = make_node("w0", "bsp", members=("w0", "w1"), model="digits_cnn", seed=99)
    checkpoint = restore_training_checkpoint(path, restored.trainer, restored.strategy)

    assert restored.trainer.parameter_digest() == worker.trainer.parameter_digest()
    assert restored.trainer.version == worker.trainer.version == 4
    _assert_same_tree(restored.trainer.optimizer.state_dict(), worker.trainer.optimizer.state_dict())
    _assert_same_tree(restored.strategy.state_dict(), worker.strategy.state_dict())
    assert checkpoint.offsets == offsets
    assert checkpoint.meta["job"] == "digits"


def test_restored_worker_continues_exactly_like_the_original(tmp_path, bsp_pair, make_node):
    worker = bsp_pair[0]
    path = tmp_path / "w0.ckpt"
    save_training_checkpoint(path, worker.trainer, worker.strategy, offsets={})
    restored = make_node("w0", "bsp", members=("w0", "w1"), model="digits_cnn", seed=5)
    restore_training_checkpoint(path, restored.trainer, restored.strategy)
    batch = next(worker.batches)

    for node in (worker, restored):
        # The peer's step-4 gradient is in the pending state (restored from the
        # checkpoint for the copy); the own gradient completes the step on its return.
        for outgoing in node.strategy.on_local_step(node.trainer.compute_gradient(*batch)):
            node.strategy.on_message(outgoing.message)

    assert restored.trainer.version == worker.trainer.version == 5
    assert restored.trainer.parameter_digest() == worker.trainer.parameter_digest()


def test_raw_save_and_load_round_trip_any_tensor_state(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "nested": {"k": [1, 2.5, "x", None]}}

    save_checkpoint(tmp_path / "c.ckpt", state, {"lr": 0.1}, {"step": 3}, {"t:0": 9}, {"note": "hi"})
    loaded = load_checkpoint(tmp_path / "c.ckpt")

    _assert_same_tree(loaded.model_state, state)
    assert (loaded.optimizer_state, loaded.strategy_state) == ({"lr": 0.1}, {"step": 3})
    assert (loaded.offsets, loaded.meta) == ({"t:0": 9}, {"note": "hi"})


def test_saving_over_a_checkpoint_replaces_it_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, {"v": torch.zeros(1)}, {}, {}, {}, {"n": 1})

    save_checkpoint(path, {"v": torch.ones(1)}, {}, {}, {}, {"n": 2})

    assert load_checkpoint(path).meta == {"n": 2}
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]


def test_a_failed_write_keeps_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, {"v": torch.zeros(1)}, {}, {}, {}, {"n": 1})

    def crash(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(CheckpointError, match="disk full"):
        save_checkpoint(path, {"v": torch.ones(1)}, {}, {}, {}, {"n": 2})
    monkeypatch.undo()

    assert load_checkpoint(path).meta == {"n": 1}
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]


def test_missing_checkpoint_raises_not_found(tmp_path):
    with pytest.raises(CheckpointNotFound) as caught:
        load_checkpoint(tmp_path / "absent.ckpt")

    assert caught.value.path == tmp_path / "absent.ckpt"
    assert isinstance(caught.value, FileNotFoundError)


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _wrong_magic(data: bytes) -> bytes:
    return b"X" + data[1:]


def _foreign_payload(data: bytes) -> bytes:
    import hashlib

    payload = b"not a torch file at all"
    return MAGIC + hashlib.sha256(payload).digest() + payload


@pytest.mark.parametrize("corrupt", [_truncate, _flip_last_byte, _wrong_magic, _foreign_payload, lambda d: b""])
def test_corrupt_checkpoints_raise_checkpoint_corrupt(tmp_path, corrupt):
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, {"v": torch.zeros(10)}, {}, {}, {}, {})
    path.write_bytes(corrupt(path.read_bytes()))

    with pytest.raises(CheckpointCorrupt):
        load_checkpoint(path)


class _Opaque:
    """A picklable object that weights_only loading refuses."""


@pytest.mark.parametrize("bad_state", [{"obj": _Opaque()}, {"fn": lambda: None}])
def test_state_a_safe_load_would_refuse_is_not_written(tmp_path, bad_state):
    with pytest.raises(CheckpointError, match="weights_only"):
        save_checkpoint(tmp_path / "c.ckpt", {}, {}, bad_state, {}, {})

    assert not (tmp_path / "c.ckpt").exists()


def test_non_json_offsets_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path / "c.ckpt", {}, {}, {}, {"t:0": float("nan")}, {})


def test_checkpoint_of_another_model_does_not_restore(tmp_path, make_node):
    source = make_node("w0", "bsp", members=("w0",), model="mlp")
    target = make_node("w0b", "bsp", members=("w0",), model="digits_cnn")
    save_training_checkpoint(tmp_path / "c.ckpt", source.trainer, source.strategy, offsets={})

    with pytest.raises(CheckpointCorrupt, match="does not fit"):
        restore_training_checkpoint(tmp_path / "c.ckpt", target.trainer, target.strategy)


@pytest.mark.parametrize("where", ["parent", "grandparent"])
def test_a_directory_that_became_a_file_is_a_checkpoint_error_naming_it(tmp_path, where):
    """A disk failure anywhere on the way (here: a file where the checkpoint's directory, or the
    directory above it, should be) is a CheckpointError saying "Not a directory", never a bare OSError."""
    blocked = tmp_path / "checkpoints"
    blocked.write_text("not a directory\n")
    target = blocked / "ckpt.bin" if where == "parent" else blocked / "deeper" / "ckpt.bin"

    with pytest.raises(CheckpointError, match="Not a directory"):
        save_checkpoint(target, {"w": torch.zeros(2)}, {}, {}, {}, {})
