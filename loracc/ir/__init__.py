"""What every stage reads and writes: node annotations (``graph.py``), loracc's own ops (``ops.py``,
``cross_entropy.py``: ``loracc::lora_linear``, ``loracc::linear_cross_entropy`` and their references),
the fused-group node (``fused_rows.py``) and the dtypes' names (``dtypes.py``). Imports nothing of
loracc above it."""
