"""BSP membership in live runs: a removed worker that comes back (alive all along, or
restarted from a checkpoint taken before the others dropped it) is readmitted as a joiner;
a member that lost its state (restarted without a checkpoint) is taken out and back in;
ASP: a worker that rejoins without its step counter goes on after the server's last."""

from __future__ import annotations

import numpy as np
import pytest

from edgestream.trainers.local import LocalTrainer
from edgestream.trainers.models import build_model
from tests.unit.trainers.fakes import announce, poll, pump, train_once

NAMES = ("w0", "w1", "w2")


@pytest.fixture
def cluster(make_node, digits):
    shards = digits.shards(3)
    return [make_node(name, "bsp", members=NAMES, data=shards[i]) for i, name in enumerate(NAMES)]


def rounds(bus, nodes, count: int, *, start: float = 0.0) -> None:
    """``count`` rounds of one fake second: every node (active or not) polls, reads all
    it can and trains if allowed."""
    for r in range(count):
        for node in nodes:
            poll(bus, node, start + r)
            pump(bus, node)
            train_once(bus, node)


def digests(nodes) -> set[str]:
    return {n.trainer.parameter_digest() for n in nodes}


def test_a_removed_worker_that_is_heard_again_is_readmitted_and_gets_the_model(bus, cluster):
    rounds(bus, cluster, 4)
    w0, w1, w2 = cluster
    for node in (w0, w1):  # w2 was silent too long: the others drop it
        announce(bus, node, ["w0", "w1"])
    rounds(bus, cluster, 3)
    assert not w2.strategy.active and w2.strategy.view_id == w0.strategy.view_id == 1
    stuck = w2.trainer.version
    rounds(bus, [w0, w1], 3)
    assert w0.trainer.version > stuck  # the others go on without it

    for node in (w0, w1):  # its heartbeats again
        announce(bus, node, ["w0", "w1", "w2"])
    rounds(bus, cluster, 8)

    assert w2.strategy.active and w2.strategy.synced
    assert w2.strategy.stats()["counters"]["readmitted"] == 1
    assert w2.strategy.stats()["counters"]["snapshots_adopted"] == 1
    assert all(n.strategy.members == NAMES and n.strategy.view_id == 2 for n in cluster)
    assert len({n.trainer.version for n in cluster}) == 1 and len(digests(cluster)) == 1
    assert w2.steps_trained > 0


def test_a_worker_restored_from_a_checkpoint_after_it_was_dropped_rejoins(bus, cluster, make_node, digits):
    rounds(bus, cluster, 3)
    w0, w1, w2 = cluster
    # w2's checkpoint: its trainer, strategy and read positions.
    saved = (w2.trainer.state_dict(), w2.strategy.state_dict(), dict(bus._positions["w2"]))
    rounds(bus, cluster, 2)
    bus.unsubscribe("w2")  # SIGKILL
    for node in (w0, w1):  # timed out
        announce(bus, node, ["w0", "w1"])
    rounds(bus, [w0, w1], 5)

    back = make_node("w2", "bsp", members=NAMES, data=digits.shards(3)[2])
    back.trainer.load_state_dict(saved[0])
    back.strategy.load_state_dict(saved[1])
    bus._positions["w2"] = saved[2]  # it re-reads the update log from its checkpoint
    for node in (w0, w1):  # heard again
        announce(bus, node, ["w0", "w1", "w2"])
    nodes = [w0, w1, back]
    rounds(bus, nodes, 10)

    counters = back.strategy.stats()["counters"]
    assert counters["readmitted"] == 1 and counters["snapshots_adopted"] == 1
    assert back.strategy.synced and back.strategy.members == NAMES
    assert len({n.trainer.version for n in nodes}) == 1 and len(digests(nodes)) == 1
    assert back.steps_trained > 0


def test_a_member_that_lost_its_state_is_taken_out_and_back_in(bus, cluster, make_node, digits):
    w0, w1, w2 = cluster
    for node in cluster:
        announce(bus, node, list(NAMES))  # the live set is the initial one: no view
    for node in (w0, w1):  # step 0 is under way: w0 and w1 published, w2 not yet
        train_once(bus, node)
    bus.unsubscribe("w2")
    # w2 restarts without a checkpoint while the others still count it as a member
    # (within the timeout): it joins, from the current end of the log.
    fresh = make_node("w2", "bsp", members=("w0", "w1"), joining=True, data=digits.shards(3)[2], seed=5)
    nodes = [w0, w1, fresh]
    rounds(bus, nodes, 12)  # sync_retry_s = 5: it asks for the model

    assert fresh.strategy.synced and fresh.strategy.stats()["counters"]["sync_requests"] >= 1
    assert w0.strategy.stats()["counters"]["resyncs"] == 1
    assert all(n.strategy.members == NAMES for n in nodes)
    assert all(n.strategy.view_id == 2 for n in nodes)  # out, then back in
    assert len({n.trainer.version for n in nodes}) == 1 and len(digests(nodes)) == 1
    assert fresh.steps_trained > 0


def test_bsp_state_without_the_resync_field_still_loads(cluster):
    state = cluster[0].strategy.state_dict()
    del state["resync"]  # a checkpoint written before this field existed
    cluster[1].strategy.load_state_dict(state)
    assert cluster[1].strategy.stats()["view_id"] == 0


def test_an_asp_worker_that_rejoins_without_its_step_counter_goes_on_after_the_server(
    bus, make_node, digits
):
    server = make_node("server", "asp", role="server", members=("w0",), publish_every=1)
    w0 = make_node("w0", "asp", data=digits.shards(1)[0])
    for _ in range(4):
        train_once(bus, w0)
        pump(bus, server)
        pump(bus, w0)
    applied = server.strategy.stats()["counters"]["applied"]
    assert applied == 4
    bus.unsubscribe("w0")
    announce(bus, server, [])  # w0 timed out
    fresh = make_node("w0", "asp", joining=True, data=digits.shards(1)[0], seed=9)  # no checkpoint
    announce(bus, server, ["w0"])  # heard again: the server sends it the model and its last step
    pump(bus, fresh)
    assert fresh.strategy.can_train()
    for _ in range(3):
        train_once(bus, fresh)
        pump(bus, server)
        pump(bus, fresh)

    counters = server.strategy.stats()["counters"]
    assert counters["applied"] == applied + 3 and counters.get("duplicates", 0) == 0
    assert fresh.strategy.stats()["counters"]["step_counter_resumed"] == 1


def test_an_asp_snapshot_for_another_worker_does_not_move_the_step_counter(make_node, digits):
    w0 = make_node("w0", "asp", data=digits.shards(1)[0])
    trainer = LocalTrainer(build_model("mlp", (64,), 10, 0), lr=0.1)
    from edgestream.trainers.strategies.base import snapshot_message

    msg = snapshot_message(trainer, "server", meta={"worker": "w1", "last_step": 40})
    w0.strategy.on_message(msg)
    assert w0.strategy.state_dict()["local_step"] == 0
    assert np.isfinite(w0.trainer.version)
