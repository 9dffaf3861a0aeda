"""Shared fixtures: the embedded model folder, fixed seeds; Triton's interpreter on CPU."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# Triton picks interpreted vs compiled when a @triton.jit function is defined, i.e. at the first
# import of triton (sglang imports it too). Without CUDA, set the interpreter before any test
# module imports either; SGLangServer drops it from the servers' environment.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fixed_seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_path():
    """Folder of the converted SmolLM2-135M-Instruct (converted once into the cache)."""
    from tangram_sglang.models import model_path

    return model_path("smollm2")
