"""Error-feedback memories: what a compressor dropped, carried into the next step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from edgestream.compression import errors
from edgestream.compression.errors import CompressionError


class Memory(ABC):
    """Compensates a gradient before compression and learns from what was actually sent.

    Keyed by layer name. Use one instance per outgoing link: residuals of
    different receivers must not mix.
    """

    @abstractmethod
    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The tensor to compress for ``name`` this step (the gradient plus anything owed)."""

    @abstractmethod
    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Record that ``sent`` (as the receiver will decode it) went out for ``compensated``."""

    def residual(self, name: str) -> torch.Tensor | None:
        """What is still owed for ``name`` (None when nothing is)."""
        return None

    def reset(self) -> None:
        """Forget everything owed (e.g. when the model is replaced)."""
        return None  # stateless by default

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint."""
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what ``state_dict`` returned."""
        return None  # stateless by default


class NoMemory(Memory):
    """No error feedback: compress the raw gradient and drop what was not sent."""

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        return None


class ErrorFeedback(Memory):
    """Residual error feedback: ``v = g + e``; send ``C(v)``; ``e = v - C(v)``.

    Invariant: for each layer, the sum of everything sent plus the current
    residual equals the sum of every gradient compensated so far (exactly, up
    to fp32 rounding), so nothing a compressor drops is lost, only delayed.
    Residuals are kept in fp32 on the CPU whatever the gradient's dtype.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        grad32 = grad.detach().to(device="cpu", dtype=torch.float32)
        owed = self._residuals.get(name)
        if owed is None:
            return grad32
        if owed.shape != grad32.shape:
            raise CompressionError(
                errors.SHAPE_MISMATCH,
                f"gradient {tuple(grad32.shape)} vs residual {tuple(owed.shape)}",
                layer=name,
            )
        return grad32 + owed

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        if compensated.shape != sent.shape:
            raise CompressionError(
                errors.SHAPE_MISMATCH,
                f"sent {tuple(sent.shape)} vs compensated {tuple(compensated.shape)}",
                layer=name,
            )
        self._residuals[name] = compensated.detach().float() - sent.detach().float()

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def reset(self) -> None:
        self._residuals.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: owed.clone() for name, owed in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._residuals = {
            name: owed.detach().to(torch.float32).clone() for name, owed in state.items()
        }
