"""Every stage of a region's graph as readable text, Graphviz DOT and JSON (``loracc dump``).

One line a node, in execution order::

    add_1: float32[2, 4, 32, 16] = aten.add(mul_2, mul_3)    # activation, forward, model.layers.1.self_attn, 16.0 KiB, saved

with the node's role, phase, source module, bytes and its ``saved``/``recomputed`` marks.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.fx as fx

from ..ir.graph import describe_value, info, node_bytes


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}.{target._opname}"
        return name if target._overloadname in ("default", "Tensor") else f"{name}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    return repr(a)


def marks(node: fx.Node) -> list[str]:
    meta = info(node)
    return [m for m in ("saved", "recomputed") if meta.get(m)]


def node_line(node: fx.Node) -> str:
    meta = info(node)
    value = describe_value(node.meta.get("val"))
    notes = [meta.get("role"), meta.get("phase"), meta.get("module") or meta.get("name")]
    size = node_bytes(node)
    notes += [format_bytes(size) if size else None] + marks(node)
    if meta.get("fused"):  # a fusion group: the ops it replaced, in order
        notes.append("fuses " + " ".join(getattr(node.target, "ops", [])))
    comment = ", ".join(str(n) for n in notes if n)
    if node.op == "placeholder":
        text = f"input {node.name}: {value}"
    elif node.op == "output":
        text = "return " + _arg(node.args[0])
    else:
        args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
        text = f"{node.name}: {value} = {_target_name(node)}({', '.join(args)})"
    return f"{text:<90}  # {comment}" if comment and node.op != "output" else text


def graph_text(gm: fx.GraphModule, title: str) -> str:
    nodes = list(gm.graph.nodes)
    computed = [n for n in nodes if n.op == "call_function"]
    header = f"# {title}: {len(computed)} ops, {len(nodes) - len(computed) - 1} inputs"
    return "\n".join([header] + ["    " + node_line(n) for n in nodes])


def graph_json(gm: fx.GraphModule) -> list[dict]:
    out = []
    for node in gm.graph.nodes:
        meta = info(node)
        out.append({
            "name": node.name,
            "op": node.op,
            "target": _target_name(node) if node.op == "call_function" else node.op,
            "inputs": [a.name for a in node.all_input_nodes],
            "value": describe_value(node.meta.get("val")),
            "bytes": node_bytes(node),
            "role": meta.get("role"),
            "phase": meta.get("phase"),
            "module": meta.get("module"),
            "marks": marks(node),
        })
    return out


_COLORS = {"frozen_weight": "lightgrey", "lora_A": "gold", "lora_B": "gold", "tangent": "lightblue",
           "gradient": "palegreen", "input": "white"}


def graph_dot(gm: fx.GraphModule, title: str) -> str:
    lines = [f'digraph "{title}" {{', "  rankdir=TB; node [shape=box, fontname=monospace, fontsize=10];"]
    for node in gm.graph.nodes:
        meta = info(node)
        label = node.name if node.op != "call_function" else f"{node.name}\\n{_target_name(node)}"
        label += f"\\n{describe_value(node.meta.get('val'))}"
        if marks(node):
            label += "\\n" + ",".join(marks(node))
        color = _COLORS.get(meta.get("role"), "lightpink" if meta.get("phase") == "backward" else "white")
        style = ", penwidth=3" if meta.get("saved") else ""
        lines.append(f'  "{node.name}" [label="{label}", style=filled, fillcolor={color}{style}];')
        for a in node.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines)


def dump_program(program, title: str, out_dir: Path | None = None) -> str:
    """Text of every stage of ``program`` with its pass reports; DOT and JSON files in ``out_dir``."""
    parts = []
    for stage, gm in program.stages.items():
        parts.append(graph_text(gm, f"{title} — after {stage}"))
        report = _plain(program.reports.get(stage))
        if report:
            parts.append(f"# {stage} report: {json.dumps(report, default=str)}")
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{stage}.dot").write_text(graph_dot(gm, f"{title} {stage}"))
            (out_dir / f"{stage}.json").write_text(json.dumps(
                {"region": title, "stage": stage, "report": report, "nodes": graph_json(gm)}, indent=1, default=str))
    extra = {k: _plain(v) for k, v in program.reports.items() if k not in program.stages}
    for name, report in extra.items():
        parts.append(f"# {name} report: {json.dumps(report, default=str)}")
    return "\n\n".join(parts)


def _plain(report):
    """A pass's report as JSON-ready data: a typed report's ``asdict()``, a dict as it is."""
    return report.asdict() if hasattr(report, "asdict") else report


def live_bytes(gm: fx.GraphModule, held: int = 0) -> list[int]:
    """``memory_plan.live_bytes`` of ``gm``'s nodes, on top of ``held``."""
    from ..ir.graph import output_values
    from ..passes.memory_plan import live_bytes as node_live_bytes

    return [b + held for b in node_live_bytes(list(gm.graph.nodes), output_values(gm))]


def memory_timeline(program, repeats: int = 1) -> dict[str, list[int]]:
    """A region's memory over a step that runs it ``repeats`` times (a block: once per layer), before
    and after rematerialization: the forwards one after another, each adding what it saves for the
    backward, then the backwards in reverse, each freeing its layer's saved values.

    ``before``: the joint graph as traced (every forward value the backward reads is kept).
    ``after``: the compiled forward and backward graphs.
    """
    joint = program.stages["joint"]
    nodes = list(joint.graph.nodes)
    split = next((i for i, n in enumerate(nodes) if n.op == "call_function" and info(n).get("phase") == "backward"),
                 len(nodes))
    kept = sum(node_bytes(n) for n in nodes[:split]
               if n.op == "call_function" and any(info(u).get("phase") == "backward" for u in n.users))
    joint_curve = live_bytes(joint)
    saved = program.reports["memory_plan"].forward.saved_bytes
    forward, backward = live_bytes(program.stages["forward"]), live_bytes(program.stages["backward"])
    return {
        "before": _step(joint_curve[:split], [b - kept for b in joint_curve[split:]], kept, repeats),
        "after": _step(forward, backward, saved, repeats),
    }


def _step(forward: list[int], backward: list[int], saved: int, repeats: int) -> list[int]:
    curve = []
    for layer in range(repeats):
        curve += [b + layer * saved for b in forward]
    for layer in reversed(range(repeats)):
        curve += [b + (layer + 1) * saved for b in backward]
    return curve


def timeline_text(timeline: dict[str, list[int]], width: int = 60, height: int = 12) -> str:
    """Both curves of ``memory_timeline`` as a text chart, time across, bytes up."""
    top = max(max(c) for c in timeline.values()) or 1
    lines = []
    for name, curve in timeline.items():
        columns = [max(curve[i * len(curve) // width:(i + 1) * len(curve) // width] or [0]) for i in range(width)]
        lines.append(f"{name}: peak {format_bytes(max(curve))} over {len(curve)} ops")
        for row in range(height, 0, -1):
            level = top * (row - 0.5) / height
            lines.append("  |" + "".join("#" if c >= level else " " for c in columns))
        lines.append("  +" + "-" * width)
    return "\n".join(lines)
