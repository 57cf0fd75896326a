"""Helpers shared by the compression tests: seeded gradients and byte surgery."""

from __future__ import annotations

import struct

import torch

from edgestream.compression import wire


def make_gradient(shape: tuple[int, ...], seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Heavy-tailed values like real gradients: a normal times a log-normal magnitude."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    spread = torch.exp(torch.randn(shape, generator=gen))
    return (base * spread * scale).to(torch.float32)


def shape_offset(data: bytes, layer_index: int = 0) -> int:
    """Byte offset of the first shape dimension of a layer frame."""
    layout = wire.parse_layout(data)[layer_index]
    return layout.offset + 2 + len(layout.name.encode()) + 6


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    """``data`` with ``new`` written over it at ``offset``."""
    return data[:offset] + new + data[offset + len(new) :]


NAN_BYTES = {
    torch.float32: struct.pack("<f", float("nan")),
    torch.float64: struct.pack("<d", float("nan")),
    torch.float16: struct.pack("<e", float("nan")),
    torch.bfloat16: bytes([0xC0, 0x7F]),
}
INF_BYTES = {
    torch.float32: struct.pack("<f", float("inf")),
    torch.float64: struct.pack("<d", float("inf")),
    torch.float16: struct.pack("<e", float("inf")),
    torch.bfloat16: bytes([0x80, 0x7F]),
}
