"""The run summary's line on serve.predictions (pipeline/run.py ``predictions_line``)."""

from __future__ import annotations

from edgestream.pipeline.run import RunResult, predictions_line


def result_of(by_device: dict[str, int], consumed: dict[str, int]) -> RunResult:
    return RunResult(
        produced=dict(consumed), garbage=dict.fromkeys(consumed, 0), balanced=True, duration_s=1.0,
        accounting={d: {"consumed": n} for d, n in consumed.items()},
        training={"w0": {"predictions": {"published": sum(by_device.values()), "by_device": by_device,
                                         "topic": "predictions.j"}},
                  "server": {"predictions": None}},
    )


def test_the_line_says_one_prediction_per_trained_record_when_the_counts_agree():
    line = predictions_line(result_of({"a": 5, "b": 7}, {"a": 5, "b": 7}))
    assert line == ("predictions: 12 published on predictions.j for 12 trained records "
                    "(one per trained record on every device)")


def test_the_line_names_the_devices_whose_counts_differ():
    line = predictions_line(result_of({"a": 5}, {"a": 6, "b": 2}))
    assert line.endswith("differ on a (5 for 6), b (0 for 2)")
