"""A private copy of the Triton kernels run under TRITON_INTERPRET=1, leaving the compiled module untouched."""
import functools
import importlib
import os
import sys
import types
from unittest import mock

import tqops.attention


def _interpret_env():
    # @triton.jit reads the flag when kernels are decorated, and the interpreter again when it runs them.
    return mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"})


@functools.lru_cache(maxsize=None)
def _module():
    """The host wrapper of a private copy of tqops.attention's kernel modules, all decorated while interpreting."""
    name = "tqops._attention_interpreted"
    package = types.ModuleType(name)
    package.__path__ = [os.path.dirname(tqops.attention.__file__)]
    sys.modules[name] = package
    with _interpret_env():
        return importlib.import_module(f"{name}.triton_paged")


def paged_attention_interpreted(*args, **kwargs):
    """``paged_attention_triton`` on CPU tensors through the Triton interpreter."""
    with _interpret_env():
        return _module().paged_attention_triton(*args, **kwargs)


def launch_config(*args):
    return _module().launch_config(*args)
