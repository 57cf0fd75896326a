"""Neighbour graphs for serverless gossip and their Metropolis-Hastings mixing weights.

A graph is built over a *sorted* member list, so every node that knows the same
members builds the same graph (no coordination needed when membership changes:
each node rebuilds from its own view). Four shapes:

- ``ring``: member ``k`` is linked to ``k - 1`` and ``k + 1`` (mod N). N = 2 is one
  edge, N = 1 has none.
- ``torus``: a 2-D torus of ``rows x cols`` with ``rows`` the largest divisor of N not
  above ``sqrt(N)`` (so a prime N is a ring, N = 8 is 2 x 4, N = 9 is 3 x 3); member
  ``k`` sits at ``(k // cols, k % cols)`` and is linked to the four cells around it,
  wrapping (duplicate links of a side of length 2 collapse into one).
- ``regular``: a random ``d``-regular graph, deterministic from the member list and a
  seed: a circulant graph (offsets ``1 .. d // 2``, plus the antipode when ``d`` is
  odd) on a seeded permutation of the members, then seeded degree-preserving double
  edge swaps, each kept only if the graph stays simple and connected. ``d`` is
  clamped to ``N - 1`` (``d >= N - 1`` is the complete graph); when ``N * d`` is odd
  no ``d``-regular graph exists and the degree used is ``d + 1`` (always possible:
  ``N`` and ``d`` are then odd, so ``d + 1 <= N - 1``). ``d`` must be at least 2
  (a 1-regular graph on more than two nodes is a matching: disconnected).
- ``complete``: every pair is linked.

Metropolis-Hastings weights (:func:`metropolis_weights`) work on any undirected
graph: ``W_ij = 1 / (1 + max(d_i, d_j))`` on a link, ``W_ii = 1 - sum_j W_ij``, zero
elsewhere. W is symmetric and doubly stochastic with a non-negative diagonal, so on a
connected graph repeated mixing ``x <- W x`` converges to the average of the start.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from edgestream.trainers.errors import StrategyError

TopologyName = Literal["ring", "torus", "regular", "complete"]
TOPOLOGIES: tuple[str, ...] = get_args(TopologyName)

__all__ = [
    "TOPOLOGIES",
    "Graph",
    "TopologyName",
    "build_graph",
    "complete",
    "is_connected",
    "metropolis_weights",
    "random_regular",
    "regular_degree",
    "ring",
    "torus",
    "torus_shape",
]


@dataclass(frozen=True)
class Graph:
    """An undirected simple graph over sorted members, with its Metropolis-Hastings weights.

    Invariant: ``members`` is sorted and duplicate-free; ``neighbours[m]`` is sorted and
    never holds ``m``; ``b in neighbours[a]`` iff ``a in neighbours[b]``; each row of
    ``weights`` (a member's own weight included) sums to 1.
    """

    kind: str
    members: tuple[str, ...]
    neighbours: Mapping[str, tuple[str, ...]]
    weights: Mapping[str, Mapping[str, float]]

    def degree(self, member: str) -> int:
        return len(self.neighbours[member])


def _sorted_members(members: Iterable[str]) -> tuple[str, ...]:
    unique = sorted(set(members))
    if any(not isinstance(m, str) or not m for m in unique):
        raise StrategyError(f"members must be non-empty strings, got {unique}")
    return tuple(unique)


def _from_edges(members: tuple[str, ...], edges: Iterable[tuple[int, int]]) -> dict[str, tuple[str, ...]]:
    adjacent: dict[int, set[int]] = {k: set() for k in range(len(members))}
    for a, b in edges:
        if a != b:
            adjacent[a].add(b)
            adjacent[b].add(a)
    return {members[k]: tuple(sorted(members[j] for j in adjacent[k])) for k in range(len(members))}


def ring(members: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Neighbours on a ring over the sorted members."""
    names = _sorted_members(members)
    n = len(names)
    return _from_edges(names, ((k, (k + 1) % n) for k in range(n)))


def torus_shape(count: int) -> tuple[int, int]:
    """``(rows, cols)`` of the torus on ``count`` nodes: rows the largest divisor <= sqrt(count)."""
    if count < 1:
        return (0, 0)
    rows = max(d for d in range(1, math.isqrt(count) + 1) if count % d == 0)
    return rows, count // rows


def torus(members: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Neighbours on a 2-D wrap-around grid (see :func:`torus_shape`) over the sorted members."""
    names = _sorted_members(members)
    rows, cols = torus_shape(len(names))
    edges = []
    for k in range(len(names)):
        r, c = divmod(k, cols)
        edges.append((k, ((r + 1) % rows) * cols + c))
        edges.append((k, r * cols + (c + 1) % cols))
    return _from_edges(names, edges)


def complete(members: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Every member linked to every other."""
    names = _sorted_members(members)
    return {m: tuple(x for x in names if x != m) for m in names}


def regular_degree(count: int, degree: int) -> int:
    """The degree :func:`random_regular` uses for ``count`` nodes when ``degree`` is asked:
    clamped to ``count - 1``, and ``degree + 1`` when ``count * degree`` is odd."""
    if count <= 1:
        return 0
    used = min(degree, count - 1)
    if (count * used) % 2:
        used += 1
    return used


def random_regular(members: Iterable[str], degree: int, seed: int = 0) -> dict[str, tuple[str, ...]]:
    """A connected random regular graph of degree :func:`regular_degree` (module docstring).

    Deterministic from the sorted member list and ``seed``: every node that knows the
    same members builds the same graph.
    """
    names = _sorted_members(members)
    n = len(names)
    if degree < 2 and n > 2:
        raise StrategyError(f"a regular gossip graph needs degree >= 2 (connected), got {degree}")
    d = regular_degree(n, degree)
    if d >= n - 1:
        return complete(names)
    rng = random.Random(f"{seed}|{len(names)}|" + "\x00".join(names))
    order = list(range(n))
    rng.shuffle(order)
    edges: set[tuple[int, int]] = set()

    def link(a: int, b: int) -> None:
        edges.add((min(a, b), max(a, b)))

    for position in range(n):
        for offset in range(1, d // 2 + 1):
            link(order[position], order[(position + offset) % n])
        if d % 2:  # then n is even: the antipode is a distinct node
            link(order[position], order[(position + n // 2) % n])
    # Degree-preserving double edge swaps: (a-b, c-e) -> (a-c, b-e) or (a-e, b-c).
    for _ in range(10 * len(edges)):
        (a, b), (c, e) = rng.sample(sorted(edges), 2)
        if rng.random() < 0.5:
            c, e = e, c
        new = {(min(a, c), max(a, c)), (min(b, e), max(b, e))}
        if len({a, b, c, e}) < 4 or new & edges:
            continue
        candidate = (edges - {(a, b), (min(c, e), max(c, e))}) | new
        if is_connected(_from_edges(names, candidate)):
            edges = candidate
    return _from_edges(names, edges)


def is_connected(neighbours: Mapping[str, Sequence[str]]) -> bool:
    """True if every member reaches every other (an empty or one-node graph is connected)."""
    if not neighbours:
        return True
    start = next(iter(neighbours))
    seen = {start}
    frontier = [start]
    while frontier:
        for nxt in neighbours[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return len(seen) == len(neighbours)


def metropolis_weights(neighbours: Mapping[str, Sequence[str]]) -> dict[str, dict[str, float]]:
    """Metropolis-Hastings weights of an undirected graph: ``W[i][j]`` for ``j`` in
    ``neighbours[i]`` and ``W[i][i]``; every other entry is zero (absent).

    Raises ``StrategyError`` if the adjacency is not symmetric or has a self-loop.
    """
    for node, adjacent in neighbours.items():
        for other in adjacent:
            if other == node or node not in neighbours.get(other, ()):
                raise StrategyError(f"not an undirected simple graph: {node!r} - {other!r}")
    degree = {node: len(adjacent) for node, adjacent in neighbours.items()}
    weights: dict[str, dict[str, float]] = {}
    for node in sorted(neighbours):
        row = {other: 1.0 / (1 + max(degree[node], degree[other])) for other in sorted(neighbours[node])}
        # Summed in sorted order: both ends of a link compute the same float.
        row[node] = 1.0 - math.fsum(row.values())
        weights[node] = row
    return weights


def build_graph(
    kind: str, members: Iterable[str], *, degree: int = 3, seed: int = 0
) -> Graph:
    """The ``kind`` graph (``ring``, ``torus``, ``regular``, ``complete``) over ``members``."""
    names = _sorted_members(members)
    if kind == "ring":
        adjacency = ring(names)
    elif kind == "torus":
        adjacency = torus(names)
    elif kind == "regular":
        adjacency = random_regular(names, degree, seed)
    elif kind == "complete":
        adjacency = complete(names)
    else:
        raise StrategyError(f"unknown topology {kind!r}; one of {', '.join(TOPOLOGIES)}")
    return Graph(kind, names, adjacency, metropolis_weights(adjacency))
