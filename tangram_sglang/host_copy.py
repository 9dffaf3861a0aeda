"""Host-to-device copies that do not wait for the GPU (used inside forward passes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tangram_sglang.errors import KernelError


def host_to_device(array: np.ndarray | Sequence[int], device: torch.device | str) -> torch.Tensor:
    """A host array on ``device`` without waiting for the GPU.

    A copy from pageable host memory makes the host wait until the stream's queued work is done
    (CUDA runtime API, "API synchronization behavior": pageable host-to-device copies), so one
    such copy inside a forward pass stops the host from running ahead of the GPU. On CUDA the
    array is staged in pinned memory (PyTorch's caching host allocator, which keeps the block
    until the copy has run) and copied ``non_blocking`` on the current stream; elsewhere it is a
    plain copy.

    Args:
        array: a numpy array or a sequence of ints (any shape; its dtype is kept, a list becomes
            int64).
        device: where the tensor goes.

    Returns:
        A tensor on ``device`` with ``array``'s values and shape. On CUDA it is ready in the
        order of the stream that was current at the call (SGLang runs a forward pass on one
        stream); another stream must wait for that one before reading it.

    Raises:
        KernelError: called while a CUDA graph is being captured (the graph would keep the
            address of a pinned block that the allocator hands out again, so a replay would
            read stale values).
    """
    host = torch.from_numpy(np.ascontiguousarray(np.asarray(array)))
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device, copy=True)
    if torch.cuda.is_current_stream_capturing():
        raise KernelError(
            "host_to_device inside CUDA-graph capture: build this tensor before the capture "
            "(prefill CUDA graphs are off under --tangram)"
        )
    return host.pin_memory().to(device, non_blocking=True)
