"""A fused group of pointwise ops and row reductions (``ir.fused_rows.FusedRows``, made by ``passes.fusion``) as one Triton kernel.

The kernel (``templates/fused_rows.py.jinja``) gives each program ``BLOCK_R`` rows of the group's
frame and whole rows of ``BLOCK_D`` columns, enough for every value the group stores or reduces. Every value of the group is an expression of the
column index: a value at column ``c`` of ``x`` (``x[..., c]``) is emitted once per column offset
it is read at, so data moves along the last dim (slices, ``cat``, ``slice_backward``,
``loracc::rotate_pairs``: rotary embeddings) are index shifts of loads, never copies. A ``cat`` that
only an output reads is stored piece by piece, each at its columns (``split_cats``): every lane
computes each piece once, where an expression over the whole ``cat`` would compute every piece in
every lane and keep one (a GEGLU's gradient, the ``cat`` of its value's and its gate's, computes the
GELU and its derivative once each). A row reduction is a sum or a NaN-propagating
max over the program's columns; a value of width 1 is one number per row. Inputs are read through
their strides (broadcast dims read stride 0), outputs are written with the strides the graph
recorded for them; offsets are int64 where one can reach 2^31. Values in 16-bit dtypes are computed
in fp32 and rounded to their dtype after each op, as the eager ops do (a 0-dim fp32 operand of a
16-bit op is rounded to it first, as eager converts it).

A group traced with symbolic batch and sequence sizes (``capture.trace.dynamic_dims``) gets a kernel
generic in them: its leading dims and row count are run-time arguments (``R0``, ``R1``, …,
``n_rows``), read at each call from the inputs' sizes; its last dims stay constants. Triton does not
specialize on those sizes, nor on a stride that varies with them unless it is always a multiple of 16
(``specialization_varies``), so no size compiles another kernel once one has run.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from .. import _compat
from ..ir.fused_rows import PASS_THROUGH, FusedRows
from ..ir.graph import output_node, value_bytes
from ..ir.ops import ROTATE_PAIRS
from . import cache
from .render import render

aten = torch.ops.aten
TL_DTYPES = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}
ROUNDED = (torch.bfloat16, torch.float16)
SQRT_2_OVER_PI = 0.7978845608028654
ELEMENTS_PER_PROGRAM = 4096
ROW_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default)  # over a row's columns, in one program


def _lit(x) -> str:
    if isinstance(x, str):
        return x  # already an expression or a literal
    if isinstance(x, bool):
        return "1.0" if x else "0.0"
    if isinstance(x, (int, float)):
        x = float(x)
        return repr(x) if math.isfinite(x) else f'float("{x}")'
    raise NotImplementedError(f"scalar argument {x!r}")


def _pow(a: str, e) -> str:
    e = float(e)
    if e.is_integer():
        n = int(abs(e))
        if n == 0:
            return f"({a} * 0.0 + 1.0)"
        if n <= 8:
            product = " * ".join([a] * n)
        else:  # |a|^n through exp/log, the sign restored for odd n (eager: exact integer power)
            product = f"tl.exp({float(n)} * tl.log(tl.abs({a})))"
            if n % 2:
                product = f"tl.where({a} < 0.0, -{product}, {product})"
        return product if e > 0 else f"1.0 / ({product})"
    if e == 0.5:
        return f"tl.sqrt_rn({a})"
    if e == -0.5:
        return f"(1.0 / tl.sqrt_rn({a}))"
    return f"tl.exp({_lit(e)} * tl.log({a}))"


def _gelu(a: str, approximate: str) -> str:
    if approximate == "tanh":
        inner = f"{SQRT_2_OVER_PI} * ({a} + 0.044715 * {a} * {a} * {a})"
        return f"0.5 * {a} * (1.0 + (2.0 * tl.sigmoid(2.0 * ({inner})) - 1.0))"
    return f"0.5 * {a} * (1.0 + erf32({a} * 0.7071067811865476))"


# op → (args, kwargs) → expression; tensor arguments come as variable names, scalars as literals.
POINTWISE = {
    aten.add.Tensor: lambda a, b, alpha=1.0: f"{a} + {b}" if float(alpha) == 1 else f"{a} + {_lit(alpha)} * {b}",
    aten.sub.Tensor: lambda a, b, alpha=1.0: f"{a} - {b}" if float(alpha) == 1 else f"{a} - {_lit(alpha)} * {b}",
    aten.rsub.Scalar: lambda a, b, alpha=1.0: f"{b} - {_lit(alpha)} * {a}",
    aten.mul.Tensor: lambda a, b: f"{a} * {b}",
    aten.div.Tensor: lambda a, b: f"{a} / {b}",
    aten.neg.default: lambda a: f"-{a}",
    aten.reciprocal.default: lambda a: f"1.0 / {a}",
    aten.rsqrt.default: lambda a: f"tl.rsqrt({a})",
    aten.sqrt.default: lambda a: f"tl.sqrt_rn({a})",
    aten.exp.default: lambda a: f"tl.exp({a})",
    aten.log.default: lambda a: f"tl.log({a})",
    aten.abs.default: lambda a: f"tl.abs({a})",
    aten.sigmoid.default: lambda a: f"tl.sigmoid({a})",
    aten.tanh.default: lambda a: f"tl.where(tl.abs({a}) < 1e-3, {a} - {a} * {a} * {a} / 3.0, 2.0 * tl.sigmoid(2.0 * {a}) - 1.0)",
    aten.silu.default: lambda a: f"{a} * tl.sigmoid({a})",
    aten.relu.default: lambda a: f"tl.where(({a} > 0.0) | ({a} != {a}), {a}, 0.0)",
    aten.gelu.default: lambda a, approximate="none": _gelu(a, approximate),
    aten.pow.Tensor_Scalar: lambda a, e: _pow(a, e),
    aten.maximum.default: lambda a, b: f"tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    aten.minimum.default: lambda a, b: f"tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    aten.where.self: lambda c, a, b: f"tl.where({c}, {a}, {b})",
    aten.sigmoid_backward.default: lambda g, y: f"{g} * {y} * (1.0 - {y})",
    aten.tanh_backward.default: lambda g, y: f"{g} * (1.0 - {y} * {y})",
    aten.threshold_backward.default: lambda g, x, t: f"tl.where({x} <= {t}, 0.0, {g})",
}
for _op, _base in ((aten.add.Scalar, aten.add.Tensor), (aten.sub.Scalar, aten.sub.Tensor),
                   (aten.mul.Scalar, aten.mul.Tensor), (aten.div.Scalar, aten.div.Tensor)):
    POINTWISE[_op] = POINTWISE[_base]
IDENTITY = (aten._to_copy.default, *PASS_THROUGH)  # values unchanged (a cast rounds by its dtype)


def _clamp(index: int, width: int) -> int:
    """A slice bound as Python and ATen read it: negative from the end, clamped to [0, width]."""
    index = index + width if index < 0 else index
    return max(0, min(index, width))


def _width(val) -> int:
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.ndim else 1


def split_cats(gm: fx.GraphModule) -> dict[fx.Node, list[tuple[int, fx.Node]]]:
    """The ``cat`` nodes of a group's graph (``FusedRows.graph``) that only its output reads, each with its pieces
    (``(first column, piece)``, pieces without columns left out): the kernel stores each piece at its
    columns instead of computing the ``cat`` (see the module's docstring)."""
    out = output_node(gm)
    split = {}
    for node in gm.graph.find_nodes(op="call_function", target=aten.cat.default):
        if set(node.users) == {out}:
            pieces, start = [], 0
            for t in node.args[0]:
                width = t.meta["val"].shape[-1]
                if width and t.meta["val"].numel():
                    pieces.append((start, t))
                start += width
            split[node] = pieces
    return split


class _Emitter:
    """Writes the kernel body: loads, one line per value at each column offset it is read at, stores."""

    def __init__(self, group: FusedRows, block_d: int, split: dict | None = None):
        self.group = group
        self.rows = group.rows
        self.block_d = block_d
        self.split = split or {}  # ``split_cats``: stored piece by piece
        self.inputs = {n: i for i, n in enumerate(group.graph.graph.find_nodes(op="placeholder"))}
        self.names = local_names(group.graph.graph)
        self.lines: list[str] = []
        self.memo: dict[tuple, str] = {}
        self.strides: list[str] = []  # run-time stride arguments, in signature order
        self.stride_of: list[tuple[str, int, int]] = []  # (operand kind, operand index, dim)
        self.row_offset: dict[str, str] = {}
        self.offsets_emitted: set[int] = set()
        self.max_with_nan = False  # whether the body reduces with the template's max_with_nan

    # --- operands -----------------------------------------------------------------------------
    def _stride(self, pointer: str, kind: str, index: int, dim: int) -> str:
        name = f"{pointer}_s{dim}"
        if name not in self.strides:
            self.strides.append(name)
            self.stride_of.append((kind, index, dim))
        return name

    def _row_offset(self, pointer: str, kind: str, index: int, val: torch.Tensor) -> str:
        """``pointer``'s offset of the program's rows: the frame's row indices times its strides."""
        if pointer in self.row_offset:
            return self.row_offset[pointer]
        lead = val.shape[:-1]  # right-aligned with the frame's rows
        terms = []
        for d, size in enumerate(lead):
            if size == 1:
                continue  # broadcast along this dim
            frame_dim = len(self.rows) - len(lead) + d
            terms.append(f"i{frame_dim} * {self._stride(pointer, kind, index, d)}")
        name = f"{pointer}_row"
        self.lines.append(f"{name} = {' + '.join(terms) if terms else '0'}")
        self.row_offset[pointer] = name
        return name

    def column(self, shift: int) -> str:
        """The variable for column index ``cols + shift``."""
        if shift == 0:
            return "cols"
        name = f"c_{'p' if shift > 0 else 'm'}{abs(shift)}"
        if shift not in self.offsets_emitted:
            self.offsets_emitted.add(shift)
            self.lines.append(f"{name} = cols {'+' if shift > 0 else '-'} {abs(shift)}")
        return name

    def load(self, node: fx.Node, shift: int | None) -> str:
        index = self.inputs[node]
        val = node.meta["val"]
        pointer = f"in{index}"
        if val.ndim == 0 or all(size == 1 for size in val.shape):  # one value for every row: no row mask
            offset, mask = "0", None
        else:
            row = self._row_offset(pointer, "in", index, val)
            if _width(val) == 1:
                offset, mask = row, "row_ok"
            else:
                col = self.column(shift)
                bounds = f"({col} < {val.shape[-1]})" if shift == 0 else f"({col} >= 0) & ({col} < {val.shape[-1]})"
                offset = f"{row} + {col} * {self._stride(pointer, 'in', index, val.ndim - 1)}"
                mask = f"row_ok & {bounds}"
        other = "0" if val.dtype == torch.bool else "0.0"
        load = f"tl.load({pointer} + {offset}" + (f", mask={mask}, other={other})" if mask else ")")
        return load if val.dtype == torch.bool else f"{load}.to(tl.float32)"

    # --- values -------------------------------------------------------------------------------
    def value(self, node, shift: int | None) -> str:
        """The variable holding ``node[..., cols + shift]`` (or its one value per row: width 1)."""
        if not isinstance(node, fx.Node):
            return _lit(node)
        if _width(node.meta["val"]) == 1:
            shift = None
        elif shift is None:
            raise AssertionError(f"{node.name} is read as one value per row but has {_width(node.meta['val'])} columns")
        key = (node, shift)
        if key in self.memo:
            return self.memo[key]
        if node.op == "placeholder":
            expression = self.load(node, shift)
        else:
            expression = self.expression(node, shift)
            dtype = node.meta["val"].dtype
            if dtype in ROUNDED and node.target not in PASS_THROUGH:
                expression = f"({expression}).to({TL_DTYPES[dtype]}).to(tl.float32)"
        name = self.names[node] + ("" if not shift else f"_{'p' if shift > 0 else 'm'}{abs(shift)}")
        self.lines.append(f"{name} = {expression}")
        self.memo[key] = name
        return name

    def operand(self, node: fx.Node, shift: int | None, dtype: torch.dtype) -> str:
        """``node``'s value as an op computing in ``dtype`` reads it. Eager converts every operand to
        the op's dtype first; that rounds only a 0-dim fp32 tensor read by a 16-bit op (a 0-dim
        tensor does not promote the op's dtype), once per kernel."""
        name = self.value(node, shift)
        if dtype not in ROUNDED or node.meta["val"].dtype in (dtype, torch.bool):
            return name
        key = (node, shift, dtype)
        if key not in self.memo:
            rounded = f"{name}_{str(dtype).replace('torch.', '')}"
            self.lines.append(f"{rounded} = {name}.to({TL_DTYPES[dtype]}).to(tl.float32)")
            self.memo[key] = rounded
        return self.memo[key]

    def expression(self, node: fx.Node, shift: int | None) -> str:
        target, args = node.target, node.args
        dtype = node.meta["val"].dtype
        if target in POINTWISE:
            tensors = [self.operand(a, shift, dtype) if isinstance(a, fx.Node) else a for a in args]
            strings = [t if isinstance(t, str) else _lit(t) for t in tensors]
            kwargs = {k: v for k, v in node.kwargs.items()}
            return POINTWISE[target](*strings, **kwargs)
        if target in IDENTITY:
            return self.value(args[0], shift)
        if target == aten.silu_backward.default:
            g, x = self.operand(args[0], shift, dtype), self.operand(args[1], shift, dtype)
            s = f"tl.sigmoid({x})"
            return f"{g} * ({s} * (1.0 + {x} * (1.0 - {s})))"
        if target == aten.gelu_backward.default:
            g, x = self.operand(args[0], shift, dtype), self.operand(args[1], shift, dtype)
            if node.kwargs.get("approximate", "none") == "tanh":
                inner = f"{SQRT_2_OVER_PI} * ({x} + 0.044715 * {x} * {x} * {x})"
                t = f"(2.0 * tl.sigmoid(2.0 * ({inner})) - 1.0)"
                return f"{g} * (0.5 * (1.0 + {t}) + 0.5 * {x} * (1.0 - {t} * {t}) * {SQRT_2_OVER_PI} * (1.0 + 0.134145 * {x} * {x}))"
            return f"{g} * (0.5 * (1.0 + erf32({x} * 0.7071067811865476)) + {x} * tl.exp(-0.5 * {x} * {x}) * 0.3989422804014327)"
        if target in ROW_REDUCTIONS:
            source = args[0]
            width = _width(source.meta["val"])
            x = self.value(source, 0)
            if width == 1:
                return x
            if target == aten.amax.default:
                # tl.max drops NaN; torch.amax returns NaN for a row holding one: reduce with the
                # NaN-propagating maximum the template defines.
                masked = f"tl.where(cols < {width}, {x}, float('-inf'))" if width < self.block_d else x
                self.max_with_nan = True
                return f"tl.reduce({masked}, 1, max_with_nan)[:, None]"
            masked = f"tl.where(cols < {width}, {x}, 0.0)" if width < self.block_d else x
            total = f"tl.sum({masked}, axis=1)[:, None]"
            return total if target == aten.sum.dim_IntList else f"{total} / {float(width)}"
        if target == aten.slice.Tensor:
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            return self.value(args[0], shift + _clamp(start, _width(args[0].meta["val"])))
        if target == aten.slice_backward.default:
            grad, _, _, start, end, _ = args
            width = _width(node.meta["val"])
            start, end = _clamp(start, width), _clamp(end, width)
            col = self.column(shift)
            inside = self.value(grad, shift - start)
            return f"tl.where(({col} >= {start}) & ({col} < {end}), {inside}, 0.0)"
        if target == ROTATE_PAIRS:  # column 2i takes -x[2i+1], column 2i+1 takes x[2i]
            col = self.column(shift)
            return f"tl.where({col} % 2 == 0, -{self.value(args[0], shift + 1)}, {self.value(args[0], shift - 1)})"
        if target == aten.cat.default:
            col, pieces, start = self.column(shift), [], 0
            for t in args[0]:
                if _width(t.meta["val"]) and t.meta["val"].numel():
                    pieces.append((start, self.value(t, shift - start)))
                start += t.meta["val"].shape[-1]
            expression = pieces[-1][1]
            for (_, piece), (bound, _) in reversed(list(zip(pieces[:-1], pieces[1:]))):
                expression = f"tl.where({col} < {bound}, {piece}, {expression})"
            return expression
        raise NotImplementedError(f"fused_rows: no Triton expression for {target}")

    def store(self, index: int, node: fx.Node) -> None:
        val = node.meta["val"]
        pointer = f"out{index}"
        row = self._row_offset(pointer, "out", index, val)
        store_dtype = TL_DTYPES[val.dtype]
        if _width(val) == 1:
            self.lines.append(f"tl.store({pointer} + {row}, {self.value(node, None)}.to({store_dtype}), mask=row_ok)")
        else:
            col_stride = self._stride(pointer, "out", index, val.ndim - 1)
            for start, piece in self.split.get(node, [(0, node)]):
                width = _width(piece.meta["val"])
                at = "cols" if start == 0 else f"(cols + {start})"
                mask = "row_ok" + (f" & (cols < {width})" if width < self.block_d else "")
                self.lines.append(f"tl.store({pointer} + {row} + {at} * {col_stride}, {self.value(piece, 0)}.to({store_dtype}), mask={mask})")


def local_names(graph: fx.Graph) -> dict[fx.Node, str]:
    """The kernel's name for each value of a group's ``graph``: ``v_in0``, ``v_in1``, ... for its
    inputs and ``v0``, ``v1``, ... for the values it computes, in graph order. The names do not
    depend on the names in the graph the group was cut from, so groups of equal ops (the layers of
    one program, a block's equal norms) render the same source and compile one kernel."""
    names = {node: f"v_in{i}" for i, node in enumerate(graph.find_nodes(op="placeholder"))}
    computed = [node for node in graph.nodes if node.op == "call_function"]
    return names | {node: f"v{i}" for i, node in enumerate(computed)}


def _describe_arg(a, names: dict) -> str:
    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_describe_arg(x, names) for x in a) + "]"
    return repr(a)


def _describe(node: fx.Node, names: dict) -> str:
    """One line of the kernel's header: the op as the graph has it, its values by their kernel names."""
    args = ", ".join(_describe_arg(a, names) for a in node.args)
    kwargs = "".join(f", {k}={v}" for k, v in node.kwargs.items())
    val = node.meta["val"]
    dtype = str(val.dtype).replace("torch.", "")
    return f"{names[node]}: {dtype}{list(val.shape)} = {node.target}({args}{kwargs})"


def _span(val) -> int:
    """Elements a tensor's offsets reach (its strides included), 0 for anything else."""
    return value_bytes(val) // val.element_size() if isinstance(val, torch.Tensor) else 0


class RowKernel:
    """The Triton kernel of one ``FusedRows`` group, called like the group (same inputs, same outputs).

    Offsets (index × stride) are int32 unless an operand spans 2^31 elements or more (a transposed
    input with a large last-dim stride, say): then the kernel computes its row and column indices,
    and so every offset, in int64. ``wide_offsets`` forces one or the other; by default it follows
    the strides the graph recorded, and a call with operands whose strides reach further runs the
    int64 variant.
    """

    def __init__(self, group: FusedRows, wide_offsets: bool | None = None):
        self.group = group
        self.__name__ = group.__name__
        rows = group.rows
        gm = group.graph
        nodes = list(gm.graph.nodes)
        self.symbolic = any(_compat.is_symbolic(n.meta.get("val")) for n in nodes) or any(map(_compat.is_symbolic, rows))
        self._sizes = _SymbolicSizes(group, list(output_node(gm).args[0])) if self.symbolic else None
        self.n_rows = _compat.hint(math.prod(rows))  # symbolic sizes: at the traced shapes
        # A program's columns: those of the values the group stores (a split cat's pieces) and reduces.
        split = split_cats(gm)
        stored = [piece for o in output_node(gm).args[0] for _, piece in split.get(o, [(0, o)])]
        reduced = [n.args[0] for n in nodes if n.op == "call_function" and n.target in ROW_REDUCTIONS]
        self.width = max([_width(n.meta.get("val")) for n in stored + reduced if isinstance(n, fx.Node)], default=1)
        self.block_d = 1 << (self.width - 1).bit_length()
        self.block_r = max(1, min(1 << max(self.n_rows - 1, 0).bit_length(), ELEMENTS_PER_PROGRAM // self.block_d))
        elements = self.block_r * self.block_d
        self.num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
        self.outputs = list(output_node(gm).args[0])
        self.output_vals = [o.meta["val"] for o in self.outputs]

        emitter = _Emitter(group, self.block_d, split)
        for i, out in enumerate(self.outputs):
            emitter.store(i, out)
        self.stride_of = emitter.stride_of
        self.input_vals = group.input_vals
        if wide_offsets is None:
            wide_offsets = max(map(_span, [*self.input_vals, *self.output_vals]), default=0) >= 2**31
        self.wide_offsets = wide_offsets
        # A call whose tensors have the recorded strides reaches as far as the recorded layout: only
        # tensors with other strides need their span checked (the check costs more than the launch).
        self._recorded_strides = [v.stride() if isinstance(v, torch.Tensor) else None for v in self.input_vals]
        index_lines = []
        for d, size in enumerate(rows):
            if self.symbolic:  # the frame's sizes are run-time arguments R0, R1, ...
                inner = " * ".join(f"R{e}" for e in range(d + 1, len(rows)))
                expression = f"rows // ({inner})" if inner else "rows"
                size = f"R{d}"
            else:
                inner = math.prod(rows[d + 1:])
                expression = "rows" if inner == 1 else f"rows // {inner}"
            if d > 0:
                expression = f"({expression}) % {size}"
            index_lines.append(f"i{d} = {expression}")
        # A stride that varies with the sizes and need not be a multiple of 16 (a [B, S, 1] value's
        # batch stride S, say) is not specialized on, nor are the frame's sizes: one kernel serves every size.
        traced_strides = self._strides(self.input_vals, self.output_vals)
        self.unspecialized = ([f"R{d}" for d in range(len(rows))] + ["n_rows"] if self.symbolic else []) + [
            name for name, stride in zip(emitter.strides, traced_strides) if specialization_varies(stride)]
        name = self._name(rows)
        self.name = name
        dtypes = sorted({str(v.dtype).replace("torch.", "") for v in self.output_vals})
        self.source = render(
            "fused_rows.py.jinja",
            name=name,
            computes=f"{len(group.ops)} fused ops ({', '.join(group.ops)}) over rows of {_frame(rows)}",
            shapes=[f"in{i}: {_shape(v)}" for i, v in enumerate(self.input_vals)]
            + [f"out{i}: {_shape(v)}" for i, v in enumerate(self.output_vals)],
            ops=[_describe(n, emitter.names) for n in nodes if n.op == "call_function"],
            pointers=[f"in{i}" for i in range(len(self.input_vals))] + [f"out{i}" for i in range(len(self.outputs))],
            strides=emitter.strides,
            n_rows="n_rows" if self.symbolic else self.n_rows,
            sizes=[f"R{d}" for d in range(len(rows))] + ["n_rows"] if self.symbolic else [],
            unspecialized=self.unspecialized,
            rows_shape=" × ".join(str(r) for r in rows) or "1",
            width=self.width,
            wide_offsets=wide_offsets,
            max_with_nan=emitter.max_with_nan,
            uses_erf=any("erf32(" in line for line in emitter.lines),
            index_lines=index_lines,
            body=emitter.lines,
        )
        self.dtypes = dtypes

    def _reaches_past_int32(self, inputs, out) -> bool:
        others = [t for t, s in zip(inputs, self._recorded_strides) if s is not None and t.stride() != s]
        return max(map(_span, others + list(out or [])), default=0) >= 2**31

    def _name(self, rows) -> str:
        ops = []
        for op in self.group.ops:
            op = op.split(".")[0].lstrip("_")
            if op not in ops and op not in ("to_copy", "clone"):
                ops.append(op)
        wide = "_i64" if self.wide_offsets else ""
        sym = "_dyn" if self.symbolic else ""
        return f"rows_{'_'.join(ops[:5])}{'_etc' if len(ops) > 5 else ''}_w{self.width}{wide}{sym}"

    @functools.cached_property
    def _wide(self) -> RowKernel:
        return RowKernel(self.group, wide_offsets=True)

    def kernel(self, device: torch.device):
        return _load(self.name, self.source, device)

    def __call__(self, *inputs, out: list | None = None):
        if self.symbolic:
            return self._call_symbolic(inputs, out)
        for i, (t, v) in enumerate(zip(inputs, self.input_vals)):
            if isinstance(v, torch.Tensor) and (not isinstance(t, torch.Tensor) or t.shape != v.shape):
                raise ValueError(f"{self.name}: input {i} has shape {getattr(t, 'shape', None)}, the kernel was made for {tuple(v.shape)}")
        device = inputs[0].device
        outputs = out if out is not None else [
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device) for v in self.output_vals
        ]
        if not self.wide_offsets and self._reaches_past_int32(inputs, out):
            return self._wide(*inputs, out=outputs)
        strides = self._strides(inputs, outputs)
        grid = (-(-self.n_rows // self.block_r),)
        self.kernel(device)[grid](*inputs, *outputs, *strides, BLOCK_R=self.block_r, BLOCK_D=self.block_d,
                                  num_warps=self.num_warps)
        return tuple(outputs)

    def _call_symbolic(self, inputs, out):
        frame, shapes, strides_out = self._sizes(inputs)
        n_rows = math.prod(frame)
        device = inputs[0].device
        outputs = out if out is not None else [
            torch.empty_strided(shape, stride, dtype=v.dtype, device=device)
            for shape, stride, v in zip(shapes, strides_out, self.output_vals)
        ]
        if not self.wide_offsets and not all(map(_storage_in_int32, [*inputs, *outputs])):
            return self._wide(*inputs, out=outputs)
        strides = self._strides(inputs, outputs)
        grid = (max(1, -(-n_rows // self.block_r)),)
        self.kernel(device)[grid](*inputs, *outputs, *strides, *frame, n_rows, BLOCK_R=self.block_r,
                                  BLOCK_D=self.block_d, num_warps=self.num_warps)
        return tuple(outputs)

    def _strides(self, inputs, outputs) -> list[int]:
        """The stride arguments of a launch on these inputs and outputs."""
        operands = {"in": inputs, "out": outputs}
        return [operands[kind][index].stride(dim) for kind, index, dim in self.stride_of]

    def warmup(self, device: torch.device):
        """Compile the kernel for the traced graph's values, without running it (``precompile``)."""
        from .precompile import pointer

        strides = [_compat.hint(s) for s in self._strides(self.input_vals, self.output_vals)]
        args = [pointer(v) if isinstance(v, torch.Tensor) else v for v in [*self.input_vals, *self.output_vals]]
        if self.symbolic:  # the frame's sizes at the traced shapes (not specialized on by the kernel)
            strides += [_compat.hint(r) for r in self.group.rows] + [self.n_rows]
        return self.kernel(device).warmup(*args, *strides, BLOCK_R=self.block_r, BLOCK_D=self.block_d,
                                          num_warps=self.num_warps, grid=(1,))


def specialization_varies(value) -> bool:
    """Whether Triton can specialize an integer argument traced as ``value`` differently from one call
    to the next. Triton compiles a variant for an integer equal to 1 and one for a multiple of 16: a
    constant always gets the same one, and so does an expression of the sizes (non-negative integers)
    whose every coefficient is a multiple of 16 (``64*s1``: never 1, always a multiple of 16); any
    other expression (``s1``, ``8*s1``, a division) may change, and must not be specialized on."""
    if not _compat.is_symbolic(value):
        return False
    import sympy

    expr = value.node.expr
    if not expr.free_symbols:
        return False
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str))
    except sympy.PolynomialError:
        return True
    return not all(c.is_Integer and c % 16 == 0 for c in poly.coeffs())


def _storage_in_int32(t) -> bool:
    """Whether every element offset into ``t``'s storage fits int32 (a bound on its span that costs
    one call, not a sum over its dims)."""
    return not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() < 2**31 * t.element_size()


class _SymbolicSizes:
    """For a group with symbolic sizes: a function of a call's inputs giving the frame's sizes and
    each output's shape and strides, generated as Python (sizes read from the inputs, then the
    traced expressions evaluated). ``NotImplementedError`` where a size is not an expression of the
    inputs' sizes, or a last dim is symbolic (the kernel's columns are constants)."""

    def __init__(self, group: FusedRows, outputs: list):
        from torch.utils._sympy.printers import PythonPrinter

        for node in group.graph.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.ndim and _compat.is_symbolic(val.shape[-1]):
                raise NotImplementedError(f"{node.name}'s last dim is symbolic")
        lines, bound = [], set()
        for i, val in enumerate(group.input_vals):
            for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and size.node.expr not in bound:
                    bound.add(size.node.expr)
                    lines.append(f"    {size.node.expr} = inputs[{i}].shape[{d}]")
        printer = PythonPrinter()

        def code(size) -> str:
            if not isinstance(size, torch.SymInt):
                return str(int(size))
            missing = size.node.expr.free_symbols - bound
            if missing:
                raise NotImplementedError(f"size {size.node.expr} is not read from the group's inputs")
            return f"({printer.doprint(size.node.expr)})"

        vals = [o.meta["val"] for o in outputs]
        tuple_of = lambda sizes: "(" + "".join(code(s) + ", " for s in sizes) + ")"  # noqa: E731
        lines.append(f"    return {tuple_of(group.rows)}, [{', '.join(tuple_of(v.shape) for v in vals)}], "
                     f"[{', '.join(tuple_of(v.stride()) for v in vals)}]")
        self.source = "def sizes(inputs):\n" + "\n".join(lines)
        namespace: dict = {}
        exec(compile(self.source, f"<sizes of {group.__name__}>", "exec"), namespace)
        self._fn = namespace["sizes"]

    def __call__(self, inputs):
        return self._fn(inputs)


def _frame(rows) -> str:
    return "[" + ", ".join(str(r) for r in rows) + "]"


def _shape(val) -> str:
    if not isinstance(val, torch.Tensor):
        return repr(val)
    return f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}"


@functools.cache
def _load(name: str, source: str, device: torch.device):
    return cache.load_kernel(name, source, device)


def kernel_for(group: FusedRows) -> RowKernel:
    """The Triton kernel of ``group`` (rendered now; compiled by Triton on its first launch)."""
    return RowKernel(group)
