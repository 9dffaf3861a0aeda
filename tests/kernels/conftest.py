"""Kernel tests: the interpreter switch (helpers and the device live in kernel_cases.py).

Triton picks interpreted vs compiled kernels when a ``@triton.jit`` function is DEFINED, so
``TRITON_INTERPRET=1`` must be set before ``tangram_sglang.kernels`` is imported; without a CUDA
GPU we set it here (pytest loads this conftest before the test modules of this folder). On a GPU
machine the same tests run compiled on ``cuda``. A test module elsewhere that imports the Triton
kernels must be collected after this folder, or set the variable itself.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
