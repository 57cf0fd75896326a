"""SeqWindow: which sequence numbers of a device were seen, in bounded memory."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgestream.streams.dedup import SeqWindow


def seqs(*numbers: int) -> np.ndarray:
    return np.array(numbers, dtype=np.uint64)


def test_a_message_sent_three_times_is_new_once_then_duplicate_twice():
    window = SeqWindow(16)
    message = seqs(0, 1, 2, 3)

    first, second, third = (window.check_and_add(message) for _ in range(3))

    assert not first.any()
    assert second.all() and third.all()
    assert window.high == 3


def test_out_of_order_numbers_inside_the_window_are_new_once():
    window = SeqWindow(16)
    window.check_and_add(seqs(10, 11, 14))

    late = window.check_and_add(seqs(12, 13, 11, 9))

    assert late.tolist() == [False, False, True, False]  # 11 again; 9 is inside (14 - 16, 14]
    assert window.check_and_add(seqs(12, 13, 9)).all()
    assert window.high == 14


def test_a_repeat_inside_one_message_is_a_duplicate():
    window = SeqWindow(16)
    assert window.check_and_add(seqs(5, 6, 5, 7)).tolist() == [False, False, True, False]


def test_memory_is_bounded_numbers_below_the_window_are_accepted_and_not_remembered():
    window = SeqWindow(8)
    window.check_and_add(np.arange(0, 100, dtype=np.uint64))

    old = window.check_and_add(seqs(50, 50, 92, 93))

    assert old.tolist() == [False, False, True, True]  # 50 is below (99 - 8, 99]: cannot tell
    assert window._bits.size == 8 and window.high == 99


def test_a_zero_below_the_window_is_a_restarted_numbering_and_the_window_starts_again():
    window = SeqWindow(8)
    window.check_and_add(np.arange(0, 100, dtype=np.uint64))

    restarted = window.check_and_add(np.arange(0, 10, dtype=np.uint64))

    assert not restarted.any() and window.high == 9
    assert window.check_and_add(seqs(9, 8, 10)).tolist() == [True, True, False]  # checked again at once
    # Without the restart its numbers would have run into the old window (92..99) as duplicates.
    assert not window.check_and_add(np.arange(11, 120, dtype=np.uint64)).any()


def test_a_jump_forward_forgets_the_slots_it_moves_onto():
    window = SeqWindow(8)
    window.check_and_add(seqs(0, 1, 2, 3, 4, 5, 6, 7))

    window.check_and_add(seqs(12))

    # 8..11 share slots with 0..3: never seen, so new; 5..7 still remembered.
    assert window.check_and_add(seqs(8, 9, 10, 11, 5, 6, 7)).tolist() == [False] * 4 + [True] * 3


def test_all_new_is_a_pure_check():
    window = SeqWindow(8)
    window.check_and_add(seqs(3))
    assert window.all_new(seqs(4, 5, 9)) and not window.all_new(seqs(3, 4)) and not window.all_new(seqs(5, 4))
    assert window.high == 3 and not window.seen(4)


def test_fast_and_slow_paths_agree_with_a_set_under_random_traffic():
    rng = np.random.default_rng(3)
    size = 64
    window, remembered = SeqWindow(size), set()
    high, restarts = -1, 0
    for _ in range(400):
        # Mostly near the top, now and then a restarted numbering (from 0).
        start = 0 if rng.random() < 0.03 else int(rng.integers(max(0, high - 80), high + 40))
        numbers = np.arange(start, start + int(rng.integers(1, 12)), dtype=np.uint64)
        if rng.random() < 0.3:
            rng.shuffle(numbers)
        expected = []
        for n in numbers.tolist():
            if n > high:
                high = n
            if n <= high - size:
                expected.append(False)
                if n == 0:  # a restarted numbering
                    high, remembered, restarts = 0, {0}, restarts + 1
                continue
            expected.append(n in remembered)
            remembered.add(n)
        remembered = {n for n in remembered if n > high - size}
        assert window.check_and_add(numbers).tolist() == expected
        assert window.high == high
    assert restarts >= 1


@pytest.mark.parametrize("restore_size", [64, 16, 256])
def test_state_round_trips_through_json(restore_size):
    window = SeqWindow(64)
    window.check_and_add(np.arange(100, 160, dtype=np.uint64))
    window.check_and_add(seqs(170, 175))

    restored = SeqWindow.from_dict(json.loads(json.dumps(window.to_dict())), restore_size)

    assert restored.high == 175 and restored.size == restore_size
    kept = [n for n in range(100, 176) if n > 175 - min(64, restore_size)]
    assert [restored.seen(n) for n in kept] == [window.seen(n) for n in kept]
    assert restored.check_and_add(seqs(175)).all() and not restored.check_and_add(seqs(171)).any()


@pytest.mark.parametrize("state", [
    {}, {"size": 8, "high": 3}, {"size": 8, "high": 3, "bits": "!!"}, {"size": 8, "high": 3, "bits": "AAAA"},
    {"size": 0, "high": 3, "bits": ""}, {"size": 8, "high": -5, "bits": "AA=="},
])
def test_a_malformed_state_is_refused(state):
    with pytest.raises(ValueError, match="not a duplicate window state"):
        SeqWindow.from_dict(state, 8)


def test_the_window_must_hold_a_number():
    with pytest.raises(ValueError, match="at least 1"):
        SeqWindow(0)


def test_add_new_equals_check_and_add_across_ring_wraps():
    """``add_new`` (the fast path of a run already known new) moves the window exactly as
    ``check_and_add`` does: consecutive runs that wrap the ring, jumps, gaps inside a run."""
    rng = np.random.default_rng(11)
    fast, reference = SeqWindow(10), SeqWindow(10)
    top = -1
    for _ in range(300):
        start = top + 1 + int(rng.choice([0, 0, 0, 3, 25]))
        numbers = np.arange(start, start + int(rng.integers(1, 15)), dtype=np.uint64)
        if rng.random() < 0.2 and len(numbers) > 2:
            numbers = np.delete(numbers, 1)  # a gap: not consecutive
        assert fast.all_new(numbers)
        fast.add_new(numbers)
        assert not reference.check_and_add(numbers).any()
        top = int(numbers[-1])
        assert fast.high == reference.high == top
        np.testing.assert_array_equal(fast._bits, reference._bits)
        assert all(fast.seen(n) == (n in set(numbers.tolist()) or reference.seen(n)) for n in range(top - 9, top + 1))


def test_add_if_new_adds_exactly_when_all_new_and_otherwise_changes_nothing():
    rng = np.random.default_rng(11)
    window, twin = SeqWindow(32), SeqWindow(32)
    added = refused = 0
    for _ in range(300):
        start = int(rng.integers(max(0, window.high - 40), window.high + 20))
        numbers = np.arange(start, start + int(rng.integers(1, 9)), dtype=np.uint64)
        if rng.random() < 0.2:
            rng.shuffle(numbers)
        before = window.copy()
        expected = window.all_new(numbers)
        assert window.add_if_new(numbers) == expected
        if expected:
            added += 1
            twin.check_and_add(numbers)
            assert window.high == twin.high and np.array_equal(window._bits, twin._bits)
        else:
            refused += 1
            assert window.high == before.high and np.array_equal(window._bits, before._bits)
            window.add(numbers)  # the caller's slow path
            twin.add(numbers)
    assert added > 50 and refused > 50
    assert window.add_if_new(np.array([], dtype=np.uint64))
