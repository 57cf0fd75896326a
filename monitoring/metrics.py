"""Every edgestream Prometheus metric, defined once; code records through these objects.

Names follow ``edgestream_<noun>_<unit>`` with base units (seconds, bytes, ``_total``
for counters). Labels are bounded: ``device`` (configured streams), ``worker``
(configured workers), ``reason`` (fixed slug sets), ``codec`` and ``strategy``
(registry names), ``split`` (``train`` | ``heldout`` | ``validation`` | ``prequential`` |
``prequential_recent``), ``state`` (the ledger's five states), ``member`` and ``peer``
(configured workers and the server), ``param`` (``LOSS_FIT_PARAMS``), ``index``
(``0 .. dim - 1`` of the model sketch, 32 by default).

Dashboards (``monitoring.dashboards``) and alert rules refer to these objects or are
checked against them, so a rename here shows up in the generated JSON and in tests.

A ``Metrics`` instance owns its own ``CollectorRegistry`` so several can live in one
process (tests); each process creates one and serves it with ``serve``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from edgestream.monitoring.health import DEFAULT_LIVENESS_TIMEOUT_S, Health
from edgestream.monitoring.health import serve as serve_health

# Torch-free: the declarations of the strategies' own metrics, one beside each field of
# ``Observations`` (``LOSS_FIT_PARAMS`` and ``OBSERVATIONS`` re-exported for their users).
from edgestream.trainers.observations import LOSS_FIT_PARAMS as LOSS_FIT_PARAMS
from edgestream.trainers.observations import OBSERVATIONS, observation_metrics

if TYPE_CHECKING:
    from edgestream.streams.topics import TopicLayout

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
#: ``edgestream_trained_record_age_seconds``: from a window batch's fraction of a second to
#: readings that waited for a delayed label.
RECORD_AGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
#: ``reason`` values of ``edgestream_buffer_dropped_records_total`` (pipeline/ingest.py).
DROP_REASONS = ("overflow", "window_truncate")
#: ``reason`` values of ``edgestream_bridge_dead_letter_messages_total`` (pipeline/bridge.py).
BRIDGE_DEAD_REASONS = ("bad_device", "unknown_device", "too_large")
#: ``reason`` values of ``edgestream_rejected_steps_total`` (trainers/guard.py ``REASONS``;
#: kept here so monitoring does not import torch).
STEP_REJECT_REASONS = ("bad_batch", "non_finite_loss", "non_finite_gradient", "gradient_norm", "gradient_spike")
#: ``reason`` values of ``edgestream_dead_letter_records_total``: out of range or an event time off
#: its message's Kafka timestamp at ingest (streams/eventtime.py ``BAD_TIMESTAMP``), or a rejected step.
DEAD_RECORD_REASONS = ("out_of_range", "bad_timestamp", "outside_observed_range", *STEP_REJECT_REASONS)
STALENESS_VERSION_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
STALENESS_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    """The metric objects of one process."""

    def __init__(self, registry: CollectorRegistry | None = None, health: Health | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        #: What the process's ``/healthz`` and ``/readyz`` answer (``serve``).
        self.health = health or Health()
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
        self.device_backlog = Gauge(
            "edgestream_device_backlog_records",
            "Records of the device read and not yet trained beyond one window batch (0: kept up with; "
            "growing: it arrives faster than its worker batches and trains)",
            ["device"], registry=r,
        )
        self.batch_cap = Gauge(
            "edgestream_batch_cap_records",
            "The current cap of the device's window batch (batcher.max_batch, widened up to "
            "batcher.max_batch_widen while arrivals outpace it)",
            ["device"], registry=r,
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
        self.duplicate_records = Counter(
            "edgestream_duplicate_records_total",
            "Records dropped at ingest because their device sent their sequence number before "
            "(data.duplicate_window)",
            ["device"], registry=r,
        )
        self.dead_letters = Counter(
            "edgestream_dead_letter_messages_total",
            "Messages routed to a dead-letter topic",
            ["device", "reason"],
            registry=r,
        )
        self.dead_letter_records = Counter(
            "edgestream_dead_letter_records_total",
            "Records of decoded messages routed to sensors.dlq (out of their declared range at ingest, "
            "or in a training step that was rejected)",
            ["device", "reason"],
            registry=r,
        )
        self.trained_device_records = Counter(
            "edgestream_device_trained_records_total",
            "Records of the device settled as trained (without training: taken by the sink)",
            ["device"], registry=r,
        )
        self.ledger_records = Gauge(
            "edgestream_ledger_records",
            "The worker's record ledger of the device, continued across restarts from the checkpoint: "
            "read = trained + dropped + dead_lettered + pending",
            ["device", "state"], registry=r,
        )
        self.ledger_dead_letter_messages = Gauge(
            "edgestream_ledger_dead_letter_messages",
            "Messages of the device dead-lettered whole, continued across restarts from the checkpoint",
            ["device"], registry=r,
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
        self.records_refused = Counter(
            "edgestream_records_refused_total",
            "Records of device messages the cluster refused to take (reason: the client error, e.g. "
            "TopicAuthorizationFailedError: this principal may not write that device's topic)",
            ["device", "reason"], registry=r,
        )
        # --- MQTT bridge (pipeline/bridge.py) ---------------------------------------
        self.bridge_received = Counter(
            "edgestream_bridge_received_messages_total",
            "MQTT messages the bridge received (each delivery; received = forwarded + dead-lettered "
            "+ in flight)", ["device"], registry=r,
        )
        self.bridge_forwarded = Counter(
            "edgestream_bridge_forwarded_messages_total",
            "MQTT messages the bridge wrote to the device's Kafka topic (acknowledged by Kafka)",
            ["device"], registry=r,
        )
        self.bridge_dead_letters = Counter(
            "edgestream_bridge_dead_letter_messages_total",
            "MQTT messages the bridge wrote to sensors.dlq instead (reason: bad_device, unknown_device, "
            "too_large)", ["device", "reason"], registry=r,
        )
        self.bridge_in_flight = Gauge(
            "edgestream_bridge_in_flight_messages",
            "MQTT messages received and not yet acknowledged by Kafka", registry=r,
        )
        self.bridge_mqtt_connected = Gauge(
            "edgestream_bridge_mqtt_up", "1 while the bridge is connected to the MQTT broker", registry=r,
        )
        self.bridge_mqtt_connects = Counter(
            "edgestream_bridge_mqtt_connects_total",
            "Connections the bridge made to the MQTT broker (more than 1: it reconnected)", registry=r,
        )
        self.bridge_kafka_retries = Counter(
            "edgestream_bridge_kafka_retries_total",
            "Kafka writes of the bridge that failed and were tried again (the MQTT message stays "
            "unacknowledged meanwhile)", registry=r,
        )
        # --- process --------------------------------------------------------------
        self.worker_up = Gauge(
            "edgestream_worker_up", "1 while the worker process is running", ["worker"], registry=r
        )
        self.worker_ready = Gauge(
            "edgestream_worker_ready", "1 once the worker's consumer has its partitions assigned",
            ["worker"], registry=r,
        )
        self.last_checkpoint = Gauge(
            "edgestream_last_checkpoint_timestamp_seconds",
            "Unix time of the worker's last completed checkpoint", ["worker"], registry=r,
        )
        # --- a shared device topic's device states ------------------------------------------
        self.devices_held = Gauge(
            "edgestream_held_devices",
            "Devices the worker keeps ingest state for (a shared topic: bounded by input.max_devices)",
            registry=r,
        )
        self.devices_evicted = Counter(
            "edgestream_devices_evicted_total",
            "Devices of a shared topic whose state the worker forgot (idle input.device_idle_s with "
            "nothing pending, or beyond input.max_devices); their counts are kept summed",
            registry=r,
        )
        # --- delayed labels (labels.topic) ---------------------------------------------------
        self.labels_read = Counter(
            "edgestream_labels_total",
            "Labels read from labels.topic, by what became of them (state): joined (to their reading), "
            "late (no reading came for it within labels.max_delay_s: it came too late, or never), "
            "foreign (a device another worker reads)",
            ["state"], registry=r,
        )
        self.lookup_waiting = Gauge(
            "edgestream_ingest_lookup_paused",
            "1 while ingest is paused, waiting for a service decoding needs (the Avro input's schema registry) to answer",
            registry=r,
        )
        self.lookup_waits = Counter(
            "edgestream_ingest_lookup_waits_total",
            "Times ingest waited for a service decoding needs (the schema registry) until it answered again",
            registry=r,
        )
        self.label_waiting = Gauge(
            "edgestream_label_waiting_records", "Readings waiting for their label (labels.topic)", registry=r,
        )
        self.label_early = Gauge(
            "edgestream_label_early_records", "Labels waiting for their reading (labels.topic)", registry=r,
        )
        self.label_prequential_records = Counter(
            "edgestream_label_prequential_records_total",
            "Readings scored when their label came, by the prediction the model made when the reading arrived",
            registry=r,
        )
        self.label_prequential_correct = Counter(
            "edgestream_label_prequential_correct_total",
            "Of those, the readings whose arrival-time prediction was their label", registry=r,
        )
        # --- consumer position --------------------------------------------------------
        self.consumer_lag = Gauge(
            "edgestream_consumer_lag_records",
            "End offset minus consumer position, summed over the device topic's partitions",
            ["device"], registry=r,
        )
        # --- training -------------------------------------------------------------------
        self.steps = Counter(
            "edgestream_steps_total", "Local training steps taken", ["worker"], registry=r
        )
        self.step_seconds = Histogram(
            "edgestream_step_seconds", "Wall time of one local training step (forward+backward+update)",
            ["worker"], buckets=SECONDS_BUCKETS, registry=r,
        )
        self.wait_for_data_seconds = Histogram(
            "edgestream_wait_for_data_seconds", "Time the trainer waited for its next batch",
            ["worker"], buckets=SECONDS_BUCKETS, registry=r,
        )
        self.trained_records = Counter(
            "edgestream_trained_records_total", "Records the trainer consumed in steps",
            ["worker"], registry=r,
        )
        self.loss = Gauge(
            "edgestream_loss", "Latest loss (train: last step; heldout: last evaluation; validation: what a strategy decides from)",
            ["worker", "split"], registry=r,
        )
        self.accuracy = Gauge(
            "edgestream_accuracy_ratio", "Latest accuracy in [0, 1] (train: last step; heldout: last evaluation; validation: what a strategy decides from)",
            ["worker", "split"], registry=r,
        )
        # --- synchronisation --------------------------------------------------------------
        self.strategy_info = Gauge(
            "edgestream_sync_strategy_info", "1 for the sync strategy the worker runs",
            ["worker", "strategy"], registry=r,
        )
        self.model_version = Gauge(
            "edgestream_model_version", "Model version the worker currently trains on",
            ["worker"], registry=r,
        )
        # End of run: every reader of an update topic has handled what was written to it.
        self.update_log_written = Gauge(
            "edgestream_update_log_written_messages",
            "One past the offset of the last update message (gradient, model, inbox) this process wrote to the partition",
            ["worker", "topic", "partition"], registry=r,
        )
        self.update_log_handled = Gauge(
            "edgestream_update_log_handled_messages",
            "One past the offset of the last update message this process handled from the partition",
            ["worker", "topic", "partition"], registry=r,
        )
        self.staleness_versions = Histogram(
            "edgestream_staleness_versions",
            "Versions between the model a gradient was computed on and the one it is applied to",
            ["worker"], buckets=STALENESS_VERSION_BUCKETS, registry=r,
        )
        self.staleness_seconds = Histogram(
            "edgestream_staleness_seconds", "Age of a gradient when it is applied",
            ["worker"], buckets=STALENESS_SECONDS_BUCKETS, registry=r,
        )
        self.trained_record_age = Histogram(
            "edgestream_trained_record_age_seconds",
            "How old each record was when the step that trained it was applied: wall clock minus the "
            "record's event time (for a device that stamps its readings when it sends them: send to trained)",
            ["worker"], buckets=RECORD_AGE_BUCKETS, registry=r,
        )
        self.live_workers = Gauge(
            "edgestream_live_workers", "Workers this process sees as live (heartbeats on control.<job>)",
            ["worker"], registry=r,
        )
        self.worker_live = Gauge(
            "edgestream_member_up", "1 while `member` is live in this process's view, 0 once it left or timed out",
            ["worker", "member"], registry=r,
        )
        self.commits = Counter(
            "edgestream_commits_total",
            "Updates (gradients, deltas) the worker committed to the shared model, one per published update",
            ["worker"], registry=r,
        )
        # --- what strategies observe (``SyncStrategy.observations``, ``record_observations``) ---
        #: Each ``Observations`` field's metric, built from its declaration in
        #: trainers/observations.py (fields sharing a metric name share the object).
        self.observed: dict[str, Counter | Gauge] = {}
        by_name: dict[str, Counter | Gauge] = {}
        for key, spec in observation_metrics().items():
            if spec.name not in by_name:
                kind = Counter if spec.kind == "counter" else Gauge
                by_name[spec.name] = kind(spec.name, spec.help, ["worker", *spec.labels], registry=r)
            self.observed[key] = by_name[spec.name]
        self._observed_totals: dict[tuple[str, ...], float] = {}
        #: (worker, observation) -> label values of the children last set for a keyed observation
        self._observed_keys: dict[tuple[str, str], set[str]] = {}
        self.rejected_steps = Counter(
            "edgestream_rejected_steps_total",
            "Local training steps not applied nor published (non-finite loss or gradient, gradient "
            "norm above its bound); their records were dead-lettered",
            ["worker", "reason"], registry=r,
        )
        self.culprit_probes = Counter(
            "edgestream_culprit_probes_total",
            "Sub-steps judged by the culprit search of refused steps (per device, then halves), "
            "to dead-letter only the records that made a step unsound",
            ["worker"], registry=r,
        )
        self.culprit_unresolved_records = Counter(
            "edgestream_culprit_unresolved_records_total",
            "Records of a refused step dead-lettered without being narrowed down (the search's "
            "train.culprit_max_probes ran out, or only their group as a whole was unsound)",
            ["worker"], registry=r,
        )
        self.updates_rejected = Counter(
            "edgestream_updates_rejected_total", "Gradient / model messages rejected before use",
            ["worker", "reason"], registry=r,
        )
        # --- compression ------------------------------------------------------------------
        self.gradient_bytes_sent = Counter(
            "edgestream_gradient_bytes_sent_total", "Gradient message bytes put on the wire",
            ["worker", "codec"], registry=r,
        )
        self.gradient_bytes_received = Counter(
            "edgestream_gradient_bytes_received_total", "Gradient message bytes read from the wire",
            ["worker", "codec"], registry=r,
        )
        self.compression_ratio = Gauge(
            "edgestream_compression_ratio", "Dense bytes / wire bytes of the last gradient sent",
            ["worker"], registry=r,
        )
        self.compression_setting = Gauge(
            "edgestream_compression_setting_ratio",
            "Density (or rank) the link's compression policy chose for the last message "
            "(train.compression_controller accordion / budget; mean over layers)",
            ["worker"], registry=r,
        )
        self.compressed_steps = Counter(
            "edgestream_compressed_steps_total", "Steps whose gradient was sent compressed",
            ["worker"], registry=r,
        )
        self.prequential_records = Counter(
            "edgestream_prequential_records_total",
            "Records of the device scored by the model before it trained on them (test-then-train)",
            ["device"], registry=r,
        )
        self.prequential_correct = Counter(
            "edgestream_prequential_correct_records_total",
            "Records of the device the model predicted right before training on them; "
            "accuracy = rate(correct) / rate(records)",
            ["device"], registry=r,
        )
        self.predictions = Counter(
            "edgestream_predictions_total",
            "Predictions of the device's trained records published on predictions.<job> and acknowledged "
            "(serve.predictions): one per trained record",
            ["device"], registry=r,
        )
        # ``edgestream serve`` (pipeline/serve.py): inference only, beside the training job.
        self.serve_predictions = Counter(
            "edgestream_serve_predictions_total",
            "Predictions edgestream serve published on predictions.<job> and the broker acknowledged, one per record",
            ["device"], registry=r,
        )
        self.serve_latency = Histogram(
            "edgestream_serve_latency_seconds",
            "edgestream serve: from a record's Kafka append (its message's timestamp) to its prediction's "
            "acknowledgement by the broker", buckets=SECONDS_BUCKETS, registry=r,
        )
        self.serve_model_version = Gauge(
            "edgestream_serve_model_version",
            "Version of the model edgestream serve predicts with (-1: none yet)", registry=r,
        )
        self.serve_swaps = Counter(
            "edgestream_serve_model_swaps_total",
            "Models edgestream serve swapped in between two micro-batches (a newer version)", registry=r,
        )
        self.serve_refused = Counter(
            "edgestream_serve_models_refused_total",
            "Models edgestream serve refused and did not use: shape (not the job's model), digest (a file or "
            "message that does not verify), backwards (an older version, or the same with another digest), invalid",
            ["reason"], registry=r,
        )
        self.injected_records = Counter(
            "edgestream_injected_records_total",
            "Samples added to training batches from the shared pool (ScaDLES data injection)",
            ["worker"], registry=r,
        )
        self.compression_vote = Gauge(
            "edgestream_compression_vote", "The worker's current vote for compressing (1) or not (0)",
            ["worker"], registry=r,
        )

    def init_device(self, device: str, *, reasons: bool = True) -> None:
        """Create every per-device counter child at 0, so the first event is a visible increase.

        A counter child born at its first ``inc`` starts at 1, and ``rate``/``increase``
        cannot see that step: without this the first drops and dead letters of a device
        never show on a rate panel. ``reasons=False`` leaves out the children per drop and
        dead-letter reason (about 60 series a device, born at their first event instead):
        a shared topic's worker may hold thousands of devices.
        """
        from edgestream.streams.errors import RecordDecodeError

        for reason in DROP_REASONS if reasons else ():
            self.buffer_dropped.labels(device, reason)
        for reason in RecordDecodeError.REASONS if reasons else ():
            self.dead_letters.labels(device, reason)
        for reason in DEAD_RECORD_REASONS if reasons else ():
            self.dead_letter_records.labels(device, reason)
        for counter in (self.records_in, self.messages_in, self.bytes_in, self.batches, self.batched_records,
                        self.sink_records, self.partition_pauses, self.duplicates_skipped, self.duplicate_records,
                        self.trained_device_records, self.prequential_records, self.prequential_correct):
            counter.labels(device)

    def forget_device(self, device: str) -> None:
        """Remove every labelled child of ``device`` (a forgotten device of a shared topic), so
        the series a worker exports do not grow with the devices it ever met."""
        for metric in vars(self).values():
            # prometheus_client keeps a metric's children by label values in ``_metrics``
            # and its label names in ``_labelnames`` (no public way to list them).
            if isinstance(metric, MetricWrapperBase) and metric._labelnames[:1] == ("device",):
                for values in [v for v in list(metric._metrics) if v[0] == device]:
                    metric.remove(*values)

    def init_worker(self, worker: str) -> None:
        """Create the worker's training counters at 0 (same reason as ``init_device``)."""
        for counter in (self.steps, self.trained_records, self.compressed_steps, self.commits,
                        self.injected_records, self.culprit_probes, self.culprit_unresolved_records):
            counter.labels(worker)
        for reason in STEP_REJECT_REASONS:
            self.rejected_steps.labels(worker, reason)

    # --- small recording helpers (the hot path binds ``.labels(...)`` children itself) -----
    def record_step(
        self, worker: str, *, step_s: float, wait_s: float, records: int, loss: float,
        accuracy: float | None = None, compressed: bool = False,
    ) -> None:
        """One local training step of ``worker``."""
        self.steps.labels(worker).inc()
        self.step_seconds.labels(worker).observe(step_s)
        self.wait_for_data_seconds.labels(worker).observe(wait_s)
        self.trained_records.labels(worker).inc(records)
        self.loss.labels(worker, "train").set(loss)
        if accuracy is not None:
            self.accuracy.labels(worker, "train").set(accuracy)
        if compressed:
            self.compressed_steps.labels(worker).inc()

    def record_applied(self, worker: str, *, staleness_versions: int, staleness_s: float | None) -> None:
        """A gradient (or model delta) applied by ``worker`` with its staleness (``staleness_s``
        None: not known, e.g. applied during a local step; only the versions are recorded)."""
        self.staleness_versions.labels(worker).observe(staleness_versions)
        if staleness_s is not None:
            self.staleness_seconds.labels(worker).observe(staleness_s)

    def record_sent(self, worker: str, codec: str, wire_bytes: int, dense_bytes: int) -> None:
        """A gradient or delta message put on the wire: one commit; updates bytes and the
        compression ratio."""
        self.commits.labels(worker).inc()
        self.gradient_bytes_sent.labels(worker, codec).inc(wire_bytes)
        if wire_bytes > 0:
            self.compression_ratio.labels(worker).set(dense_bytes / wire_bytes)

    def _observation_metrics(self) -> dict[str, tuple[Counter | Gauge, tuple[str, ...]]]:
        """Each observation's metric and its fixed label values after ``worker``.

        A *keyed* observation (a mapping or a sequence) has a metric with one label more,
        set from each key (``peer``) or index (``index``)."""
        return {key: (self.observed[key], spec.fixed) for key, spec in observation_metrics().items()}

    def record_observations(self, worker: str, values: Mapping[str, Any]) -> None:
        """A strategy's observations (``Observations`` as a dict; keys from ``OBSERVATIONS``).

        None: not observed, nothing recorded. A level sets its gauge. A total is exported
        as a counter of its growth since this process first saw it: the first value (say,
        restored from a checkpoint) creates the counter at 0, each larger one adds the
        difference; a smaller one (a reset) is only taken as the new base.

        A keyed level (a mapping per peer, a sequence per index) sets one child per key;
        the children of keys it had at the previous call for this worker and no longer
        has are removed, so a neighbour that left leaves no stale series behind. A keyed
        total (a counter with the extra label) is exported per key as an unkeyed total
        is: each key's growth since this process first saw it (a key seen again after it
        disappeared starts over from its new value).
        """
        metrics = self._observation_metrics()
        unknown = sorted(set(values) - set(metrics))
        if unknown:
            raise ValueError(f"unknown observations {unknown}; known: {list(OBSERVATIONS)}")
        for key, value in values.items():
            if value is None:
                continue
            metric, extra = metrics[key]
            if len(metric._labelnames) > 1 + len(extra):
                self._record_keyed(worker, key, metric, extra, value)
                continue
            if isinstance(value, (Mapping, Sequence)):
                raise TypeError(f"observation {key!r} is a number, got {type(value).__name__}")
            child = metric.labels(worker, *extra)
            if metric._type == "counter":
                self._count_growth(child, (worker, key), float(value))
            else:
                child.set(value)

    def _count_growth(self, child: Any, where: tuple[str, ...], value: float) -> None:
        """Add to counter ``child`` what the total at ``where`` grew since last seen (the
        first value is the base; a smaller one, a reset, only becomes the new base)."""
        last = self._observed_totals.get(where)
        self._observed_totals[where] = value
        if last is not None and value > last:
            child.inc(value - last)

    def _record_keyed(self, worker: str, key: str, metric: Counter | Gauge, extra: tuple[str, ...],
                      value: Any) -> None:
        if isinstance(value, Mapping):
            levels = {str(k): float(v) for k, v in value.items()}
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            levels = {str(i): float(v) for i, v in enumerate(value)}
        else:
            raise TypeError(f"observation {key!r} is a mapping or a sequence, got {type(value).__name__}")
        total = metric._type == "counter"
        for label, level in levels.items():
            child = metric.labels(worker, *extra, label)
            if total:
                self._count_growth(child, (worker, key, label), level)
            else:
                child.set(level)
        for gone in self._observed_keys.get((worker, key), set()) - levels.keys():
            metric.remove(worker, *extra, gone)
            self._observed_totals.pop((worker, key, gone), None)
        self._observed_keys[(worker, key)] = set(levels)

    def record_prequential(
        self, worker: str, *, accuracy: float, loss: float, recent_accuracy: float, recent_loss: float
    ) -> None:
        """Test-then-train scores of ``worker``: since start (``prequential``) and over its
        recent batches (``prequential_recent``)."""
        self.accuracy.labels(worker, "prequential").set(accuracy)
        self.loss.labels(worker, "prequential").set(loss)
        self.accuracy.labels(worker, "prequential_recent").set(recent_accuracy)
        self.loss.labels(worker, "prequential_recent").set(recent_loss)

    def record_evaluation(self, worker: str, loss: float, accuracy: float, split: str = "heldout") -> None:
        """The latest evaluation on ``split``: ``heldout`` (the test split, reported) or
        ``validation`` (what a strategy's decisions are scored on)."""
        self.loss.labels(worker, split).set(loss)
        self.accuracy.labels(worker, split).set(accuracy)

    def record_consumer_lag(self, lag_by_device: Mapping[str, int]) -> None:
        for device, lag in lag_by_device.items():
            self.consumer_lag.labels(device).set(lag)

    def exposition_names(self) -> set[str]:
        """Every sample name this registry can expose (``_total``, ``_bucket``... included)."""
        return {name for metric in self.metric_objects() for name in sample_names(metric)}

    def metric_objects(self) -> list[MetricWrapperBase]:
        """Every metric object of this process, the observations' included (once each)."""
        found = [v for v in vars(self).values() if isinstance(v, MetricWrapperBase)]
        return found + [v for v in dict.fromkeys(self.observed.values()) if v not in found]


def sample_names(metric: MetricWrapperBase) -> list[str]:
    """The sample names ``metric`` exposes, e.g. ``x_total`` for a counter ``x``."""
    base = metric._name  # prometheus_client strips ``_total`` from counter names
    kind = metric._type
    if kind == "counter":
        return [f"{base}_total", f"{base}_created"]
    if kind == "histogram":
        return [f"{base}_bucket", f"{base}_count", f"{base}_sum", f"{base}_created"]
    return [base]


def name_of(metric: MetricWrapperBase, suffix: str = "") -> str:
    """Exposition name of ``metric`` (counters get ``_total``), plus ``suffix`` (``_bucket``...)."""
    if metric._type == "counter":
        return f"{metric._name}_total"
    return metric._name + suffix


def observe_many(histogram: Histogram, values: Any) -> None:
    """``histogram.observe(v)`` for each of ``values`` (a sequence or array of floats), in one
    pass: each bucket's count and the sum are updated once, under their locks, to exactly what
    the per-value calls give (the sum added value by value, in order). ``histogram`` is an
    observable one (a labelled histogram's child); a value class without a lock (multiprocess
    mode) is updated one value at a time."""
    import numpy as np

    amounts = np.asarray(values, dtype=np.float64).reshape(-1)
    if amounts.size == 0:
        return
    histogram._raise_if_not_observable()
    total, buckets = histogram._sum, histogram._buckets
    if not all(hasattr(v, "_lock") and hasattr(v, "_value") for v in (total, *buckets)):
        for amount in amounts.tolist():
            histogram.observe(amount)
        return
    bounds = np.asarray(histogram._upper_bounds, dtype=np.float64)
    # The first bound >= the value, as observe's ``amount <= bound``; NaN counts in no bucket.
    index = np.searchsorted(bounds, amounts, side="left")
    counts = np.bincount(index, minlength=len(bounds) + 1)[:len(bounds)]
    for bucket, count in zip(buckets, counts.tolist(), strict=True):
        if count:
            bucket.inc(float(count))
    with total._lock:
        # cumsum adds in order (no pairwise summation): the float observe's ``+=`` gives.
        total._value = float(np.cumsum(np.concatenate(([total._value], amounts)))[-1])


def consumer_lag(
    end_offsets: Mapping[tuple[str, int], int], positions: Mapping[tuple[str, int], int | None],
    layout: TopicLayout | None = None,
) -> dict[str, int]:
    """Records not yet read, per device: sum over partitions of end offset - position.

    Keys are ``(topic, partition)`` pairs (``TP`` namedtuples of aiokafka/kafka-python
    qualify). A partition without a position yet counts its whole end offset; only
    device topics of ``layout`` (default ``sensors.<device>``; never the DLQ) are counted,
    a shared topic's per partition (``<topic>:<partition>``: its devices are many).
    """
    from edgestream.streams import topics

    layout = layout or topics.DEFAULT_LAYOUT
    out: dict[str, int] = {}
    for tp, end in end_offsets.items():
        topic, _partition = tp
        if not layout.matches(topic):
            continue
        device = f"{topic}:{_partition}" if layout.keyed else layout.device_of(topic)
        position = positions.get(tp)
        lag = max(0, int(end) - int(position or 0))
        out[device] = out.get(device, 0) + lag
    return out



def serve(metrics: Metrics, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` of ``metrics``, and ``/healthz`` / ``/readyz`` of ``metrics.health``,
    on ``host:port`` (port 0 picks one); return the port."""
    return serve_health(metrics.registry, metrics.health, port, host)


def serve_process(port: int = 0, host: str = "127.0.0.1",
                  liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S) -> tuple[Metrics, str]:
    """A process's ``Metrics``, served at once (with ``/healthz`` and ``/readyz``); returns
    it with its ``/metrics`` URL.

    For the processes that are not workers (simulator, replayer): record
    ``records_produced`` on it and list the URL in the run's file-SD targets.
    """
    metrics = Metrics(health=Health(liveness_timeout_s))
    bound = serve(metrics, port, host)
    return metrics, f"http://{host}:{bound}/metrics"
