"""Per-link compression policies: what density each message gets, per link."""

from __future__ import annotations

import pytest
import torch

from edgestream.compression import registry
from edgestream.compression.controllers.policy import AccordionPolicy, BudgetPolicy, create_policy
from edgestream.compression.errors import CompressorConfigError


def grads(scale: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 32), scale), "b": torch.full((32,), scale)}


def test_none_keeps_the_codec_setting():
    policy = create_policy("none", registry.create("topk", ratio=0.1))
    assert policy.contexts(None, grads(1.0)) is None and policy.setting() is None


def test_accordion_is_gentle_until_the_norms_settle_then_aggressive_per_link():
    policy = AccordionPolicy(interval=2, gentle=0.1, aggressive=0.01, eta=0.5)
    link_a, link_b = ("w1", "gradient"), ("w2", "gradient")
    for _ in range(4):  # two intervals of steady gradients on link a
        chosen = policy.contexts(link_a, grads(1.0))
    assert {ctx.ratio for ctx in chosen.values()} == {0.01} and policy.setting() == pytest.approx(0.01)
    chosen = policy.contexts(link_b, grads(1.0))  # a new link starts critical
    assert {ctx.ratio for ctx in chosen.values()} == {0.1}
    for _ in range(2):  # a jump of the norm on link a: critical again
        chosen = policy.contexts(link_a, grads(10.0))
    assert {ctx.ratio for ctx in chosen.values()} == {0.1}


def test_budget_follows_each_links_observed_bandwidth():
    topk = registry.create("topk", ratio=0.5)
    policy = BudgetPolicy(topk, interval_s=0.01, initial_bytes_per_s=1e9)
    fast, slow = ("w1", "gradient"), ("w2", "gradient")
    policy.observe_sent(slow, 1_000, 1.0)  # 1 kB/s: 10 bytes per 10 ms
    fast_ratio = policy.contexts(fast, grads(1.0))["w"].ratio
    slow_ratio = policy.contexts(slow, grads(1.0))["w"].ratio
    assert fast_ratio == pytest.approx(1.0) and slow_ratio < 0.01
    assert policy.setting() == pytest.approx(slow_ratio)


def test_policies_need_a_codec_with_a_knob_and_known_names():
    with pytest.raises(CompressorConfigError, match="density or rank knob"):
        create_policy("accordion", registry.create("dense"))
    with pytest.raises(CompressorConfigError, match="unknown compression controller"):
        create_policy("magic", registry.create("topk", ratio=0.1))
    with pytest.raises(CompressorConfigError):
        create_policy("accordion", registry.create("topk", ratio=0.1), gentle=0.001, aggressive=0.1)
