"""``TritonKernels`` builds every bucket's per-layer split views once, at start-up.

The decode call only indexes them (no ``LayerSplits`` built per layer per step). The CUDA device
query is the one thing replaced here: this machine has no GPU, and only the SM count is read.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tangram_sglang.backend.layer_ops import TritonKernels
from tangram_sglang.profile import BudgetProfile


def test_views_are_built_once_per_bucket_and_layer(monkeypatch):
    profile = BudgetProfile.load("calibration/synthetic/llama3.1-8b-ada-snapkv-r0.25.json")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132)
    )
    kernels = TritonKernels(SimpleNamespace(profile=profile), 48, torch.device("cpu"))
    assert sorted(kernels.views) == [1, 2, 4, 8, 16, 32, 48]
    for table in kernels.tables.tables:
        views = kernels.views[table.batch_size]
        assert len(views) == profile.model.num_layers
        for lid in (0, profile.model.num_layers - 1):
            want = table.layer(lid)
            assert views[lid].num_ctas == want.num_ctas
            assert torch.equal(views[lid].cta_head, want.cta_head)
    # a batch of 20 reads the 32 bucket's views, the same objects every step
    bucket = kernels.tables.for_batch(20).batch_size
    assert bucket == 32 and kernels.views[bucket][5] is kernels.views[bucket][5]
