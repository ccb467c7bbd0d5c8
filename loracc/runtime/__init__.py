"""The runtime: a compiled region run inside an autograd Function (``region.py``), its graphs replayed
as CUDA graphs where that pays (``cuda_graphs.py``), checked against eager (``verify.py``), and the
step's memory (``memory.py``)."""
