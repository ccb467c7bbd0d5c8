"""The frontend: a user's model as regions (``regions.py``), the forwards loracc installs (``patching.py``), the Hugging Face causal-LM head (``hf_causal_lm.py``)."""
