"""host_copy.host_to_device: values, shapes and dtypes kept; on a GPU the host does not wait."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tangram_sglang.host_copy import host_to_device


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.array([[True, False], [False, True]]),
        np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 1, 3),
        np.arange(20, dtype=np.int64).reshape(4, 5)[:, 1:3],  # a non-contiguous view
    ],
    ids=["int64", "bool", "float32", "view"],
)
def test_values_shape_and_dtype_are_kept_and_the_host_array_is_not_shared(array):
    out = host_to_device(array, "cpu")
    assert out.shape == array.shape and out.numpy().dtype == array.dtype
    assert np.array_equal(out.numpy(), array)
    if array.flags["C_CONTIGUOUS"]:
        array.flat[0] = not array.flat[0] if array.dtype == bool else array.flat[0] + 7
        assert not np.array_equal(out.numpy(), array)  # a copy: later host edits do not leak


def test_a_list_of_ints_becomes_int64():
    out = host_to_device([3, 1, 2], torch.device("cpu"))
    assert out.dtype == torch.int64 and out.tolist() == [3, 1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_copy_is_queued_behind_running_work_without_waiting_for_it():
    host_to_device(np.arange(4096, dtype=np.int64), "cuda")  # the first pinned block, untimed
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keeps the stream busy for about a second
    start = time.perf_counter()
    out = host_to_device(np.arange(4096, dtype=np.int64), "cuda")
    queued_s = time.perf_counter() - start
    torch.cuda.synchronize()
    assert queued_s < 0.2, f"the host waited {queued_s:.3f} s for the GPU"
    assert torch.equal(out.cpu(), torch.arange(4096))
    # the pageable copy it replaces does wait: the test would catch a regression to it
    torch.cuda._sleep(2_000_000_000)
    start = time.perf_counter()
    torch.from_numpy(np.arange(4096, dtype=np.int64)).to("cuda")
    assert time.perf_counter() - start > queued_s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scorer_name", ["kvzip-lite", "snapkv", "kvzip-lite-runs"])
def test_the_selection_of_an_extend_batch_never_waits_for_the_gpu(scorer_name):
    """batch_kept_indices on mixed lengths (padded buckets) and on one run of equal lengths
    (the scorer's own call): any host read or blocking copy raises under the sync debug mode."""
    from tangram_sglang.backend.compress import batch_kept_indices
    from tangram_sglang.scoring.kvzip_lite import KVzipLiteScorer
    from tangram_sglang.scoring.snapkv import SnapKVScorer

    scorer = SnapKVScorer(obs_window=8) if scorer_name == "snapkv" else KVzipLiteScorer()
    lengths = [300, 300] if scorer_name.endswith("runs") else [300, 120, 700, 64]
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 8, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(total, 2, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    lse = torch.randn(total, 8, device="cuda", generator=gen).abs() + 3.0
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    kept = np.array([[max(n // 4, 1)] * 2 for n in lengths])
    kept_dev = torch.from_numpy(kept).cuda()
    call = lambda: batch_kept_indices(scorer, q, k, lse, bounds, kept, 0.125, 4, 32, kept_dev)  # noqa: E731
    host_to_device([0], "cuda")  # the process's first pinned block, outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = call()  # a new batch: its plans are built and uploaded here
        again = call()  # the next layer: the cached plans
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, again)
