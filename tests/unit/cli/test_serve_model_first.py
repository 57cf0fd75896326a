"""`edgestream serve` checks the job's model before it probes the broker: a typo in the model, a
factory that fails, an export directory that is not there or holds another model exit 2 with one
line, and the broker (here an address nothing listens on) is never contacted."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.cli.main import main
from edgestream.pipeline import kafka_io
from edgestream.trainers.export import export_model
from edgestream.trainers.models import build_model

USER_NETS = '''
from torch import nn


def broken(input_shape, num_classes):
    raise ValueError("hidden must be positive")
'''


@pytest.fixture
def probes(monkeypatch) -> list[str]:
    """Every bootstrap the command probes (the probe itself still runs, and fails: nothing listens)."""
    seen: list[str] = []
    real = kafka_io.check_reachable

    def spy(bootstrap: str, *args, **kwargs):
        seen.append(bootstrap)
        return real(bootstrap, *args, **kwargs)

    monkeypatch.setattr(kafka_io, "check_reachable", spy)
    return seen


def serve(tmp_path, *args: str) -> int:
    return main(["serve", "--bootstrap", "127.0.0.1:1", "--set", "job.name=sv", "--set", "train.enabled=true",
                 "--set", "workers.count=2", "--set", f"run.state_dir={tmp_path / 'state'}", *args])


def one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(("args", "line"), [
    (["--set", "train.model=nosuchnets_q7:build"],
     "edgestream serve: configuration error: train.model='nosuchnets_q7:build': module 'nosuchnets_q7' is not "
     "found"),
    (["--set", "train.model=usernets_serve:broken"],
     "train.model='usernets_serve:broken': the factory raised ValueError: hidden must be positive"),
    (["--set", "train.model=mlp", "--set", "train.model_params=depth=3"],
     "the factory raised TypeError"),
])
def test_a_bad_model_exits_2_before_the_broker_is_probed(args, line, tmp_path, monkeypatch, probes, capsys):
    (tmp_path / "usernets_serve.py").write_text(USER_NETS)
    monkeypatch.syspath_prepend(str(tmp_path))

    code = serve(tmp_path, *args)

    err = one_line(capsys)
    assert code == 2 and line in err, err
    assert "Kafka" not in err and probes == []
    assert not (tmp_path / "state").exists()


def test_an_export_dir_that_does_not_exist_exits_2_before_the_broker_is_probed(tmp_path, probes, capsys):
    code = serve(tmp_path, "--model-from", "export", "--export-dir", str(tmp_path / "exprot"))

    assert code == 2 and probes == []
    assert one_line(capsys) == (f"edgestream serve: --export-dir {tmp_path / 'exprot'}: no such directory; write an "
                                f"export there first (edgestream export --job ... --out {tmp_path / 'exprot'}) or "
                                "fix the path")


def test_an_export_of_another_model_exits_2_before_the_broker_is_probed(tmp_path, probes, capsys):
    # An mlp of hidden width 16 for digits (64 pixels, 10 classes); the job's is the default mlp.
    out = tmp_path / "export"
    model = build_model("mlp", (64,), 10, seed=0, hidden=[16])
    export_model(model, out, input_shape=(64,), num_classes=10, check_features=np.zeros((2, 64), np.float32),
                 formats=["safetensors"], card={"model": {"name": "mlp", "params": {"hidden": [16]}}})

    code = serve(tmp_path, "--model-from", "export", "--export-dir", str(out))

    assert code == 2 and probes == []
    err = one_line(capsys)
    assert err.startswith(f"edgestream serve: --export-dir {out}: not the job's model (") and \
        "model 'mlp' {'hidden': [16]}, the job's is 'mlp' {}" in err, err


@pytest.mark.parametrize("args", [[], ["--model-from", "export", "--export-dir", "EXPORT_WITHOUT_CARD"]])
def test_a_good_model_gets_to_the_broker_probe(args, tmp_path, probes, capsys):
    """The control: with nothing wrong with the model the probe runs and reports the dead address."""
    (tmp_path / "export").mkdir()  # an export directory still waiting for its card is waited for, not refused
    args = [str(tmp_path / "export") if a == "EXPORT_WITHOUT_CARD" else a for a in args]

    code = serve(tmp_path, *args)

    assert probes == ["127.0.0.1:1"]
    assert code != 0 and "127.0.0.1:1" in capsys.readouterr().err
