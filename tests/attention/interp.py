"""Load a private copy of the Triton kernels with TRITON_INTERPRET=1, leaving the compiled module untouched."""
import functools
import importlib.util
import os

import tqops.attention


@functools.lru_cache(maxsize=None)
def interpreted_kernels():
    path = os.path.join(os.path.dirname(tqops.attention.__file__), "triton_paged.py")
    spec = importlib.util.spec_from_file_location("tqops.attention._triton_paged_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # @triton.jit reads it when the kernels are decorated
    try:
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module
