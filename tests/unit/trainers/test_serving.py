"""The model ``edgestream serve`` predicts with: the swap rule, and candidates from each source
loaded, or refused with their reason (shape, digest, backwards, invalid)."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.job.config import load_config
from edgestream.job.plan import training_plan
from edgestream.job.sources import job_fleet_data
from edgestream.trainers import assembly
from edgestream.trainers.checkpoint import CheckpointStore
from edgestream.trainers.evaluation import predict_proba
from edgestream.trainers.export import export_model
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.serving import (
    BACKWARDS,
    DIGEST,
    INVALID,
    SAME,
    SHAPE,
    SWAP,
    ModelId,
    ModelLoader,
    ModelRefused,
    swap_decision,
)
from edgestream.trainers.strategies.base import snapshot_message
from edgestream.trainers.wire import encode_update

A, B = "a" * 64, "b" * 64


@pytest.mark.parametrize(("current", "candidate", "expected"), [
    (None, ModelId(0, A, "x"), SWAP),
    (ModelId(3, A, "x"), ModelId(4, B, "y"), SWAP),
    (ModelId(3, A, "x"), ModelId(3, A, "y"), SAME),
])
def test_a_newer_model_swaps_and_the_same_one_changes_nothing(current, candidate, expected):
    assert swap_decision(current, candidate) == expected


@pytest.mark.parametrize(("candidate", "message"), [
    (ModelId(2, A, "y"), "version 2 is older than version 3 in use"),
    (ModelId(3, B, "y"), "version 3 again with another digest"),
])
def test_an_older_version_or_the_same_one_with_another_digest_is_refused(candidate, message):
    with pytest.raises(ModelRefused, match=message) as refused:
        swap_decision(ModelId(3, A, "x"), candidate)
    assert refused.value.reason == BACKWARDS


def job(*overrides: str):
    cfg = load_config(overrides=["job.name=sv", "train.enabled=true", "train.model=mlp", "workers.count=1",
                                 "data.source=synthetic", *overrides], env={})
    return training_plan(cfg), job_fleet_data(cfg)


@pytest.fixture(scope="module")
def served():
    plan, data = job()
    return plan, data, ModelLoader(plan, data, "w0")


def trained(plan, data, version: int, seed_shift: float = 0.0):
    trainer = assembly.build_trainer(plan, "w0", data)
    params = {k: v + seed_shift for k, v in trainer.get_parameters().items()}
    trainer.load_snapshot(params, trainer.get_buffers(), version=version)
    return trainer


def test_a_snapshot_loads_with_its_version_and_the_trainers_digest_and_predicts_as_the_trainer(served):
    plan, data, loader = served
    trainer = trained(plan, data, 7, 0.01)
    value, _ = encode_update(snapshot_message(trainer, "server"), job=plan.job)
    model = loader.from_message(value, "models.sv")
    assert (model.ident.version, model.ident.digest) == (7, trainer.parameter_digest())
    features = data.train.features[:20]
    classes, probabilities = model.predict(features, 3)
    expected = predict_proba(trainer.model, features)
    assert classes.shape == (20, 3) and (classes[:, 0] == expected.argmax(axis=1)).all()
    assert np.allclose(probabilities[:, 0], expected.max(axis=1))


def test_a_forward_pass_per_chunk_gives_the_rows_of_one_pass_in_order(served):
    plan, data, loader = served
    trainer = trained(plan, data, 3, 0.02)
    value, _ = encode_update(snapshot_message(trainer, "server"), job=plan.job)
    model = loader.from_message(value, "models.sv")
    features = data.train.features[:23]
    whole = model.predict(features, 2)
    for chunk in (4, 23, 64):
        classes, probabilities = model.predict(features, 2, chunk=chunk)
        assert classes.shape == (23, 2) and (classes == whole[0]).all()
        assert np.allclose(probabilities, whole[1], atol=1e-6)


def test_a_snapshot_of_another_model_is_refused_as_shape(served):
    plan, data, loader = served
    other_plan, other_data = job("train.model_params=hidden=[8]")
    value, _ = encode_update(snapshot_message(trained(other_plan, other_data, 9), "server"), job=plan.job)
    with pytest.raises(ModelRefused) as refused:
        loader.from_message(value, "models.sv")
    assert refused.value.reason == SHAPE


@pytest.mark.parametrize("damage", ["truncated", "not_a_model", "other_job"])
def test_a_damaged_or_foreign_message_is_refused_as_invalid(served, damage):
    plan, data, loader = served
    trainer = trained(plan, data, 2)
    msg = snapshot_message(trainer, "server")
    if damage == "not_a_model":
        msg = UpdateMessage(kind="gradient", sender="server", step=1, base_version=2, batch_size=4,
                            tensors=trainer.get_parameters())
    value, _ = encode_update(msg, job="another" if damage == "other_job" else plan.job, compress=False)
    if damage == "truncated":
        value = value[:-10]
    with pytest.raises(ModelRefused) as refused:
        loader.from_message(value, "models.sv")
    assert refused.value.reason == INVALID


def test_a_checkpoint_loads_and_an_altered_one_is_refused_as_digest(served, tmp_path):
    plan, data, loader = served
    driver = assembly.build_driver(plan, "w0", data)
    driver.trainer.load_snapshot(trained(plan, data, 5, 0.02).get_parameters(), driver.trainer.get_buffers(),
                                 version=5)
    path = CheckpointStore(tmp_path).save(driver.trainer, driver.strategy, offsets={},
                                          meta={"model_version": 5})
    model = loader.from_checkpoint(path)
    assert (model.ident.version, model.ident.digest) == (5, driver.trainer.parameter_digest())
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelRefused) as refused:
        loader.from_checkpoint(path)
    assert refused.value.reason == DIGEST


def export_of(plan, data, trainer, directory, version: int) -> None:
    export_model(trainer.model, directory, input_shape=data.feature_shape, num_classes=data.num_classes,
                 check_features=data.train.features[:8], formats=("safetensors",),
                 card={"model": {"name": plan.model, "params": dict(plan.model_params)},
                       "version": {"model_version": version}})


def test_an_export_loads_with_its_cards_version_and_an_altered_file_is_refused_as_digest(served, tmp_path):
    plan, data, loader = served
    trainer = trained(plan, data, 11, 0.03)
    export_of(plan, data, trainer, tmp_path / "e", 11)
    model = loader.from_export(tmp_path / "e")
    assert (model.ident.version, model.ident.digest) == (11, trainer.parameter_digest())
    weights = tmp_path / "e" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-4] ^= 0x01
    weights.write_bytes(bytes(raw))
    with pytest.raises(ModelRefused) as refused:
        loader.from_export(tmp_path / "e")
    assert refused.value.reason == DIGEST


def test_an_export_of_another_model_is_refused_as_shape(served, tmp_path):
    plan, data, loader = served
    other_plan, other_data = job("train.model_params=hidden=[8]")
    export_of(other_plan, other_data, trained(other_plan, other_data, 4), tmp_path / "e", 4)
    with pytest.raises(ModelRefused, match="model 'mlp'") as refused:
        loader.from_export(tmp_path / "e")
    assert refused.value.reason == SHAPE
