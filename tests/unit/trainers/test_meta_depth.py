"""Deeply nested ``meta`` is refused at the gate (found while fuzzing update messages).

Before the bound, a record whose meta nested ~600 lists deep passed ``decode_update``
(it is valid JSON under 16 KiB) and then made ``UpdateMessage.to_state`` (a strategy's
pending state, every checkpoint) raise ``RecursionError``.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgestream.trainers.errors import UpdateRejected
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.validation import MAX_META_DEPTH, validate_update
from edgestream.trainers.wire import MessageRejected, decode_update, encode_update

SHAPES = {"w": (2,)}


def nested(levels: int):
    """``{"a": [[...]]}``: ``levels`` levels counting the outer object."""
    return {"a": json.loads("[" * (levels - 1) + "]" * (levels - 1))} if levels > 1 else {}


def gradient(meta) -> UpdateMessage:
    return UpdateMessage(kind="gradient", sender="w1", step=1, base_version=0, batch_size=2,
                         tensors={"w": torch.ones(2)}, meta=meta)


def test_meta_at_the_depth_limit_passes_and_can_be_kept():
    msg = gradient(nested(MAX_META_DEPTH))
    validate_update(msg, SHAPES)
    assert UpdateMessage.from_state(msg.to_state()).meta == msg.meta


@pytest.mark.parametrize("levels", [MAX_META_DEPTH + 1, 600])
def test_deeper_meta_is_bad_meta(levels):
    with pytest.raises(UpdateRejected, match=f"nests {MAX_META_DEPTH + 1} levels deep") as info:
        validate_update(gradient(nested(levels)), SHAPES)
    assert info.value.reason == "bad_meta"


def test_a_record_with_deep_meta_is_rejected_on_receipt():
    # encode_update does not bound the depth (a sender's own meta); the receiver does.
    value, _ = encode_update(gradient(nested(600)), job="j")
    with pytest.raises(MessageRejected) as info:
        decode_update(value, expected_shapes=SHAPES, max_bytes=1 << 20)
    assert info.value.reason == "bad_meta"


def test_a_cyclic_meta_is_refused_not_looped_over():
    meta: dict = {}
    meta["self"] = [meta]
    with pytest.raises(UpdateRejected, match="levels deep"):
        validate_update(gradient(meta), SHAPES)
