"""Every edgestream Prometheus metric, defined once; code records through these objects.

Names follow ``edgestream_<noun>_<unit>`` with base units (seconds, bytes, ``_total``
for counters). Labels are bounded: ``device`` (configured streams), ``worker``
(configured workers), ``reason`` (fixed slug sets), ``policy``.

A ``Metrics`` instance owns its own ``CollectorRegistry`` so several can live in one
process (tests); each process creates one and serves it with ``serve``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The metric objects of one process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # --- ingest ---------------------------------------------------------------
        self.records_in = Counter(
            "edgestream_records_in_total", "Records decoded from device topics", ["device"], registry=r
        )
        self.messages_in = Counter(
            "edgestream_messages_in_total", "Messages read from device topics", ["device"], registry=r
        )
        self.bytes_in = Counter(
            "edgestream_bytes_in_total", "Bytes of message values read from device topics", ["device"], registry=r
        )
        self.arrival_rate = Gauge(
            "edgestream_arrival_rate_hz", "Estimated record arrival rate (EWMA)", ["device"], registry=r
        )
        self.event_time_lag = Gauge(
            "edgestream_event_time_lag_seconds",
            "Wall clock minus event time of the newest record read",
            ["device"],
            registry=r,
        )
        self.buffer_depth = Gauge(
            "edgestream_buffer_depth_records", "Records waiting in the device buffer", ["device"], registry=r
        )
        self.buffer_capacity = Gauge(
            "edgestream_buffer_capacity_records", "Configured buffer capacity", ["device"], registry=r
        )
        self.buffer_dropped = Counter(
            "edgestream_buffer_dropped_records_total",
            "Records dropped by an explicit buffer or window policy",
            ["device", "reason"],
            registry=r,
        )
        self.partition_paused = Gauge(
            "edgestream_partition_paused", "1 while the device's partition is paused (backpressure)",
            ["device"], registry=r,
        )
        self.partition_pauses = Counter(
            "edgestream_partition_pauses_total", "Times the device's partition was paused (backpressure)",
            ["device"], registry=r,
        )
        self.duplicates_skipped = Counter(
            "edgestream_duplicate_messages_skipped_total",
            "Messages seen again after a resume seek and skipped (already handled)",
            ["device"], registry=r,
        )
        self.dead_letters = Counter(
            "edgestream_dead_letter_messages_total",
            "Messages routed to a dead-letter topic",
            ["device", "reason"],
            registry=r,
        )
        self.batches = Counter(
            "edgestream_batches_total", "Batches emitted by the batcher", ["device"], registry=r
        )
        self.batched_records = Counter(
            "edgestream_batched_records_total", "Records emitted in batches", ["device"], registry=r
        )
        self.batch_size = Histogram(
            "edgestream_batch_size_records", "Records per emitted batch", ["device"],
            buckets=BATCH_SIZE_BUCKETS, registry=r,
        )
        self.sink_records = Counter(
            "edgestream_sink_records_total", "Records accepted by the batch sink (trained or counted)",
            ["device"], registry=r,
        )
        # --- simulators / replay ---------------------------------------------------
        self.records_produced = Counter(
            "edgestream_records_produced_total", "Records produced to device topics", ["device"], registry=r
        )
        # --- process --------------------------------------------------------------
        self.worker_up = Gauge(
            "edgestream_worker_up", "1 while the worker process is running", ["worker"], registry=r
        )
        self.worker_ready = Gauge(
            "edgestream_worker_ready", "1 once the worker's consumer has its partitions assigned",
            ["worker"], registry=r,
        )


def serve(metrics: Metrics, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` of ``metrics`` on ``host:port`` (port 0 picks one); return the port."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server.server_address[1]
