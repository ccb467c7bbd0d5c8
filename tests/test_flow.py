"""passes/flow.py: the source side of a minimum cut, against networkx on random graphs."""
import random

import networkx as nx
import pytest

from loracc.passes.flow import Unbounded, source_side


def networkx_side(n_vertices, edges, source, sink):
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n_vertices))
    for tail, head, capacity in edges:
        if graph.has_edge(tail, head):  # networkx keeps one edge a pair: parallel capacities add up
            old = graph[tail][head].get("capacity")
            capacity = None if old is None or capacity is None else old + capacity
        graph.add_edge(tail, head, **({} if capacity is None else {"capacity": capacity}))
    value, (side, _) = nx.minimum_cut(graph, source, sink)
    return value, side


def cut_value(edges, side):
    return sum(c for tail, head, c in edges if tail in side and head not in side)


def random_graph(rng, n_vertices, n_edges, infinite_share, big):
    edges = []
    for _ in range(n_edges):
        tail, head = rng.sample(range(n_vertices), 2)
        capacity = None if rng.random() < infinite_share else rng.randint(0, 2**70 if big else 9)
        edges.append((tail, head, capacity))
    return edges


@pytest.mark.parametrize("seed", range(40))
def test_source_side_is_networkx_s(seed):
    """The source side closest to the source, and the cut's value, on random graphs with parallel and
    zero-capacity edges, infinite edges and capacities beyond 64 bits."""
    rng = random.Random(seed)
    n_vertices = rng.randint(3, 60)
    edges = random_graph(rng, n_vertices, rng.randint(2, 5 * n_vertices), 0.2, big=seed % 2 == 1)
    source, sink = 0, n_vertices - 1
    try:
        value, expected = networkx_side(n_vertices, edges, source, sink)
    except nx.NetworkXUnbounded:
        with pytest.raises(Unbounded):
            source_side(n_vertices, edges, source, sink)
        return
    side = source_side(n_vertices, edges, source, sink)
    assert side == expected
    assert source in side and sink not in side and cut_value(edges, side) == value


def test_remat_shaped_graph_cuts_the_cheapest_edges():
    """A chain source → a → b → sink with a cheap save at b and a dear one at a, and a layered
    graph whose answer is known by hand."""
    edges = [(0, 2, None), (2, 3, 10), (3, 4, None), (4, 5, 3), (5, 1, None)]
    assert source_side(6, edges, 0, 1) == {0, 2, 3, 4}
    # Two disjoint routes, each cut at its narrowest edge.
    edges = [(0, 2, 5), (2, 1, 7), (0, 3, 9), (3, 1, 2)]
    assert source_side(4, edges, 0, 1) == {0, 3}


def test_an_infinite_path_is_unbounded():
    edges = [(0, 2, None), (2, 3, None), (3, 1, None), (0, 1, 4)]
    with pytest.raises(Unbounded):
        source_side(4, edges, 0, 1)


def test_a_sink_the_source_cannot_reach():
    edges = [(0, 2, 4), (3, 1, 4)]
    assert source_side(4, edges, 0, 1) == {0, 2}
