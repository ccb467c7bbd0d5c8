"""Around the training loop: ``FusedAdamW`` (``optim.py``), weights in and out (``io.py``: public as
``loracc.io``), ``LoRALinear`` (``lora.py``), data-parallel helpers (``distributed.py``: public as
``loracc.distributed``)."""
