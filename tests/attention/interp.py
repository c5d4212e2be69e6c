"""A private copy of the Triton kernels run under TRITON_INTERPRET=1, leaving the compiled module untouched."""
import contextlib
import functools
import importlib.util
import os

import tqops.attention


@contextlib.contextmanager
def _interpret_env():
    # @triton.jit reads the flag when kernels are decorated, and the interpreter again when it runs them.
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


@functools.lru_cache(maxsize=None)
def _module():
    path = os.path.join(os.path.dirname(tqops.attention.__file__), "triton_paged.py")
    spec = importlib.util.spec_from_file_location("tqops.attention._triton_paged_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    with _interpret_env():
        spec.loader.exec_module(module)
    return module


def paged_attention_interpreted(*args, **kwargs):
    """``paged_attention_triton`` on CPU tensors through the Triton interpreter."""
    with _interpret_env():
        return _module().paged_attention_triton(*args, **kwargs)


def launch_config(*args):
    return _module().launch_config(*args)
