"""IngestCore on a topic shared by every device (``input.topic`` without ``{device}``): the
device is the message key (or, without one, the device the message names), state is made
per device on first sight and forgotten when idle, and every record stays accounted for."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from edgestream.job.config import load_config
from edgestream.monitoring.metrics import Metrics
from edgestream.monitoring.scrape import Scrape
from edgestream.pipeline.ingest import EVICTED, EVICTED_DEVICES, UNKNOWN_DEVICE, IngestCore
from tests.unit.pipeline.test_ingest_core import _exposition, message

TOPIC = "plant1.readings"


def shared_core(*overrides: str, devices=(), restored=None) -> IngestCore:
    cfg = load_config(overrides=[f"input.topic={TOPIC}", "input.partitions=4", "workers.count=1",
                                 "batcher.mode=window", "batcher.window_s=1", "batcher.max_batch=1000",
                                 *overrides], env={})
    return IngestCore(cfg, list(devices), Metrics(), start=0.0, expected_shape=(4,), num_classes=10,
                      restored=restored)


def send(core: IngestCore, device: str | None, value: bytes, offset: int, now: float, partition: int = 0):
    key = None if device is None else device.encode()
    return core.on_message(TOPIC, partition, offset, key, value, f"{partition}@{offset}", now, 101.0,
                           timestamp_s=100.0)


def drain(core: IngestCore, now: float) -> list:
    """Close every window and settle every batch as trained; the tokens acknowledged."""
    acks = []
    for batch in core.on_tick(now).batches:
        acks += core.settle_batch(batch)
    return acks


def test_devices_are_met_by_key_and_each_keeps_its_own_ledger():
    core = shared_core()
    for i in range(30):
        device = f"d{i % 3}"
        send(core, device, message(device, i, 2), i, now=i * 0.01, partition=(i % 3) % 2)

    acks = drain(core, 1.0)

    assert sorted(core.devices) == ["d0", "d1", "d2"] and len(acks) == 30
    for device in ("d0", "d1", "d2"):
        acc = core.accounting()[device]
        assert acc["messages_in"] == 10 and acc["records_in"] == acc["consumed"] == 20 and acc["pending"] == 0
    assert core.state_of("d1").partition == 1


def test_a_key_that_disagrees_with_the_message_or_names_no_device_is_dead_lettered():
    core = shared_core()

    wrong = send(core, "d0", message("d1", 0, 2), 0, now=0.0).dead_letters
    bad_key = core.on_message(TOPIC, 0, 1, b"no spaces allowed", message("d1", 0, 2), "t1", 0.0, 101.0)
    not_utf8 = core.on_message(TOPIC, 0, 2, b"\xff\xfe", message("d1", 0, 2), "t2", 0.0, 101.0)

    assert [letter.reason for letter in wrong] == ["bad_device"] and wrong[0].device == "d0"
    assert core.accounting()["d0"]["dead_letter_messages"] == 1
    for letters in (bad_key.dead_letters, not_utf8.dead_letters):
        (letter,) = letters
        assert letter.reason == "bad_device" and letter.device == UNKNOWN_DEVICE and "not a device id" in letter.detail
        assert core.letter_sent(letter) == [letter.token]  # acknowledged once durable
    assert "d1" not in core.devices  # no state for a device no good message came from


def test_without_a_key_the_device_is_the_one_the_message_names():
    core = shared_core()

    send(core, None, message("d7", 0, 3), 0, now=0.0)

    assert core.devices == ["d7"] and core.accounting()["d7"]["records_in"] == 3


def test_without_a_key_a_format_that_names_no_device_is_dead_lettered_saying_so():
    core = shared_core("input.format=json", "input.features=a,b,c,d", "input.label=y")
    reading = orjson.dumps({"a": 1, "b": 2, "c": 3, "d": 4, "y": 1})

    (letter,) = send(core, None, reading, 0, now=0.0).dead_letters
    assert letter.reason == "bad_device" and "needs its device id as its key" in letter.detail
    send(core, "d3", reading, 1, now=0.0)
    assert core.accounting()["d3"]["records_in"] == 1


def test_an_idle_device_is_forgotten_and_its_counts_kept_summed():
    core = shared_core("input.device_idle_s=10")
    send(core, "d0", message("d0", 0, 4), 0, now=0.0)
    send(core, "d1", message("d1", 0, 2), 1, now=0.0)
    drain(core, 1.0)
    send(core, "d1", message("d1", 2, 2), 2, now=9.5)  # d1 stays busy

    core.on_tick(10.5)  # d0: idle 10.5 s with nothing pending

    assert core.devices == ["d1"] and core.devices_evicted == 1
    saved = core.resolved_ledgers()
    assert saved[EVICTED]["records_in"] == saved[EVICTED]["consumed"] == 4 and saved[EVICTED_DEVICES] == 1
    scrape = Scrape.parse(_exposition(core))
    assert scrape.get("edgestream_devices_evicted_total") == 1 and scrape.get("edgestream_held_devices") == 1
    assert 'device="d0"' not in _exposition(core) and 'device="d1"' in _exposition(core)
    # it comes back fresh; the checkpoint's sums still hold what it did before
    send(core, "d0", message("d0", 4, 1), 3, now=11.0)
    assert core.accounting()["d0"]["records_in"] == 1 and core.resolved_ledgers()[EVICTED]["records_in"] == 4


def test_a_device_with_records_in_flight_is_never_forgotten():
    core = shared_core("input.device_idle_s=1", "input.max_devices=1")
    send(core, "d0", message("d0", 0, 2), 0, now=0.0)  # buffered, not trained

    core.on_tick(5.0)  # its window closed: handed to the sink, not settled
    send(core, "d1", message("d1", 0, 2), 1, now=5.0)  # beyond max_devices, yet d0 is in flight

    assert sorted(core.devices) == ["d0", "d1"] and core.devices_evicted == 0


def test_beyond_max_devices_the_longest_idle_device_goes_first():
    core = shared_core("input.max_devices=3", "input.device_idle_s=1000")
    for i, device in enumerate(["d0", "d1", "d2"]):
        send(core, device, message(device, 0, 1), i, now=float(i))
    drain(core, 3.0)

    send(core, "d3", message("d3", 0, 1), 3, now=4.0)

    assert core.devices == ["d1", "d2", "d3"] and len(core.state_of("d3").ledger.to_dict()) > 0


def test_memory_per_worker_does_not_grow_with_the_devices_ever_met():
    core = shared_core("input.max_devices=50", "input.device_idle_s=2")
    for round_ in range(40):  # 40 waves of 50 new devices each: 2,000 devices met
        now = float(round_ * 3)
        for i in range(50):
            device = f"r{round_}d{i}"
            send(core, device, message(device, 0, 1), round_ * 50 + i, now=now)
        drain(core, now + 1.5)
        assert len(core.devices) <= 50 and len(core.buffers) == len(core.ledgers) == len(core.devices)

    saved = core.resolved_ledgers()
    held = sum(v["records_in"] for k, v in saved.items() if not k.startswith("*"))
    assert held + saved[EVICTED]["records_in"] == 2000 and saved[EVICTED_DEVICES] == 2000 - len(core.devices)


def test_a_restored_checkpoint_keeps_the_sums_and_the_devices_not_met_again():
    core = shared_core("input.device_idle_s=1")
    send(core, "d0", message("d0", 0, 3), 0, now=0.0)
    send(core, "d1", message("d1", 0, 2), 1, now=0.0)
    drain(core, 1.0)
    core.on_tick(2.5)  # both forgotten
    send(core, "d2", message("d2", 0, 1), 2, now=3.0)
    drain(core, 4.0)
    saved = core.resolved_ledgers()

    again = shared_core("input.device_idle_s=1", restored=saved)

    assert again.devices_evicted == 2 and again.evicted.records_in == 5
    assert again.devices == [] and again.resolved_ledgers()["d2"]["records_in"] == 1  # kept until met
    send(again, "d2", message("d2", 1, 1), 3, now=0.0)
    assert again.accounting()["d2"]["records_in"] == 2


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_shared_topic_settings_are_configuration_errors(bad):
    from edgestream.job.config import ConfigError

    with pytest.raises(ConfigError, match="input.partitions"):
        shared_core(f"input.partitions={bad}")
    with pytest.raises(ConfigError, match="input.max_devices"):
        shared_core(f"input.max_devices={bad}")
    with pytest.raises(ConfigError, match="input.device_idle_s"):
        shared_core(f"input.device_idle_s={bad}")


def test_a_shared_topic_needs_the_direct_source_and_enough_partitions():
    from edgestream.job.config import ConfigError

    with pytest.raises(ConfigError, match="kafka.ingest_source=direct"):
        shared_core("kafka.ingest_source=faust")
    with pytest.raises(ConfigError, match="fewer than workers.count"):
        shared_core("workers.count=5")
    cfg = load_config(overrides=[f"input.topic={TOPIC}", "input.partitions=12", "workers.count=3",
                                 "devices.count=300"], env={})
    assert [cfg.partitions_of(w) for w in cfg.worker_names()] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    owned = [set(cfg.devices_of(w)) for w in cfg.worker_names()]
    assert set().union(*owned) == set(cfg.devices.device_ids()) and sum(map(len, owned)) == 300
    assert np.all([cfg.input.layout().partition_of(d, 12) % 3 == 1 for d in cfg.devices_of("w1")])


def test_a_worker_whose_partitions_hold_no_device_of_the_job_is_a_configuration_error():
    from edgestream.job.config import ConfigError
    from edgestream.streams.topics import TopicLayout

    ids = [f"d{i}" for i in range(40) if TopicLayout.partition_of(f"d{i}", 4) != 3][:5]  # none in partition 3

    with pytest.raises(ConfigError, match=r"w3 reads its partitions \[3\], where no device of the job falls"):
        load_config(overrides=[f"input.topic={TOPIC}", "input.partitions=4", "workers.count=4",
                               f"devices.ids={','.join(ids)}", "devices.count=5"], env={})
