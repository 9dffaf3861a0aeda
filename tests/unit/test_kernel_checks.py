"""``kernels._checks.check_tensor``: every failure names the argument and the fix; a tensor that
meets the contract passes (the check runs on every kernel launch, so its passing path only reads
metadata)."""

from __future__ import annotations

import pytest
import torch

from tangram_sglang.errors import KernelError
from tangram_sglang.kernels._checks import CheckedLayouts, check_tensor, layout_key, run_once

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


def test_layout_key_tells_apart_every_property_a_check_reads():

    base = torch.zeros(4, 6)
    key = layout_key((base, 0.5))
    assert layout_key((torch.ones(4, 6), 0.5)) == key  # values are not read by any check
    for other in (
        (torch.zeros(4, 7), 0.5),  # shape
        (torch.zeros(4, 6, dtype=torch.float16), 0.5),  # dtype
        (torch.zeros(4, 6, device="meta"), 0.5),  # device
        (torch.zeros(6, 4).t(), 0.5),  # strides
        (base, 0.25),  # a scalar argument
        (base, 1),  # its type: 1 and 1.0 (and True) differ
        (base,),  # arity
    ):
        assert layout_key(other) != key, other
    assert layout_key((1,)) != layout_key((True,))


def test_run_once_remembers_only_layouts_whose_checks_passed():

    calls = []

    def check(x, scale):
        calls.append(scale)
        check_tensor("x", x, (None, 2), (torch.float32,), CPU)
        if scale <= 0:
            raise KernelError("scale must be > 0")
        return x.shape[0]

    checked = CheckedLayouts(capacity=2)
    assert run_once(checked, check, (torch.zeros(3, 2), 1.0)) == 3
    assert run_once(checked, check, (torch.ones(3, 2), 1.0)) == 3  # remembered: not run
    assert calls == [1.0]
    for _ in range(2):  # refused every time: a failed layout is never remembered
        with pytest.raises(KernelError, match="scale"):
            run_once(checked, check, (torch.zeros(3, 2), -1.0))
        with pytest.raises(KernelError, match="x has dtype"):
            run_once(checked, check, (torch.zeros(3, 2, dtype=torch.int32), 1.0))
    assert len(checked) == 1
    assert run_once(None, check, (torch.zeros(3, 2), 1.0)) == 3  # None: checked each call
    assert calls.count(1.0) == 4
    run_once(checked, check, (torch.zeros(5, 2), 1.0))
    run_once(checked, check, (torch.zeros(6, 2), 1.0))  # capacity 2: the oldest (3, 2) goes
    assert len(checked) == 2
    before = len(calls)
    run_once(checked, check, (torch.zeros(3, 2), 1.0))
    assert len(calls) == before + 1
    with pytest.raises(ValueError, match="capacity"):
        CheckedLayouts(capacity=0)


def test_run_once_checks_an_argument_without_a_key_every_time():
    """An unhashable argument (a list as the scale) cannot be remembered: the checks run and
    name it, with or without a memo."""
    from tangram_sglang.kernels._checks import check_sm_scale

    def check(x, scale):
        check_tensor("x", x, (None,), (torch.float32,), CPU)
        check_sm_scale(scale)

    checked = CheckedLayouts()
    for memo in (checked, None):
        with pytest.raises(KernelError, match="sm_scale"):
            run_once(memo, check, (torch.zeros(2), [0.1]))
    assert len(checked) == 0
