"""The registered benchmarks: each name `edgestream bench NAME` takes, the module it runs and
what it measures.

A benchmark is a module with a ``main`` that parses ``sys.argv``: `edgestream bench NAME`
imports it and calls ``main`` (``python -m benchmarks.NAME`` runs it too); it prints a table and writes ``benchmarks/results/NAME.json``. Adding
one is one module and one line in ``BENCHMARKS``; a module shared by several benchmarks
(``tuning``: the learning-rate tuning of ``--tune-lr``; ``censored``: ratios and medians of times
to target with misses; ``claims``: the matrix's claims judged across cost models; ``parallel``: ``--jobs``, the
simulated runs in processes) is named in ``HELPERS``. This package lives in the repository
only: an installed ``edgestream`` without it refuses ``bench``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: ``module`` is its importable name (``benchmarks.<file>``)."""

    name: str
    module: str
    description: str


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("ingest", "edgestream.benchmarks.ingest", "decode + buffer + batch in a worker against plain consumers, on the real broker"),
    Benchmark("compression", "edgestream.benchmarks.compression_bench",
              "throughput, bytes and error of every compressor beside a plain torch reference"),
    Benchmark("mqtt_bridge", "edgestream.benchmarks.mqtt_bridge",
              "the MQTT bridge against a plain paho + kafka-python loop, and publish-to-Kafka latency"),
    Benchmark("mqtt_e2e", "edgestream.benchmarks.mqtt_e2e",
              "MQTT publish to trained, p50/p99, on real smartwatch data over the make demo-mqtt chain"),
    Benchmark("serving", "edgestream.benchmarks.serving",
              "training throughput with serve.predictions on against off, and append-to-prediction latency; "
              "--part serve: edgestream serve against a plain loop, its latency and hot swap"),
    Benchmark("replay", "edgestream.benchmarks.replay", "replay at max speed against Kafka's ProducerPerformance, and timing at 1x"),
    Benchmark("time_to_accuracy", "edgestream.benchmarks.time_to_accuracy",
              "ScaDLES against BSP and the PyTorch DDP peer, on the real broker and the simulated clock"),
    Benchmark("scadles_rate_sweep", "edgestream.benchmarks.scadles_rate_sweep",
              "where ScaDLES's advantage over BSP comes from: a rate-spread sweep on the simulated clock"),
    Benchmark("strategies", "edgestream.benchmarks.strategies",
              "every strategy across heterogeneity regimes on the simulated clock (--real: a real-broker subset)"),
    Benchmark("adsp", "edgestream.benchmarks.adsp", "ADSP against BSP, SSP, local SGD and ASP over compute heterogeneity"),
    Benchmark("gossip", "edgestream.benchmarks.gossip", "EdgeGossip against gossip, asynchronous and with a lag bound, beside BSP"),
    Benchmark("testbed", "edgestream.benchmarks.testbed", "BSP and ScaDLES in the edge testbed with one host's link shaped (root)"),
    Benchmark("dlion", "edgestream.benchmarks.dlion", "DLion and its ablations against BSP and gossip on the simulated clock"),
    Benchmark("dlion_testbed", "edgestream.benchmarks.dlion_testbed",
              "DLion against BSP and gossip on the real broker in the edge testbed (root)"),
    Benchmark("byzantine", "edgestream.benchmarks.byzantine", "robust aggregation against Byzantine workers on the simulated clock"),
    Benchmark("synthetic_gradients", "edgestream.benchmarks.synthetic_gradients",
              "whole-model backprop against pipeline_bp, dni and cdni stage processes on the real broker"),
    Benchmark("soak", "edgestream.benchmarks.soak", "30 minutes with device bursts: memory, buffers, lag, accounting (make soak)"),
    Benchmark("ddp_peer", "edgestream.benchmarks.ddp_peer",
              "the PyTorch DDP (gloo) peer time_to_accuracy starts, one rank per device (not run alone)"),
)}


#: Modules of this package that are not benchmarks: shared by several of them (no ``main``).
HELPERS = frozenset({"edgestream.benchmarks.tuning", "edgestream.benchmarks.censored", "edgestream.benchmarks.claims",
                     "edgestream.benchmarks.parallel"})


def names() -> list[str]:
    """Every registered benchmark name, sorted."""
    return sorted(BENCHMARKS)
