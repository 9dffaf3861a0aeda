"""Kernel tests: the interpreter switch (helpers and the device live in kernel_cases.py).

Triton decides interpreted vs compiled when a ``@triton.jit`` function is DEFINED, including its
own ``tl.cdiv``-style helpers defined when ``triton`` is first imported. So on a machine without
CUDA, ``TRITON_INTERPRET=1`` must be set before anything imports ``triton`` (sglang does).
pytest loads this conftest before this folder's test modules; if a module collected earlier has
already imported triton uncompiled-for-CPU, collection fails with the fix instead of running
kernels that cannot work. On a GPU machine the same tests run compiled on ``cuda``.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise RuntimeError(
            "tests/kernels run Triton kernels on CPU through TRITON_INTERPRET=1, but triton was "
            "imported before this conftest (by a test module collected earlier); set "
            "os.environ.setdefault('TRITON_INTERPRET', '1') in tests/conftest.py when CUDA is "
            "unavailable, or run `TRITON_INTERPRET=1 pytest ...`"
        )
    os.environ["TRITON_INTERPRET"] = "1"
