"""benchmarks/serving.py: the pure parts of ``--part serve`` (records lost and duplicated,
the pauses around model swaps) and the merge that keeps each part's results in serving.{json,md}."""

from __future__ import annotations

import pytest

from edgestream.benchmarks.serving import (
    SERVE_HEADING,
    accounting,
    merge_json,
    merge_markdown,
    swap_gaps,
    throughput_row,
)


def _keys(offsets: list[int], topic: str = "sensors.d") -> list[tuple[str, int, int, int]]:
    return [(topic, 0, offset, offset * 10) for offset in offsets]


def test_every_record_predicted_once_counts_nothing_lost_or_duplicated() -> None:
    counts = accounting(_keys([0, 1, 2]), _keys([2, 0, 1]))
    assert counts == {"records": 3, "predictions": 3, "lost": 0, "duplicates": 0, "unexpected": 0}


def test_missing_repeated_and_foreign_predictions_are_each_counted() -> None:
    predicted = _keys([0, 0, 0, 2]) + _keys([5], topic="sensors.other")
    counts = accounting(_keys([0, 1, 2, 3]), predicted)
    assert counts == {"records": 4, "predictions": 5, "lost": 2, "duplicates": 2, "unexpected": 1}


def test_a_record_of_a_message_with_several_is_its_own_key() -> None:
    sources = [("t", 0, 7, 1), ("t", 0, 7, 2)]  # one message, two records
    assert accounting(sources, [("t", 0, 7, 1)])["lost"] == 1


def test_gaps_are_between_micro_batches_and_each_swap_is_measured_across_and_around() -> None:
    # Micro-batches every 0.1 s (their predictions share a publish time), v1 until 1.0, then a
    # 0.5 s pause to the first v2 micro-batch at 1.5, and a 0.3 s pause later (2.5 -> 2.8).
    times = [round(0.1 * i, 1) for i in range(11)] + [1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.5, 2.8]
    published = [(t, 1 if t <= 1.0 else 2) for t in times for _ in range(3)]
    gaps = swap_gaps(published, window_s=1.0)
    assert gaps["micro_batches"] == len(times)
    assert gaps["median_gap_s"] == pytest.approx(0.1)
    assert gaps["longest_gap_s"] == pytest.approx(0.5)
    [swap] = gaps["swaps"]
    assert (swap["from_version"], swap["to_version"], swap["at"]) == (1, 2, 1.5)
    assert swap["gap_across_s"] == pytest.approx(0.5)
    assert swap["longest_gap_near_s"] == pytest.approx(0.5)


def test_the_longest_gap_near_a_swap_may_follow_it_and_a_far_one_is_left_out() -> None:
    # The swap itself is seamless (0.1 s), a 0.4 s pause 0.1 s after it, a 0.3 s one that begins
    # within the second after it, and a 2 s one that begins after that second.
    times = [0.0, 0.1, 0.2, 0.3, 0.7, 0.8, 0.9, 1.0, 1.1, 1.4, 3.4, 3.5]
    published = [(t, 1 if t < 0.2 else 2) for t in times]
    [swap] = swap_gaps(published, window_s=1.0)["swaps"]
    assert swap["gap_across_s"] == pytest.approx(0.1)
    assert swap["longest_gap_near_s"] == pytest.approx(0.4)


def test_no_swap_and_a_single_micro_batch_give_no_gaps() -> None:
    assert swap_gaps([(5.0, 1), (5.0, 1)]) == {"micro_batches": 1, "median_gap_s": None, "longest_gap_s": None,
                                                "swaps": []}


def test_the_serve_section_is_added_below_the_predictions_text_and_replaced_on_the_next_run() -> None:
    predictions = "Training throughput ...\n\n| pair |\n"
    first = merge_markdown(predictions, "serve", f"{SERVE_HEADING}\n\nrun 1\n")
    assert first == f"{predictions}\n{SERVE_HEADING}\n\nrun 1\n"
    second = merge_markdown(first, "serve", f"{SERVE_HEADING}\n\nrun 2\n")
    assert second == f"{predictions}\n{SERVE_HEADING}\n\nrun 2\n"


def test_the_predictions_part_keeps_the_serve_section() -> None:
    old = f"old predictions\n\n{SERVE_HEADING}\n\nserve figures\n"
    assert merge_markdown(old, "predictions", "new predictions\n") == (
        f"new predictions\n\n{SERVE_HEADING}\n\nserve figures\n")
    assert merge_markdown("", "predictions", "new predictions\n") == "new predictions\n"
    assert merge_markdown("", "serve", f"{SERVE_HEADING}\n") == f"{SERVE_HEADING}\n"


def test_each_part_replaces_only_its_own_json_keys() -> None:
    old = {"part": "predictions", "median_ratio": 0.78, "rows": [1]}
    merged = merge_json(old, "serve", {"part": "serve", "median_ratio": 1.1})
    assert merged == {**old, "serve": {"part": "serve", "median_ratio": 1.1}}
    again = merge_json(merged, "predictions", {"part": "predictions", "median_ratio": 0.8, "rows": [2]})
    assert again == {"part": "predictions", "median_ratio": 0.8, "rows": [2],
                     "serve": {"part": "serve", "median_ratio": 1.1}}
    assert merge_json({}, "predictions", {"part": "predictions"}) == {"part": "predictions"}


def test_throughput_counts_the_records_after_the_first_micro_batch_over_the_time_after_it() -> None:
    row = throughput_row("serve", {"predictions": 1100, "first": 10.0, "last": 12.0, "first_micro_batch": 100})
    assert row == {"side": "serve", "predictions": 1100, "first_micro_batch": 100, "seconds": 2.0,
                   "records_per_s": 500.0}
    one_batch = throughput_row("plain", {"predictions": 7, "first": 3.0, "last": 3.0, "first_micro_batch": 7})
    assert one_batch["records_per_s"] is None
