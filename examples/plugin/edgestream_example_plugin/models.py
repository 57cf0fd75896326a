"""``example_net``: a three-block network whose block names are its stage boundaries."""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from edgestream.trainers.models import register_model


@register_model("example_net")
def build_example_net(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> nn.Module:
    """Flattened features -> ``stem`` (Linear + ReLU) -> ``body`` (Linear + ReLU) -> ``head``.

    An ``nn.Sequential`` of named blocks: ``train.stages`` may cut after ``stem`` or ``body``
    (the last block, ``head``, is never a boundary). Any input shape; ``hidden`` >= 1.
    """
    if hidden < 1:
        raise ValueError(f"example_net: hidden must be >= 1, got {hidden}")
    features = math.prod(input_shape)
    return nn.Sequential(OrderedDict(
        stem=nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU()),
        body=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        head=nn.Linear(hidden, num_classes),
    ))
