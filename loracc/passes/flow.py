"""The source side of a minimum s-t cut, for remat: Dinic's maximum flow over integer capacities.

remat solves one cut per price it tries (a byte budget tries ~16 per region) on graphs of a few
thousand vertices, at every compile, warm starts included. networkx solves the same cut through
dictionaries of edge attributes and a residual network it builds per call; this module keeps the
residual capacities in flat lists. Measurement: docs/decisions/041-remat-cut-in-flat-lists.md.
"""
from __future__ import annotations

from collections import deque


class Unbounded(ValueError):
    """A path of infinite capacities joins the source to the sink: no finite cut separates them."""


def source_side(n_vertices: int, edges: list[tuple[int, int, int | None]], source: int, sink: int) -> set[int]:
    """The vertices that cannot reach ``sink`` in the residual network of a maximum flow from
    ``source`` to ``sink``, over vertices ``0 .. n_vertices - 1``: the source side of the minimum cut
    closest to the sink, the same for every maximum flow (what networkx's ``minimum_cut`` returns as
    its first partition).

    ``edges``: ``(tail, head, capacity)``, the capacity a non-negative integer or ``None`` (infinite);
    parallel edges add up. Raises ``Unbounded`` if a path of infinite edges joins the source to the sink."""
    infinite = 1 + sum(c for _, _, c in edges if c is not None)  # more than any finite cut carries
    heads: list[int] = []
    capacity: list[int] = []
    out: list[list[int]] = [[] for _ in range(n_vertices)]
    for tail, head, cap in edges:
        # Edge e and its reverse e ^ 1, which starts with no residual capacity.
        out[tail].append(len(heads))
        heads.append(head)
        capacity.append(infinite if cap is None else cap)
        out[head].append(len(heads))
        heads.append(tail)
        capacity.append(0)
    flow = 0
    while True:
        level = _levels(out, heads, capacity, source, n_vertices)
        if level[sink] < 0:
            break
        flow += _blocking_flow(out, heads, capacity, level, source, sink)
        if flow >= infinite:
            raise Unbounded("a path of infinite capacities joins the source to the sink")
    # Backwards from the sink: u reaches v's side through the residual edge e ^ 1 (u -> v).
    reaches = [False] * n_vertices
    reaches[sink] = True
    queue = deque([sink])
    while queue:
        v = queue.popleft()
        for e in out[v]:
            u = heads[e]
            if capacity[e ^ 1] > 0 and not reaches[u]:
                reaches[u] = True
                queue.append(u)
    return {v for v in range(n_vertices) if not reaches[v]}


def _levels(out, heads, capacity, source: int, n_vertices: int) -> list[int]:
    """Each vertex's distance from ``source`` over edges with residual capacity (-1: unreached)."""
    level = [-1] * n_vertices
    level[source] = 0
    queue = deque([source])
    while queue:
        u = queue.popleft()
        for e in out[u]:
            v = heads[e]
            if capacity[e] > 0 and level[v] < 0:
                level[v] = level[u] + 1
                queue.append(v)
    return level


def _blocking_flow(out, heads, capacity, level, source: int, sink: int) -> int:
    """Push flow along shortest paths (edges one level up) until none is left; the flow pushed.
    Depth-first from the source, each vertex's next edge to try kept between paths; a vertex with
    no way on is taken out of the level graph."""
    position = [0] * len(level)
    total = 0
    path: list[int] = []  # edges from the source to ``u``
    u = source
    while True:
        if u == sink:
            pushed = min(capacity[e] for e in path)
            total += pushed
            first_full = None
            for i, e in enumerate(path):
                capacity[e] -= pushed
                capacity[e ^ 1] += pushed
                if first_full is None and capacity[e] == 0:
                    first_full = i
            del path[first_full:]  # go on from the tail of the first edge the path filled
            u = heads[path[-1]] if path else source
            continue
        edges = out[u]
        i = position[u]
        while i < len(edges):
            e = edges[i]
            if capacity[e] > 0 and level[heads[e]] == level[u] + 1:
                break
            i += 1
        position[u] = i
        if i < len(edges):
            path.append(edges[i])
            u = heads[edges[i]]
            continue
        if u == source:
            return total
        level[u] = -1  # a dead end: no path to the sink passes here any more
        path.pop()
        u = heads[path[-1]] if path else source
