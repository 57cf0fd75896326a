"""`edgestream serve`'s usage errors: one line naming what to do, exit status 2, before any Kafka."""

from __future__ import annotations

import pytest

from edgestream.cli.main import main


@pytest.mark.parametrize(("args", "line"), [
    (["--set", "train.enabled=false"], "the job does not train (train.enabled = false)"),
    (["--model-from", "models"], "train.strategy='bsp' has no server: use --model-from checkpoints"),
    (["--model-from", "export"], "--model-from export needs --export-dir DIR"),
    (["--name", "w0"], "--name 'w0' is a process of the training job"),
    (["--worker", "w5"], "--worker 'w5': the job's processes with checkpoints are w0, w1"),
    (["--set", "train.stages=fc1", "--set", "train.strategy=pipeline_bp", "--set", "train.model=conv8"],
     "train.stages splits the model over several workers"),
    (["--set", "serve.max_batch=0"], "serve.max_batch must be an integer in [1, 65536] (got 0)"),
])
def test_a_bad_invocation_exits_2_with_one_line(args, line, capsys, tmp_path):
    code = main(["serve", "--bootstrap", "127.0.0.1:1", "--set", "job.name=sv", "--set", "train.enabled=true",
                 "--set", "workers.count=2", "--set", f"run.state_dir={tmp_path}", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("edgestream serve: ") and line in err[0], err
