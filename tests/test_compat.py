"""_compat: the private torch APIs loracc touches, checked against what torch itself does."""
import subprocess
import sys

import torch
from torch.fx.experimental import symbolic_shapes

from loracc import _compat


def test_the_frames_skipped_are_torchs_own_found_without_its_imports():
    """The shape environment's skipped files (``skip_frames_without_importing``) are torch's set, plus
    files of the polyfills folder only; the lookup imports neither TorchDynamo's guards module nor
    ``torch.export``, which torch's own imports for their paths."""
    _compat.skip_frames_without_importing()
    ours = symbolic_shapes.uninteresting_files()
    torchs = symbolic_shapes.uninteresting_files.torchs()
    assert torchs <= ours, sorted(torchs - ours)
    polyfills = f"{torch.__path__[0]}/_dynamo/polyfills/"
    assert all(f.startswith(polyfills) for f in ours - torchs), sorted(ours - torchs)
    _compat.skip_frames_without_importing()  # once: torch's function stays reachable
    assert symbolic_shapes.uninteresting_files.torchs() == torchs

    code = ("import sys, torch; from loracc import _compat; _compat.skip_frames_without_importing(); "
            "from torch.fx.experimental import symbolic_shapes; files = symbolic_shapes.uninteresting_files(); "
            "print(len(files), [m for m in ('torch.export._trace', 'torch._dynamo.guards') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    assert int(out[0]) == len(ours) and out[1].strip() == "[]"


def test_a_symbolic_trace_uses_the_frames_found_without_importing():
    fakes, shape_env = _compat.symbolic_fakes([torch.randn(3, 5)], [[True, False]])
    assert getattr(symbolic_shapes.uninteresting_files, "_loracc", False)
    assert _compat.is_symbolic(fakes[0].shape[0]) and shape_env is not None
