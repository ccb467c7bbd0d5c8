"""What every stage reads and writes: node annotations (``graph.py``), loracc's own ops (``ops.py``,
``cross_entropy.py``: ``loracc::lora_linear``, ``loracc::linear_cross_entropy`` and their references),
and the fused-group node (``fused_rows.py``). Imports nothing of loracc above it."""
