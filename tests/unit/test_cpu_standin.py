"""The CPU stand-in for sgl_kernel: implemented ops are right, the rest fail loudly."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest
import torch

from tangram_sglang.serving import STANDIN_DIR


@pytest.fixture(scope="module")
def standin():
    # Loaded under a private name so it never shadows a real sgl_kernel in this process.
    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_standin", STANDIN_DIR / "sgl_kernel" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_assign_req_to_token_pool_matches_reference(standin):
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    start, end = torch.tensor([1, 0, 5]), torch.tensor([4, 2, 6])
    locs = torch.arange(100, 106)
    standin.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, locs, 10)
    expected = torch.zeros(4, 10, dtype=torch.int32)
    expected[2, 1:4] = torch.tensor([100, 101, 102])
    expected[0, 0:2] = torch.tensor([103, 104])
    expected[3, 5:6] = torch.tensor([105])
    assert torch.equal(req_to_token, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_all_layer_kv_cache_copies_rows_read_before_write(standin, dtype):
    bufs = [torch.randn(8, 3, 4).to(dtype) for _ in range(3)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    tgt, src = torch.tensor([1, 2, 5]), torch.tensor([2, 5, 1])  # overlapping on purpose
    standin.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before, strict=True):
        expected = old.clone()
        expected[tgt] = old[src]
        assert torch.equal(b, expected)


def test_speculative_ops_raise_naming_the_op(standin):
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        standin.verify_tree_greedy_cpu()


def test_unknown_names_are_import_errors(standin):
    with pytest.raises(AttributeError, match="flash_attn"):
        standin.flash_attn  # noqa: B018


def _cpu_guarded_sgl_kernel_names() -> set[str]:
    """Names sglang imports from top-level ``sgl_kernel`` at module level under a CPU guard."""
    import sglang

    names: set[str] = set()

    def walk(node: ast.AST, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Try):
                continue
            if isinstance(child, ast.If):
                walk(child, guarded or "cpu" in ast.unparse(child.test).lower())
            elif isinstance(child, ast.ImportFrom) and child.module == "sgl_kernel" and guarded:
                names.update(alias.name for alias in child.names)
            else:
                walk(child, guarded)

    for path in pathlib.Path(sglang.__file__).parent.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:  # a few template files in the wheel are not Python
            continue
        walk(tree, False)
    return names


@pytest.mark.slow  # imports every CPU-guarded sglang module: ~40 s on a loaded 2-core CPU
def test_standin_covers_every_cpu_guarded_import_of_the_pinned_sglang(standin):
    needed = {n for n in _cpu_guarded_sgl_kernel_names() if n.endswith("_cpu")}
    assert needed == set(standin.ALL_OPS)
