"""``kernels._checks.check_tensor``: every failure names the argument and the fix; a tensor that
meets the contract passes (the check runs on every kernel launch, so its passing path only reads
metadata)."""

from __future__ import annotations

import pytest
import torch

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels._checks import check_tensor

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "tensor, shape",
    [
        (torch.zeros(4, 2, 8), (4, 2, 8)),
        (torch.zeros(4, 2, 8), (None, None, 8)),
        (torch.zeros(3, 6).t()[:, :1], (6, 1)),  # last dim of size 1, stride 6: allowed
        (torch.zeros(5, 3, 8)[:, 1:], (5, 2, None)),  # strided rows, unit last stride
        (torch.zeros(()), ()),
    ],
)
def test_a_tensor_within_the_contract_passes(tensor, shape):
    check_tensor("x", tensor, shape, (torch.float32,), CPU)


@pytest.mark.parametrize(
    "tensor, shape, dtypes, pattern",
    [
        ([1, 2], (2,), (torch.float32,), r"^x must be a torch.Tensor, got list$"),
        (
            torch.zeros(4, 2),
            (4, 2, 8),
            (torch.float32,),
            r"x has shape \[4, 2\], expected \[4, 2, 8\]",
        ),
        (torch.zeros(4, 3, 8), (None, 2, 8), (torch.float32,), r"expected \[\*, 2, 8\]"),
        (
            torch.zeros(4, 2, dtype=torch.int64),
            (4, 2),
            (torch.int32,),
            r"x has dtype torch.int64, expected one of int32",
        ),
        (torch.zeros(8, 4).t(), (4, 8), (torch.float32,), r"contiguous last dim.*\.contiguous\(\)"),
    ],
)
def test_each_failure_names_the_argument_and_the_fix(tensor, shape, dtypes, pattern):
    with pytest.raises(KernelError, match=pattern):
        check_tensor("x", tensor, shape, dtypes, CPU)


def test_a_tensor_on_another_device_is_named_with_both_devices():
    meta = torch.zeros(4, 2, device="meta")
    with pytest.raises(KernelError, match=r"x is on meta but the kernel runs on cpu"):
        check_tensor("x", meta, (4, 2), (torch.float32,), CPU)


def test_a_strided_last_dim_passes_when_the_kernel_allows_it():
    transposed = torch.zeros(8, 4).t()  # stride (1, 4)
    check_tensor("x", transposed, (4, 8), (torch.float32,), CPU, last_dim_contiguous=False)
    with pytest.raises(KernelError, match="contiguous last dim"):
        check_tensor("x", transposed, (4, 8), (torch.float32,), CPU)


class _Unprintable(int):
    """A size that raises when formatted: only a failing check may format the expected shape."""

    def __str__(self) -> str:
        raise AssertionError("the expected shape was formatted although the check passed")


def test_the_passing_path_formats_no_message():
    check_tensor("x", torch.zeros(4, 2), (_Unprintable(4), None), (torch.float32,), CPU)
