"""Replaying a compiled graph as a CUDA graph: one launch instead of hundreds of Python-issued kernels.

``Graphed`` captures a function over a fixed set of input tensors; each call copies the call's
inputs into those it does not share with the caller, replays, and hands back the outputs (copies of
those the next replay would overwrite). ``Replayer`` runs a graph from Python at its first call and
decides, per graph, whether later calls replay (policy: docs/decisions/001-cuda-graph-policy.md):

- ``mode="on"``: capture from the second call on and replay;
- ``mode="auto"``: time Python calls (``PYTHON_TIMINGS``, the fastest counts) against replays, and
  keep graphs where a replay takes at most ``KEEP_BELOW`` of the Python time. A backward given
  ``after=`` its forward waits for the forward's decision, tries only if the forward kept its
  graphs, and decides for the pair (times added); a forward whose backward stays in Python drops
  its graphs too. Until the backward decides, the forward replays only the layer it measured.

Two kinds of graph:

- **Per layer** (a normal training call): each layer has its own forward graph, captured over its
  own weights (read in place, never copied), and its own backward graph, captured over what that
  forward graph saved. The forward *lends* the tensors it saves (``Lease``): the backward reads
  them where they are. Only the activations flowing between layers are copied in and out.
- **Copy** (one graph shared by every layer, every input copied in and every output out): for calls
  whose saved tensors go through saved-tensor hooks (gradient checkpointing), and for a backward
  whose forward was not replayed per layer.

Invariants:

- Every graph of a model captures into one ``SharedPool``: the graphs never run at once, and a
  graph's temporaries are dead when it returns, so their workspaces overlap.
- A lent output must survive other replays until its backward read it. A graph's outputs can only
  have been placed where graphs captured *before* it keep their temporaries, so a graph replays only
  while every lent output comes from a graph captured before it (``SharedPool.may_replay``);
  otherwise it is captured again or, past ``max_captures``, runs from Python. A training loop
  settles into forwards 0..n then backwards n..0, in which no replay waits.
- A lease is released by its backward (or when autograd drops the call's context); a second
  backward through the same call (``retain_graph=True``) checks ``Lease.intact`` and otherwise raises.
- An output that is not lent (hidden states, an input's gradient) is written, last, into the buffer
  a copied input of its shape went to (``routes``) and copied out from there: no graph keeps memory
  of its own for it. Copied inputs go to buffers every graph of the pool shares (``copy_buffers``).
"""
from __future__ import annotations

import logging
import time
import weakref

import torch

from .. import _compat
from .._compat import saved_tensors_hooks_active
from ..errors import LoraccError
from .sized_graphs import Arena, SizedGraphs, bound_groups, copy_into, copy_out_packed, pack_plan

log = logging.getLogger("loracc")

_PYTHON = object()  # Replayer._key: this call runs from Python
KEEP_BELOW = 0.95  # mode "auto": graphs stay when a replay takes at most this fraction of a Python call
PYTHON_TIMINGS = 2  # mode "auto": Python calls timed before the capture (the fastest counts)


class SharedPool:
    """The memory pool the graphs of one model capture into, and what they have lent.

    PyTorch frees a pool with the last graph that uses it (a replaced or dropped graph's memory is
    reused by later captures), and a freed pool's handle must not be captured into again: so the
    handle is taken from a graph still alive, and a new pool is started when there is none."""

    def __init__(self):
        self._side: torch.cuda.Stream | None = None
        self.captures = 0  # capture order: Graphed.seq
        self.replays = 0  # replay clock: Graphed.last_replay, Lease.at
        self.live: weakref.WeakSet[Graphed] = weakref.WeakSet()
        self.lent: weakref.WeakSet[Lease] = weakref.WeakSet()
        # At least the largest ``seq`` of a lease in ``lent`` (raised as leases are made, lowered to the
        # exact value when ``may_replay`` has to look): a graph captured after it may replay at once.
        self.lent_seq_bound = 0
        self._buffers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # see copy_buffers
        # Whether graphs of mode "auto" may capture: True; None, not yet (a byte budget's step has
        # not settled); False, never (their buffers would pass it), ``closed_because`` says why.
        self.graphs_allowed: bool | None = True
        self.closed_because = ""

    def warm_up_stream(self) -> torch.cuda.Stream:
        """One side stream for every warm-up before a capture: cuBLAS keeps a workspace per stream it
        ran on (docs/decisions/007-one-stream-for-captures.md)."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        return self._side

    def copy_buffers(self, inputs: list, in_place) -> list:
        """``inputs`` with each one not read in place copied into its buffer. The buffers are shared by
        every graph of the pool (a graph's copied inputs of one shape and dtype take distinct ones):
        the graphs run one at a time, each call copies its inputs in before its graph reads them and
        its outputs out (``routes``) before the next call, and nothing else holds a buffer (a lent
        output never views one, ``check_lent``). A buffer lives while a graph captured over it does."""
        taken: dict = {}
        static = []
        for t, keep in zip(inputs, in_place):
            if not keep and isinstance(t, torch.Tensor):
                kind = (tuple(t.shape), t.stride(), t.dtype, t.device)
                n = taken[kind] = taken.get(kind, -1) + 1
                buffer = self._buffers.get((kind, n))
                if buffer is None:
                    buffer = self._buffers[(kind, n)] = torch.empty_like(t)
                t = buffer.copy_(t)
            static.append(t)
        return static

    def handle(self):
        for graphed in self.live:
            return graphed.graph.pool()
        return torch.cuda.graph_pool_handle()

    def may_replay(self, graphed: "Graphed") -> bool:
        """Whether a replay of ``graphed`` leaves every lent output as it is (see the module's docstring):
        every lease was lent by a graph captured before it. Looks at the leases only where the bound
        says one might not be (a step's forward replays its layers in capture order: once a step)."""
        if self.lent_seq_bound < graphed.seq:
            return True
        self.lent_seq_bound = max((lease.seq for lease in self.lent), default=0)
        return self.lent_seq_bound < graphed.seq

    def added(self, graphed: "Graphed") -> None:
        self.captures += 1
        graphed.seq = self.captures
        self.live.add(graphed)


class Lease:
    """The outputs a forward graph's replay lent to its backward (held by the call's autograd
    context, which can outlive the backward: a released lease lets go of the graph, so that a graph
    dropped meanwhile frees its memory)."""

    def __init__(self, graphed: "Graphed", pool: SharedPool):
        self.graphed: Graphed | None = graphed
        self.seq, self.pool, self.at = graphed.seq, pool, pool.replays
        pool.lent.add(self)
        pool.lent_seq_bound = max(pool.lent_seq_bound, self.seq)

    def release(self) -> None:
        self.pool.lent.discard(self)
        self.graphed = None

    def intact(self) -> bool:
        """Whether the lent outputs still hold what the forward wrote: lent still, or no graph that
        may have overwritten them (one captured before theirs, or theirs) has replayed since."""
        if self in self.pool.lent:
            return True
        return not any(g.seq <= self.seq and g.last_replay > self.at for g in self.pool.live)


class Graphed:
    """``fn`` captured over ``static_inputs``: those marked ``in_place`` are the caller's own
    tensors (read where they are; a call must pass those very tensors), the others are buffers each
    call's inputs are copied into. Outputs from index ``lend_from`` on are returned as they are (lent),
    the others as copies (an output that is an input: the caller's tensor), made from the copied
    inputs' buffers where ``routes`` put them; the copies of outputs before index ``together`` share
    one allocation per dtype (``sized_graphs.pack_plan``)."""

    def __init__(self, fn, static_inputs: list[torch.Tensor], pool=None, in_place: tuple[bool, ...] = (),
                 lend_from: int | None = None, side: torch.cuda.Stream | None = None, together: int = 0,
                 warm_up: bool = True):
        """Captures on ``side`` (a new stream if None). ``warm_up``: run ``fn`` once there first, as a
        capture on a stream that ``fn`` has not run on requires (what initialises lazily: cuBLAS's
        workspace for the stream); ``False`` where ``fn`` already ran at these sizes and a capture of it
        already ran on ``side``. Unlike ``torch.cuda.graph``, no device synchronisation and no
        ``empty_cache`` before the capture (both cost every capture milliseconds)."""
        self.static_inputs = static_inputs
        self.in_place = tuple(in_place) + (False,) * (len(static_inputs) - len(in_place))
        self.seq, self.last_replay = 0, 0
        self.graph = torch.cuda.CUDAGraph()
        side = side if side is not None else torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if warm_up:
                fn(*self.static_inputs)  # fn never writes its inputs
            # thread_local: a CUDA call another thread makes meanwhile (a kernel compiled in the background
            # loading) is not this capture's.
            self.graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
            try:
                outputs = list(fn(*self.static_inputs))
                self.lend_from = len(outputs) if lend_from is None else lend_from  # None: lends nothing
                check_lent(self.static_inputs, outputs, self.in_place, self.lend_from)
                self.routes = routes(self.static_inputs, outputs, self.in_place, self.lend_from)
                for j, k in self.routes.items():  # last: every read of the input buffer comes before
                    outputs[j] = self.static_inputs[k].copy_(outputs[j])
            except BaseException:
                try:
                    self.graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture is invalid already; the first error says why
                    pass
                raise
            self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.static_outputs = outputs
        self.addresses = tuple(t.data_ptr() for t in self.static_inputs)  # what the graph reads
        self.read_in_place = [(i, a) for i, (keep, a) in enumerate(zip(self.in_place, self.addresses)) if keep]
        ids = {id(t): i for i, t in enumerate(self.static_inputs)}
        self.passthrough = [None if j in self.routes else ids.get(id(t)) for j, t in enumerate(self.static_outputs)]
        # Per call: the copied inputs, copied in by one multi-tensor copy per group; the outputs not
        # lent, passed through (the caller's input) or copied out (those before ``together`` into one
        # allocation per dtype, ``pack_plan``; the others one clone each).
        self.copied = [i for i, keep in enumerate(self.in_place) if not keep]
        self.copy_in = bound_groups([self.static_inputs[i] for i in self.copied])
        self.passed = [(j, i) for j, i in enumerate(self.passthrough) if i is not None]
        out = [j for j, (t, i) in enumerate(zip(outputs, self.passthrough))
               if j < self.lend_from and i is None and isinstance(t, torch.Tensor)]
        self.packs = pack_plan(outputs, [j for j in out if j < together])
        packed = {j for group in self.packs for j, *_ in group[3]}
        self.cloned = [j for j in out if j not in packed]

    @property
    def lends(self) -> bool:
        return self.lend_from < len(self.static_outputs)

    def reads_in_place(self, inputs) -> bool:
        """Whether ``inputs`` are, where the graph reads its inputs in place, at the addresses it was
        captured over. A graph reads addresses, not tensors: a wrapper that gathers a layer's weights
        into new memory at each call (FSDP2, which also moves a tensor's own storage) hands its
        backward other memory than its forward read."""
        return all(inputs[i].data_ptr() == address for i, address in self.read_in_place)

    def __call__(self, *inputs):
        """Replay over ``inputs``; raises where an input read in place is not at its captured address."""
        if not self.reads_in_place(inputs):  # the graph would read other memory
            raise RuntimeError(f"CUDA graph inputs {[i for i, _ in self.read_in_place]}: not all at the addresses "
                               "the graph was captured over")
        return self.replay(inputs)

    def replay(self, inputs):
        """Replay over ``inputs``, whose inputs read in place the caller has checked (``reads_in_place``):
        a region's call key fixes their shapes and dtypes, their addresses the graph. The copied
        inputs are checked here: ``copy_`` would broadcast or cast silently."""
        srcs = [inputs[i] for i in self.copied]
        for i, t in zip(self.copied, srcs):
            static = self.static_inputs[i]
            if static.shape != t.shape or static.dtype != t.dtype:  # the region's guards should make this impossible
                raise RuntimeError(f"CUDA graph input {i}: {t.dtype}{list(t.shape)}, captured for "
                                   f"{static.dtype}{list(static.shape)}")
        copy_into(self.copy_in, srcs)
        self.graph.replay()
        outputs = list(self.static_outputs)
        for j, i in self.passed:
            outputs[j] = inputs[i]
        for j in self.cloned:
            outputs[j] = outputs[j].clone()
        copy_out_packed(self.packs, outputs)
        return outputs


class Replayers:
    """The wrapper a backend hands each compiled graph that may replay as a CUDA graph (codegen
    returns plain callables; the runtime decides how they run): every graph it wraps is a
    ``Replayer`` capturing into this one ``SharedPool``. A backend makes one (one per device), so
    that every graph of a model on that device shares the pool.

    ``gated`` (a model with a byte ``memory_budget``): graphs of mode ``"auto"`` wait, running from
    Python, until the step's memory opens the pool to them (``SharedPool.graphs_allowed``, set by
    ``runtime.memory.StepMemory.settle`` once every region has run, where the step's predicted peak
    with the graphs' buffers fits the budget); a symbolic graph then runs from Python (its sized
    graphs' arena is in no prediction)."""

    def __init__(self, gated: bool = False):
        self.gated = gated
        self.pool = SharedPool()
        self.pool.graphs_allowed = None if gated else True
        self.sized_pool = SharedPool()  # the sized graphs' temporaries: apart from the lent outputs above
        self.arena: Arena | None = None

    def __call__(self, fn, name: str, *, mode: str, after=None, symbolic: bool = False, **options):
        """``fn`` as a ``Replayer``; ``after``: what the same region's forward compiled to (a
        ``Replayer`` or not), ``options``: ``Replayer``'s keyword arguments. A ``symbolic`` graph
        (its batch and sequence sizes symbols) becomes ``SizedGraphs`` instead: a graph per size
        (``fn`` itself where ``gated``)."""
        if symbolic:
            if self.gated:
                return fn
            if self.arena is None:
                self.arena = Arena()
            # A forward's saved tensors (from lend_from on) go to its backward in one buffer; a backward's
            # parameter gradients are copied out together.
            return SizedGraphs(fn, name, self.arena, self.sized_pool, together=(range(options.get("together", 0)),),
                               saved_from=options.get("lend_from"))
        return Replayer(fn, name, mode=mode, pool=self.pool, after=after if isinstance(after, Replayer) else None,
                        **options)


class Replayer:
    """``fn`` run from Python at its first call; from the second on, as CUDA graphs when ``mode``
    says so (see the module's docstring). A capture that fails leaves it in Python, with the reason
    logged. ``decision`` says what was decided and why (None until decided).

    ``fixed_inputs``: how many leading inputs are the same tensors at every call of one layer (a
    forward's module parameters and buffers; a backward's saved tensors); ``lend_from``: the index
    of a forward's first saved output (None for a backward). ``max_captures`` bounds the captures
    (a block: a few per layer) before a call that needs a new one runs from Python instead;
    ``layers``: how many layers call it, if known (a forward keeps a graph for that many sets of weights at
    most: a graph for weights the model no longer has, replaced by new tensors, is dropped, least
    recently replayed first, rather than keeping the old weights alive); ``together``: how many
    leading outputs are copied out of a replay into one allocation (a backward's parameter gradients,
    which live together until the optimizer's step: one allocation and one copy instead of one each).
    """

    def __init__(self, fn, name: str, mode: str = "on", pool: SharedPool | None = None, after: "Replayer | None" = None,
                 fixed_inputs: int = 0, lend_from: int | None = None, max_captures: int = 8, layers: int | None = None,
                 together: int = 0):
        if mode not in ("on", "auto"):
            raise ValueError(f"Replayer mode must be 'on' or 'auto', got {mode!r}")
        self.fn, self.name, self.mode, self.after = fn, name, mode, after
        self.pool = pool if pool is not None else SharedPool()
        self.fixed_inputs, self.lend_from, self.max_captures, self.layers = fixed_inputs, lend_from, max_captures, layers
        self.together = together
        self.calls = self.captures = 0
        self._warmed = False  # whether a capture of fn ran (on the pool's side stream): later ones skip the warm-up
        self.kept = False
        self.layer_graphs: dict = {} if after is None else weakref.WeakKeyDictionary()  # by weights / by forward graph
        self.copy_graph: Graphed | None = None
        self.lease: Lease | None = None  # a forward's latest lease, until the runtime takes it
        # Held weakly (each is held by its program): the two would otherwise be a reference cycle
        # keeping their graphs, and the weights those read in place, until Python's collector runs.
        self._follower = None  # a forward's backward, set by the backward
        self._sibling = None  # mode "auto": the same stage of another program, see share_decisions
        if after is not None:
            after.follower = self
        self.failed: str | None = None
        self.moved_inputs = 0  # calls run from Python: their in-place inputs were not the graph's
        self.decision: str | None = None
        self.python_s: list[float] = []  # mode "auto": the Python calls timed so far
        self.timing: tuple[float, float] | None = None  # mode "auto": (replay, Python) seconds measured

    @property
    def follower(self) -> "Replayer | None":
        return self._follower() if self._follower is not None else None

    @follower.setter
    def follower(self, replayer: "Replayer | None") -> None:
        self._follower = weakref.ref(replayer) if replayer is not None else None

    @property
    def sibling(self) -> "Replayer | None":
        return self._sibling() if self._sibling is not None else None

    @sibling.setter
    def sibling(self, replayer: "Replayer | None") -> None:
        self._sibling = weakref.ref(replayer) if replayer is not None else None

    @property
    def graphed(self) -> Graphed | None:
        """The graph captured last, while graphs are kept."""
        graphs = [*self.layer_graphs.values(), self.copy_graph]
        graphs = [g for g in graphs if g is not None]
        return max(graphs, key=lambda g: g.seq) if self.kept and graphs else None

    @property
    def may_graph(self) -> bool:
        """Whether this graph replays, or may still decide to (for the predicted peak)."""
        return self.kept or self.decision is None

    def take_lease(self) -> Lease | None:
        lease, self.lease = self.lease, None
        return lease

    def __call__(self, *inputs, lease: Lease | None = None):
        self.calls += 1
        self.lease = None
        if self.kept:
            return self._replay(inputs, lease)
        if self.mode == "auto" and self.pool.graphs_allowed is not True:
            if self.pool.graphs_allowed is False and self.decision is None:
                self.decision = f"runs from Python: {self.pool.closed_because}"
            return self.fn(*inputs)
        if self.calls < 2 or self.decision is not None or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            return self.fn(*inputs)
        if self.mode == "auto" and self.after is not None and not self.after.kept:
            if self.after.decision is not None:  # the forward stays in Python; undecided, wait for it
                self.decision = f"runs from Python, as {self.after.name} does"
            return self.fn(*inputs)
        outputs = None
        like = self._decided_sibling()
        if like is not None and not like.kept:
            self.decision = f"runs from Python, as decided for the region's other call signature ({like.decision})"
            return self.fn(*inputs)
        if self.mode == "auto" and like is None:
            seconds, outputs = _timed(lambda: self.fn(*inputs))
            self.python_s.append(seconds)
            if len(self.python_s) < PYTHON_TIMINGS:
                return outputs
            python_s = min(self.python_s)
        key = self._key(inputs, lease)
        if key is _PYTHON:  # nothing to capture over at this call: at a later one
            return self.fn(*inputs) if outputs is None else outputs
        graphed = self._capture(inputs, key)
        if graphed is None:
            self.decision = f"runs from Python: the capture failed ({self.failed})"
            # cuda_graphs=True asked for a graph: say so; "auto" only tried one (explain() says why not)
            (log.warning if self.mode == "on" else log.info)("loracc: %s runs without a CUDA graph: %s", self.name, self.failed)
            torch.cuda.synchronize()
            return self.fn(*inputs) if outputs is None else outputs
        if self.mode == "on" or like is not None:
            self._keep("CUDA graph (cuda_graphs=True)" if like is None else
                       f"CUDA graph, as decided for the region's other call signature ({like.decision})")
            log.info("captured %s as a CUDA graph", self.name)
            return self._run(graphed, inputs)
        replay_s = min(_timed(lambda: graphed(*inputs))[0] for _ in range(3))
        timing = f"replay {replay_s * 1e3:.2f} ms vs {python_s * 1e3:.2f} ms from Python"
        self.timing = (replay_s, python_s)
        if self.after is not None and self.after.timing:  # a backward decides for itself and its forward
            replay_s, python_s = replay_s + self.after.timing[0], python_s + self.after.timing[1]
            timing += f"; with its forward {replay_s * 1e3:.2f} ms vs {python_s * 1e3:.2f} ms"
        if replay_s <= KEEP_BELOW * python_s:
            self._keep(f"CUDA graph ({timing})")
            log.info("%s: %s", self.name, self.decision)
            # The graph's own outputs, lent as at every replay: the Python call's saved tensors are
            # freed rather than held next to the graph's (and its backward can measure at this layer).
            return self._run(graphed, inputs)
        else:
            self._drop(f"runs from Python ({timing}: bound by the GPU, a graph would gain too little)")
            if self.after is not None and self.after.kept:
                # A forward graph alone would keep every layer's saved tensors in the graphs' pool
                # after the backward read them, where the backward's own allocations cannot reuse them.
                self.after._drop(f"runs from Python: its backward does, and forward graphs alone would hold the "
                                 f"saved tensors apart from the backward's memory (it measured {self.after.decision})")
                log.info("%s: %s", self.after.name, self.after.decision)
        log.info("%s: %s", self.name, self.decision)
        return outputs

    def _decided_sibling(self) -> "Replayer | None":
        """The sibling whose decision this graph takes (mode "auto"), once it has decided for good: a
        forward's decision to keep its graphs holds once its backward's has."""
        like = self.sibling
        if self.mode != "auto" or like is None or like.decision is None:
            return None
        final = not like.kept or like.follower is None or like.follower.decision is not None
        return like if final else None

    def _keep(self, decision: str) -> None:
        self.kept, self.decision = True, decision

    def _drop(self, decision: str) -> None:
        self.kept, self.decision = False, decision
        self.layer_graphs.clear()
        self.copy_graph = None

    # -- per call, once graphs are kept ---------------------------------------------------------

    def _key(self, inputs, lease):
        """Which graph serves this call: the layer's own (by its weights, or by the forward graph
        whose outputs it reads), the copy graph (None), or none (``_PYTHON``: a backward without a
        lease whose forward never replayed in copy mode: its forward ran from Python, e.g. a first
        call; a copy graph for it would hold a layer's saved tensors for that call alone)."""
        if self.after is None:
            if self.fixed_inputs and not saved_tensors_hooks_active():
                return tuple(t.data_ptr() for t in inputs[: self.fixed_inputs])
            return None
        if lease is not None and lease.graphed is not None:
            return lease.graphed
        return None if self.after.copy_graph is not None else _PYTHON

    def _replay(self, inputs, lease):
        key = self._key(inputs, lease)
        if key is _PYTHON:
            return self.fn(*inputs)
        graphed = self.copy_graph if key is None else self.layer_graphs.get(key)
        # A forward's key is the addresses of the inputs its graph reads in place (the copy graph reads
        # none): found by it, the graph reads these inputs. A backward's inputs read in place (what its
        # forward lent, its weights) are checked.
        if graphed is not None and self.after is not None and not graphed.reads_in_place(inputs):
            if not self.moved_inputs:
                log.info("loracc: %s runs from Python where its inputs are not the tensors its graph reads in "
                         "place (weights gathered into new memory at each call)", self.name)
            self.moved_inputs += 1
            return self.fn(*inputs)
        if graphed is None and self.follower is not None and self.follower.decision is None and self.mode == "auto":
            # Kept, but its backward has not decided: only the graph it measured replays meanwhile
            # (its leases let the backward measure), so that a backward that stays in Python drops
            # one forward graph, not one per layer (each holding its layer's saved tensors).
            return self.fn(*inputs)
        if graphed is None or not self.pool.may_replay(graphed):
            if self.captures >= self.max_captures:
                return self.fn(*inputs)
            graphed = self._capture(inputs, key)
            if graphed is None:
                log.info("loracc: %s call runs from Python: the capture failed (%s)", self.name, self.failed)
                return self.fn(*inputs)
        return self._run(graphed, inputs)

    def _run(self, graphed: Graphed, inputs):
        self.pool.replays += 1
        graphed.last_replay = self.pool.replays
        outputs = graphed.replay(inputs)  # its inputs read in place: checked by _replay, or captured over
        if graphed.lends:
            self.lease = Lease(graphed, self.pool)
        return outputs

    def _capture(self, inputs, key) -> Graphed | None:
        """Capture the graph for this call, whose ``_key`` is ``key`` (replacing the one it had), or
        None if capturing failed."""
        in_place = self._in_place(key, len(inputs))
        static = self.pool.copy_buffers(inputs, in_place)
        self.captures += 1
        try:
            graphed = Graphed(self.fn, static, self.pool.handle(), in_place=in_place,
                              lend_from=self.lend_from if key is not None else None, side=self.pool.warm_up_stream(),
                              together=self.together, warm_up=not self._warmed)
            self._warmed = True
        except Exception as exc:  # noqa: BLE001 - any capture failure: stay in Python, say why
            self.failed = f"{type(exc).__name__}: {exc}"
            _compat.release_generators_after_failed_capture(torch.device("cuda"))
            return None
        self.pool.added(graphed)
        if key is None:
            self.copy_graph = graphed
            return graphed
        if self.after is None and self.layers and key not in self.layer_graphs and len(self.layer_graphs) >= self.layers:
            stale = min(self.layer_graphs, key=lambda k: self.layer_graphs[k].last_replay)
            del self.layer_graphs[stale]
        self.layer_graphs[key] = graphed
        return graphed

    def _in_place(self, key, n: int) -> list[bool]:
        """Which inputs the graph for ``key`` reads where they are: a forward's parameters and
        buffers; of what a backward gets from its forward, the outputs that forward graph lent and
        its own parameters (an activation it passed through, such as the layer's input, is copied)."""
        if key is None:
            return [False] * n
        if self.after is None:
            return [i < self.fixed_inputs for i in range(n)]
        forward: Graphed = key
        saved = [forward.passthrough[forward.lend_from + j] for j in range(self.fixed_inputs)]
        return [j < self.fixed_inputs and (saved[j] is None or forward.in_place[saved[j]]) for j in range(n)]


def check_lent(inputs: list, outputs: list, in_place, lend_from: int) -> None:
    """Raise (the capture fails, the call runs from Python) if an output to be lent views a copied
    input's buffer: the next call's copy would overwrite it before its backward reads it."""
    for j, out in enumerate(outputs[lend_from:], start=lend_from):
        for k, t in enumerate(inputs):
            if not in_place[k] and _views(out, t):
                raise RuntimeError(f"output {j}, lent to the backward, views input {k}, which every call overwrites")


def routes(inputs: list, outputs: list, in_place, lend_from: int) -> dict[int, int]:
    """Which outputs a graph writes into which of its copied inputs' buffers, ``{output: input}``.

    An output that is not lent is copied out after every replay; a graph that kept it in memory of
    its own would hold it for good (every layer's forward and backward graph one hidden state each). Written into the buffer that a copied input of the same
    shape and dtype was copied into (its last reader comes before), the output takes no memory of its
    own. Not into an input that another output views (a lent tensor, say), nor an output that is an
    input passed through. Works on real and fake tensors alike (the predicted peak uses it)."""
    taken: dict[int, int] = {}
    free = [k for k, t in enumerate(inputs) if not in_place[k] and isinstance(t, torch.Tensor) and t.is_contiguous()
            and not any(_views(o, t) for o in outputs)]
    for j, out in enumerate(outputs[:lend_from]):
        if not isinstance(out, torch.Tensor) or not out.is_contiguous() or any(out is t for t in inputs):
            continue
        k = next((k for k in free if k not in taken.values() and inputs[k].shape == out.shape
                  and inputs[k].dtype == out.dtype), None)
        if k is not None:
            taken[j] = k
    return taken


def _views(out, t) -> bool:
    """Whether ``out`` shares memory with the tensor ``t`` without being ``t`` itself."""
    return (isinstance(out, torch.Tensor) and isinstance(t, torch.Tensor) and out is not t
            and _compat.is_alias_of(out, t))


def share_decisions(first, second) -> None:
    """Two programs of one region (under a memory budget, a block's first layer, whose input needs no
    gradient, and its other layers) run the same kernels at the same shapes: the first of a stage to decide decides
    for both. Otherwise the program called once a step would measure a step later than the other
    and capture its graph after theirs: a forward graph captured after the others lends outputs that
    their replays could overwrite, so every layer's graphs would be captured again
    (docs/decisions/001-cuda-graph-policy.md). ``first`` and ``second``: the two programs."""
    for stage in ("forward", "backward"):
        a, b = getattr(first, stage), getattr(second, stage)
        if isinstance(a, Replayer) and isinstance(b, Replayer) and a.mode == b.mode == "auto":
            a.sibling, b.sibling = b, a


def check_lease(lease: Lease | None) -> None:
    """Before a backward reads what a replayed forward lent: raise if a replay has overwritten it."""
    if lease is not None and not lease.intact():
        raise LoraccError(
            "loracc: a second backward through a layer replayed as a CUDA graph (retain_graph=True), after "
            "other replays overwrote what its forward saved; compile with cuda_graphs=False to run backward twice")


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result
