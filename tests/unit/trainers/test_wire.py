"""The update-message wire format: round trips and every way a record is rejected."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from edgestream.compression import ErrorFeedback, GradientCodec, encode_tensors, registry
from edgestream.trainers.messages import UpdateMessage
from edgestream.trainers.validation import TensorSpec
from edgestream.trainers.wire import (
    MAX_HEADER_BYTES,
    PREFIX_SIZE,
    MessageEncodeError,
    MessageRejected,
    decode_update,
    encode_update,
)

torch.set_num_threads(1)

# The documented layout, restated independently of the module.
PREFIX = struct.Struct("<4sBBHIIIII")
JOB = "job-1"
MAX = 1 << 20
SHAPES = {"w": (2, 3), "b": (3,)}
SPEC = TensorSpec(
    parameters=dict(SHAPES),
    buffers={"bn.mean": ((3,), torch.float32), "bn.count": ((), torch.int64)},
)


def grads(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale - 2.5,
        "b": torch.tensor([0.5, -1.25, 3.0]) * scale,
    }


def gradient(**kw) -> UpdateMessage:
    fields = dict(kind="gradient", sender="edge-1", step=7, base_version=5, batch_size=32)
    fields.update(kw)
    fields.setdefault("tensors", grads())
    return UpdateMessage(**fields)


def encode(msg: UpdateMessage, **kw) -> bytes:
    return encode_update(msg, job=JOB, **kw)[0]


def decode(value, spec=SPEC, **kw) -> UpdateMessage:
    kw.setdefault("max_bytes", MAX)
    return decode_update(value, expected_shapes=spec, **kw)


def rejected(value, reason: str, spec=SPEC, **kw) -> MessageRejected:
    with pytest.raises(MessageRejected) as info:
        decode(value, spec, **kw)
    assert info.value.reason == reason, info.value
    return info.value


def split(value: bytes) -> tuple[dict, list[bytes]]:
    """The JSON header and the four sections of a record."""
    _, _, _, _, hlen, *lens = PREFIX.unpack_from(value, 0)
    header = json.loads(value[PREFIX_SIZE : PREFIX_SIZE + hlen])
    pos, sections = PREFIX_SIZE + hlen, []
    for n in lens:
        sections.append(value[pos : pos + n])
        pos += n
    assert pos == len(value)
    return header, sections


def frame(header, sections=(b"", b"", b"", b""), *, magic=b"EDGG", version=1, flags=0) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    lens = [len(s) for s in sections]
    return PREFIX.pack(magic, version, flags, 0, len(raw), *lens) + raw + b"".join(sections)


def reframe(value: bytes, **changes) -> bytes:
    """``value`` with some header fields replaced (sections kept)."""
    header, sections = split(value)
    header.update(changes)
    return frame(header, sections)


# ---------------------------------------------------------------- round trips


def test_dense_gradient_round_trip_with_buffer_delta_and_headers():
    msg = gradient(
        buffers={"bn.mean": torch.tensor([0.1, 0.2, -0.3])}, meta={"loss": 0.5, "v": [1]}
    )
    value, headers = encode_update(msg, job=JOB, to="edge-2")
    assert value[:4] == b"EDGG" and value[4] == 1
    out = decode(value, job=JOB)
    assert (out.kind, out.sender, out.step, out.base_version, out.batch_size) == (
        "gradient",
        "edge-1",
        7,
        5,
        32,
    )
    assert list(out.tensors) == ["w", "b"] and out.meta == {"loss": 0.5, "v": [1]}
    for name, tensor in msg.tensors.items():
        assert torch.equal(out.tensors[name], tensor)
    assert torch.equal(out.buffers["bn.mean"], msg.buffers["bn.mean"])
    assert out.optimizer == {}
    assert headers == {
        "edgestream.format": b"EDGG/1",
        "edgestream.job": b"job-1",
        "edgestream.kind": b"gradient",
        "edgestream.sender": b"edge-1",
        "edgestream.step": b"7",
        "edgestream.base_version": b"5",
        "edgestream.codec": b"dense",
        "edgestream.to": b"edge-2",
    }
    # Accepts bytearray and memoryview values too.
    assert torch.equal(decode(bytearray(value)).tensors["w"], msg.tensors["w"])
    assert torch.equal(decode(memoryview(value)).tensors["b"], msg.tensors["b"])


def test_model_snapshot_round_trip_with_integer_buffer_and_optimizer_slots():
    msg = UpdateMessage(
        kind="model",
        sender="server",
        step=0,
        base_version=12,
        tensors={"w": torch.randn(2, 3), "b": torch.randn(3).half()},
        buffers={"bn.count": torch.tensor(41, dtype=torch.int64), "bn.mean": torch.randn(3)},
        optimizer={"w": torch.randn(2, 3), "b": torch.randn(3)},
    )
    out = decode(encode(msg))
    assert out.kind == "model" and out.batch_size == 0
    assert out.tensors["b"].dtype == torch.float16
    for section in ("tensors", "buffers", "optimizer"):
        sent, got = getattr(msg, section), getattr(out, section)
        assert list(got) == list(sent)
        for name in sent:
            assert got[name].dtype == sent[name].dtype and torch.equal(got[name], sent[name])
    assert out.buffers["bn.count"].shape == () and int(out.buffers["bn.count"]) == 41


def test_topk_round_trip_uses_the_codec_and_its_error_feedback():
    topk = registry.create("topk", ratio=0.25)
    codec = GradientCodec(topk, ErrorFeedback())
    msg = gradient()
    value, headers = encode_update(msg, job=JOB, codec=codec)
    assert headers["edgestream.codec"] == b"topk"
    assert split(value)[0]["codec"] == "topk"
    out = decode(value, allowed_codecs={"topk", "dense"})
    for name, tensor in msg.tensors.items():
        expected = topk.decompress(topk.compress(tensor))
        assert torch.equal(out.tensors[name], expected)
        assert int((out.tensors[name] != 0).sum()) == math.ceil(0.25 * tensor.numel())
        # What was not sent stays in the residual for the next step.
        assert torch.allclose(codec.memory.residual(name) + out.tensors[name], tensor)


def test_codec_dense_step_and_uncompressed_kinds():
    codec = GradientCodec(registry.create("topk", ratio=0.25), ErrorFeedback())
    value, headers = encode_update(gradient(), job=JOB, codec=codec, compress=False)
    assert headers["edgestream.codec"] == b"dense"
    out = decode(value, allowed_codecs={"dense"})
    assert torch.equal(out.tensors["w"], grads()["w"])
    # A model snapshot is never compressed and never touches the residuals.
    codec.reset()
    snapshot = UpdateMessage(kind="model", sender="s", step=0, base_version=1, tensors=grads())
    value, headers = encode_update(snapshot, job=JOB, codec=codec)
    assert headers["edgestream.codec"] == b"dense"
    assert torch.equal(decode(value).tensors["w"], grads()["w"])
    assert codec.memory.state_dict() == {}


def test_control_and_activation_round_trip():
    control = UpdateMessage(
        kind="control", sender="coord", step=3, base_version=0, meta={"view": [1, 2]}
    )
    value = encode(control)
    assert split(value)[1] == [b"", b"", b"", b""]
    out = decode(value)
    assert out.kind == "control" and out.tensors == {} and out.meta == {"view": [1, 2]}

    act_spec = TensorSpec(parameters={"h": (None, 4)})
    act = UpdateMessage(
        kind="activation", sender="s0", step=1, base_version=0, tensors={"h": torch.ones(5, 4)}
    )
    assert torch.equal(decode(encode(act), act_spec).tensors["h"], torch.ones(5, 4))


def test_plain_shape_mapping_is_accepted_as_spec():
    out = decode(encode(gradient()), dict(SHAPES))
    assert set(out.tensors) == {"w", "b"}


# ---------------------------------------------------------------- framing rejections


@pytest.mark.parametrize(
    "cut", ["empty", 3, 10, PREFIX_SIZE - 1, "mid_header", "end_header", "mid_tensors", -1]
)
def test_truncated_at_several_points(cut):
    value = encode(gradient(buffers={"bn.mean": torch.ones(3)}))
    hlen = PREFIX.unpack_from(value, 0)[4]
    at = {
        "empty": 0,
        "mid_header": PREFIX_SIZE + hlen // 2,
        "end_header": PREFIX_SIZE + hlen,
        "mid_tensors": PREFIX_SIZE + hlen + 20,
    }.get(cut, cut)
    rejected(value[:at], "truncated")


def test_tombstone_and_trailing_bytes():
    rejected(None, "truncated")
    rejected(encode(gradient()) + b"\0", "trailing_bytes")


def test_bad_magic_version_and_flags():
    header, sections = split(encode(gradient()))
    rejected(frame(header, sections, magic=b"EDGS"), "bad_magic")
    rejected(frame(header, sections, version=2), "bad_version")
    rejected(frame(header, sections, flags=1), "bad_header")


def test_oversized_header_is_rejected_before_parsing():
    # Declared length alone is enough: the bytes need not even be present.
    prefix = PREFIX.pack(b"EDGG", 1, 0, 0, MAX_HEADER_BYTES + 1, 0, 0, 0, 0)
    rejected(prefix + b"{}", "too_large")
    header, sections = split(encode(gradient()))
    header["meta"] = {"pad": "x" * MAX_HEADER_BYTES}
    rejected(frame(header, sections), "too_large")


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"\xff\xfe{}",
        b"[1, 2]",
        b'{"step": NaN}',
        b"[" * 5000 + b"]" * 5000,
        b"{" + b'"a":' * 1 + b"1" * 5000 + b"}",
    ],
    ids=["not_json", "not_utf8", "not_object", "nan", "deep", "huge_int"],
)
def test_header_not_json_object(raw):
    rejected(frame(raw), "bad_header")


def test_header_keys_and_types():
    value = encode(gradient())
    header, sections = split(value)
    rejected(frame({k: v for k, v in header.items() if k != "codec"}, sections), "bad_header")
    rejected(frame({**header, "extra": 1}, sections), "bad_header")
    for field, bad in [
        ("step", -1),
        ("step", True),
        ("base_version", "5"),
        ("batch_size", 1.5),
        ("sender", ""),
        ("job", 3),
        ("codec", None),
        ("meta", [1]),
    ]:
        rejected(reframe(value, **{field: bad}), "bad_header")
    for bad_entries in [
        {"w": 1},
        [["w", "float32"]],
        [["w", "int64", [2, 3]], ["b", "float32", [3]]],
        [["w", "float32", [2, 3]], ["w", "float32", [2, 3]]],
        [["", "float32", [3]]],
        [["w", "float32", [2, 0]]],
        [["w", "float32", [1] * 9]],
    ]:
        rejected(reframe(value, tensors=bad_entries), "bad_header")


def test_unknown_kind_and_unknown_or_disallowed_codec():
    value = encode(gradient())
    err = rejected(reframe(value, kind="telepathy"), "unknown_kind")
    assert err.sender == "edge-1" and err.step == 7
    rejected(reframe(value, codec="zstd"), "unknown_codec")
    rejected(value, "codec_not_allowed", allowed_codecs={"topk"})


def test_wrong_job():
    rejected(encode(gradient()), "wrong_job", job="other-job")


def test_total_size_over_max_bytes():
    value = encode(gradient())
    rejected(value, "too_large", max_bytes=len(value) - 1)
    assert decode(value, max_bytes=len(value)).step == 7


# ---------------------------------------------------------------- declared shapes


def test_huge_declared_shapes_are_rejected_before_allocation():
    value = encode(gradient())
    # Beyond the u32 dims the format allows.
    rejected(
        reframe(value, tensors=[["w", "float32", [2**40]], ["b", "float32", [3]]]), "bad_header"
    )
    # Legal dims but not the model's shape.
    rejected(
        reframe(value, tensors=[["w", "float32", [2**31, 3]], ["b", "float32", [3]]]),
        "shape_mismatch",
    )
    # A wildcard dim (activations) is bounded by max_numel, default max_bytes.
    act_spec = TensorSpec(parameters={"h": (None, 4)})
    act = UpdateMessage(
        kind="activation", sender="s0", step=1, base_version=0, tensors={"h": torch.ones(5, 4)}
    )
    act_value = encode(act)
    rejected(reframe(act_value, tensors=[["h", "float32", [2**30, 4]]]), "too_large", act_spec)
    rejected(act_value, "too_large", act_spec, max_numel=19)
    assert decode(act_value, act_spec, max_numel=20).tensors["h"].shape == (5, 4)


def test_shape_and_name_mismatch_against_the_spec():
    value = encode(gradient())
    rejected(value, "shape_mismatch", {"w": (3, 2), "b": (3,)})
    rejected(value, "missing_tensor", {**SHAPES, "c": (1,)})
    rejected(value, "unexpected_tensor", {"w": (2, 3)})
    control = UpdateMessage(kind="control", sender="c", step=0, base_version=0)
    rejected(reframe(encode(control), tensors=[["w", "float32", [2, 3]]]), "unexpected_tensor")


def test_buffer_and_optimizer_rules():
    rejected(
        encode(gradient(buffers={"bn.mean": torch.ones(3)})), "unexpected_tensor", dict(SHAPES)
    )
    rejected(encode(gradient(buffers={"bn.count": torch.tensor(1)})), "bad_dtype")
    rejected(encode(gradient(optimizer={"w": torch.ones(2, 3)})), "unexpected_tensor")


# ---------------------------------------------------------------- payload rejections


def test_nan_tensor_is_rejected():
    marker = 1.2345
    tensors = grads()
    tensors["w"][0, 0] = marker
    value = encode(gradient(tensors=tensors))
    packed = struct.pack("<f", marker)
    assert value.count(packed) == 1
    value = value.replace(packed, struct.pack("<f", float("nan")))
    err = rejected(value, "non_finite")
    assert err.layer == "w"


def test_payload_disagreeing_with_header():
    value = encode(gradient())
    header, sections = split(value)
    # Tensors encoded under other names than the header declares.
    other = encode_tensors({"x": torch.ones(2, 3), "y": torch.ones(3)})
    rejected(frame(header, [other, b"", b"", b""]), "payload")
    # Garbage instead of a compression message.
    rejected(frame(header, [b"\0" * len(sections[0]), b"", b"", b""]), "payload")
    # Header lists tensors but the section is empty, and the reverse.
    rejected(frame(header, [b"", b"", b"", b""]), "payload")
    rejected(frame(header, [sections[0], sections[0], b"", b""]), "payload")
    # Header dtype differs from what the payload restores.
    rejected(reframe(value, tensors=[["w", "float16", [2, 3]], ["b", "float32", [3]]]), "payload")
    # Integer section length disagrees with the declared integer buffers.
    snap = UpdateMessage(
        kind="model",
        sender="s",
        step=0,
        base_version=0,
        tensors=grads(),
        buffers={"bn.count": torch.tensor(3)},
    )
    header, sections = split(encode(snap))
    rejected(frame(header, [sections[0], b"", b"", sections[3][:4]]), "payload")


def test_codec_of_layers_must_match_header_codec():
    codec = GradientCodec(registry.create("topk", ratio=0.25))
    value = encode(gradient(), codec=codec)
    rejected(reframe(value, codec="dense"), "payload")


def test_validation_reasons_pass_through():
    # Well-formed records that validate_update refuses keep its reason.
    rejected(encode(gradient(batch_size=0)), "bad_header")
    rejected(encode(gradient(meta={"pad": "x" * 20_000})), "bad_meta")


# ---------------------------------------------------------------- encode errors


def test_encode_refuses_what_a_receiver_would_reject():
    nan = grads()
    nan["b"][1] = float("nan")
    cases = [
        (dict(msg=gradient(), job="bad job!"), "bad_header"),
        (dict(msg=gradient(kind="telepathy"), job=JOB), "unknown_kind"),
        (dict(msg=gradient(sender=""), job=JOB), "bad_header"),
        (dict(msg=gradient(step=-1), job=JOB), "bad_header"),
        (dict(msg=gradient(tensors=nan), job=JOB), "non_finite"),
        (dict(msg=gradient(tensors={"w": torch.ones(2, dtype=torch.int64)}), job=JOB), "bad_dtype"),
        (dict(msg=gradient(meta={"x": float("inf")}), job=JOB), "bad_meta"),
        (dict(msg=gradient(meta={"x": object()}), job=JOB), "bad_meta"),
        (dict(msg=gradient(meta={"pad": "x" * MAX_HEADER_BYTES}), job=JOB), "too_large"),
        (dict(msg=gradient(), job=JOB, to=""), "bad_header"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(MessageEncodeError) as info:
            encode_update(**kwargs)
        assert info.value.reason == reason, (kwargs, info.value)
    assert issubclass(MessageEncodeError, ValueError)


def test_failed_encode_leaves_codec_residuals_untouched():
    codec = GradientCodec(registry.create("topk", ratio=0.25), ErrorFeedback())
    bad = gradient(buffers={"bn.mean": torch.tensor([0.0, float("nan"), 1.0])})
    with pytest.raises(MessageEncodeError):
        encode_update(bad, job=JOB, codec=codec)
    assert codec.memory.state_dict() == {}


def test_rejection_reasons_are_a_closed_set():
    with pytest.raises(ValueError):
        MessageRejected("whatever", "x")
    assert MessageRejected.REASONS >= {
        "truncated",
        "bad_magic",
        "bad_version",
        "bad_header",
        "too_large",
        "shape_mismatch",
        "non_finite",
        "unknown_kind",
        "payload",
    }


def test_a_finite_but_absurd_gradient_is_rejected_as_out_of_range():
    value = encode(gradient(tensors=grads(scale=1e30)))

    with pytest.raises(MessageRejected) as err:
        decode(value, max_norm=1e4)

    assert err.value.reason == "out_of_range" and "exceeds the bound" in err.value.detail
    assert decode(value).tensors["b"][2] == pytest.approx(3e30)  # no bound: accepted as before
    assert decode(encode(gradient()), max_norm=1e4).kind == "gradient"  # a sane one passes


def test_the_norm_bound_leaves_model_snapshots_alone():
    snapshot = gradient(kind="model", tensors=grads(scale=1e6))
    assert decode(encode(snapshot), max_norm=1.0).kind == "model"


def test_a_model_snapshot_above_the_value_bound_is_rejected():
    snapshot = gradient(kind="model", tensors=grads(scale=1e9))

    with pytest.raises(MessageRejected) as err:
        decode(encode(snapshot), max_abs=1e6)

    assert err.value.reason == "out_of_range" and "above the bound" in err.value.detail
    assert decode(encode(gradient(kind="model")), max_abs=1e6).kind == "model"
