"""Gossip neighbour graphs and their Metropolis-Hastings weights (trainers/topology.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from edgestream.trainers.errors import StrategyError
from edgestream.trainers.topology import (
    TOPOLOGIES,
    build_graph,
    is_connected,
    metropolis_weights,
    random_regular,
    regular_degree,
    torus_shape,
)

SIZES = range(1, 18)


def _members(count: int) -> list[str]:
    return [f"edge-{k:02d}" for k in range(count)]


def _matrix(graph) -> np.ndarray:
    index = {m: k for k, m in enumerate(graph.members)}
    matrix = np.zeros((len(index), len(index)))
    for row, weights in graph.weights.items():
        for col, weight in weights.items():
            matrix[index[row], index[col]] = weight
    return matrix


@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("kind", TOPOLOGIES)
def test_metropolis_weights_are_doubly_stochastic_symmetric_and_local(kind, count):
    graph = build_graph(kind, _members(count), degree=3, seed=5)
    matrix = _matrix(graph)

    assert np.abs(matrix.sum(axis=1) - 1).max() <= 1e-12
    assert np.abs(matrix.sum(axis=0) - 1).max() <= 1e-12
    assert np.array_equal(matrix, matrix.T)
    assert matrix.min() >= 0
    for member in graph.members:
        assert set(graph.weights[member]) == {member, *graph.neighbours[member]}
        assert member not in graph.neighbours[member]
        for other in graph.neighbours[member]:
            assert member in graph.neighbours[other]
    assert is_connected(graph.neighbours)
    if count > 1:  # repeated mixing contracts towards the average
        moduli = np.sort(np.abs(np.linalg.eigvalsh(matrix)))
        assert moduli[-1] == pytest.approx(1.0) and moduli[-2] < 1 - 1e-9


@pytest.mark.parametrize("kind", TOPOLOGIES)
def test_the_graph_depends_on_the_member_set_not_its_order(kind):
    members = _members(11)
    shuffled = members[:]
    random.Random(3).shuffle(shuffled)

    assert build_graph(kind, shuffled, seed=2) == build_graph(kind, members, seed=2)


@pytest.mark.parametrize("kind", TOPOLOGIES)
def test_a_membership_change_rebuilds_a_valid_graph_over_the_rest(kind):
    members = _members(9)
    rest = members[:4] + members[5:]

    graph = build_graph(kind, rest, seed=1)

    assert graph.members == tuple(rest)
    assert all("edge-04" not in adjacent for adjacent in graph.neighbours.values())
    assert is_connected(graph.neighbours)
    assert np.abs(_matrix(graph).sum(axis=0) - 1).max() <= 1e-12


@pytest.mark.parametrize("count", SIZES)
def test_ring_links_each_member_to_the_next_and_previous(count):
    graph = build_graph("ring", _members(count))

    expected = 0 if count == 1 else 1 if count == 2 else 2
    assert {graph.degree(m) for m in graph.members} == {expected}
    assert graph.neighbours["edge-00"] == tuple(sorted({_members(count)[1 % count], _members(count)[-1]} - {"edge-00"}))


@pytest.mark.parametrize(("count", "shape"), [(1, (1, 1)), (7, (1, 7)), (8, (2, 4)), (9, (3, 3)), (12, (3, 4)),
                                              (16, (4, 4)), (17, (1, 17))])
def test_torus_shape_is_the_squarest_factorisation(count, shape):
    assert torus_shape(count) == shape


def test_torus_of_nine_is_four_regular_and_wraps():
    graph = build_graph("torus", _members(9))

    assert {graph.degree(m) for m in graph.members} == {4}
    # (0, 0) sits next to (0, 1), (0, 2), (1, 0), (2, 0).
    assert graph.neighbours["edge-00"] == ("edge-01", "edge-02", "edge-03", "edge-06")


@pytest.mark.parametrize(("count", "degree", "used"), [
    (10, 3, 3), (9, 3, 4), (7, 5, 6), (8, 7, 7), (5, 9, 4), (2, 3, 1), (1, 3, 0), (16, 4, 4),
])
def test_regular_degree_handles_odd_products_and_large_degrees(count, degree, used):
    assert regular_degree(count, degree) == used


@pytest.mark.parametrize("count", range(3, 18))
@pytest.mark.parametrize("degree", [2, 3, 4, 5])
def test_random_regular_graph_is_regular_simple_connected_and_deterministic(count, degree):
    members = _members(count)

    graph = random_regular(members, degree, seed=7)

    used = regular_degree(count, degree)
    assert {len(adjacent) for adjacent in graph.values()} == {used}
    assert all(m not in adjacent and len(set(adjacent)) == len(adjacent) for m, adjacent in graph.items())
    assert is_connected(graph)
    assert random_regular(list(reversed(members)), degree, seed=7) == graph


def test_random_regular_graph_depends_on_the_seed():
    members = _members(14)

    graphs = {tuple(sorted(random_regular(members, 3, seed=seed).items())) for seed in range(5)}

    assert len(graphs) > 1


def test_random_regular_refuses_a_degree_that_cannot_connect():
    with pytest.raises(StrategyError, match="degree >= 2"):
        random_regular(_members(6), 1)


def test_metropolis_weights_on_an_irregular_graph_follow_the_larger_degree():
    star = {"hub": ("a", "b", "c"), "a": ("hub",), "b": ("hub",), "c": ("hub",)}

    weights = metropolis_weights(star)

    assert weights["a"] == {"hub": 0.25, "a": 0.75}
    assert weights["hub"] == {"a": 0.25, "b": 0.25, "c": 0.25, "hub": 0.25}


@pytest.mark.parametrize("bad", [{"a": ("b",), "b": ()}, {"a": ("a",)}])
def test_metropolis_weights_refuse_a_directed_or_looped_graph(bad):
    with pytest.raises(StrategyError, match="undirected"):
        metropolis_weights(bad)


def test_unknown_topology_is_refused_by_name():
    with pytest.raises(StrategyError, match="unknown topology 'hypercube'"):
        build_graph("hypercube", _members(4))
