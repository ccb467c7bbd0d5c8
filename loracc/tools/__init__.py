"""The ``loracc`` command (``cli.py``, ``kernels_cli.py``), ``loracc.explain`` (``explain.py``),
graph dumps (``dump.py``) and the built-in model presets (``presets.py``)."""
