"""MQTT topic patterns and the order of acknowledgements (streams/mqtt.py), no broker."""

from __future__ import annotations

import threading

import pytest

from edgestream.streams.errors import TopicNameError
from edgestream.streams.mqtt import AckOrder, MqttTopics


def test_a_pattern_subscribes_with_plus_at_the_device_level_and_reads_the_device_back():
    t = MqttTopics(["sensors/{device}/imu", "plant/+/{device}/#"])
    assert t.filters == ["sensors/+/imu", "plant/+/+/#"]
    assert t.device_of("sensors/a7/imu") == "a7"
    assert t.device_of("plant/line1/pump-3") == "pump-3"  # '#' matches zero levels too
    assert t.device_of("plant/line1/pump-3/temp/raw") == "pump-3"
    assert t.device_of("sensors/a7/gps") is None
    assert t.device_of("sensors/a7/imu/x") is None
    assert t.device_of("sensors//imu") is None  # an empty device level names no device
    assert t.device_of("other") is None


@pytest.mark.parametrize("pattern, says", [
    ("sensors/+/imu", "must hold {device} once"),
    ("sensors/{device}/{device}", "must hold {device} once"),
    ("sensors/dev{device}/imu", "must hold {device} once"),
    ("sensors/#/{device}", "'#' may only be the last level"),
    ("sensors/a+/{device}", "must each be a whole level"),
    ("$SYS/{device}", "broker's own"),
    ("", "give a topic"),
])
def test_bad_patterns_are_refused_with_what_to_write(pattern, says):
    with pytest.raises(TopicNameError, match=says.replace("{", r"\{").replace("}", r"\}").replace("+", r"\+")
                       .replace("$", r"\$")):
        MqttTopics([pattern])


def test_no_pattern_or_two_with_one_filter_are_refused():
    with pytest.raises(TopicNameError, match="no MQTT topic pattern"):
        MqttTopics([])
    with pytest.raises(TopicNameError, match="same filter"):
        MqttTopics(["a/{device}", "a/{device}"])


def test_acks_go_out_in_arrival_order_whatever_order_kafka_confirms_in():
    order = AckOrder()
    tickets = [order.received(mid) for mid in (11, 12, 13, 14)]
    assert order.done(tickets[2]) == []  # 13 waits for 11 and 12
    assert order.done(tickets[1]) == []
    assert order.done(tickets[0]) == [11, 12, 13]
    assert len(order) == 1
    assert order.done(tickets[3]) == [14]
    assert len(order) == 0
    with pytest.raises(KeyError, match="done twice"):
        order.done(tickets[3])


def test_a_new_connection_voids_the_old_tickets_so_an_old_packet_id_is_never_acknowledged():
    order = AckOrder()
    old = order.received(7)
    assert order.reconnected() == 1
    fresh = order.received(7)  # the same packet id names another message on the new connection
    assert order.done(old) == []  # confirmed by Kafka after the reconnect: acknowledges nothing
    assert order.done(fresh) == [7]


def test_ack_order_is_safe_across_threads():
    order = AckOrder()
    tickets = [order.received(i % 65535 + 1) for i in range(4000)]
    acked: list[int] = []
    lock = threading.Lock()

    def confirm(part):
        for t in part:
            with lock:  # as the bridge does: take the ids and send them under one lock
                acked.extend(order.done(t))

    threads = [threading.Thread(target=confirm, args=(tickets[i::4],)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert acked == [i % 65535 + 1 for i in range(4000)]
