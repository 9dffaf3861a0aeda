"""Shared fixtures: the embedded model folder, fixed seeds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


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
