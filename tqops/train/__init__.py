"""Training a small Qwen3 target and its DFlash drafter on the Python standard library (``python -m tqops.train``)."""
