"""Capture: a region's call as an ATen fx graph and its joint forward + backward (``trace.py``), kept
on disk between processes (``trace_cache.py``)."""
