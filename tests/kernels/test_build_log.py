"""``kernels.build_log``: a log line per Triton build of a Tangram kernel, hooks chained."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tangram_sglang.kernels import build_log
from tangram_sglang.kernels.build_log import BuildLog


def _fn(module: str, name: str):
    # the fields of triton.runtime.jit.JitFunctionInfo the hooks read
    return SimpleNamespace(module=module, name=name)


def test_a_build_of_a_tangram_kernel_is_logged_from_cache_miss_to_device_load(caplog):
    log = BuildLog()
    fn = _fn("tangram_sglang.kernels.kv_write", "_kv_write_kernel")
    with caplog.at_level("INFO", logger=build_log.__name__):
        for key in ("a", "b"):
            assert not log.start(key=key, fn=fn, repr="r")
            log.end(key=key, fn=fn, repr="r")
            assert not log.logged[2:]  # logged at the device load, not before
            log.loaded(None, None, "_kv_write_kernel", None, "hash")
    assert log.builds["kv_write._kv_write_kernel"] == 2
    assert [label for label, _, _ in log.logged] == ["kv_write._kv_write_kernel"] * 2
    assert all(total >= compile_ms >= 0 for _, total, compile_ms in log.logged)
    assert not log.started and not log.compiled
    assert "Triton built kv_write._kv_write_kernel in" in caplog.text
    assert "; build 2 of it in this process)" in caplog.text


def test_a_load_without_a_pending_build_is_not_logged():
    """A kernel loaded on the device with no build noted (another package's, or a build that
    an earlier hook skipped) logs nothing."""
    log = BuildLog()
    log.loaded(None, None, "_fwd_kernel", None, "hash")
    assert not log.logged


def test_other_packages_kernels_are_not_logged_and_earlier_hooks_still_run(caplog):
    seen = []
    log = BuildLog(
        lambda **kw: seen.append(("start", kw["fn"].name)),
        lambda **kw: seen.append(("end", kw["fn"].name)),
    )
    fn = _fn("sglang.srt.layers.attention.triton_ops", "_fwd_kernel")
    with caplog.at_level("INFO", logger=build_log.__name__):
        log.start(key="k", fn=fn)
        log.end(key="k", fn=fn)
        log.loaded(None, None, "_fwd_kernel", None, "hash")
    assert seen == [("start", "_fwd_kernel"), ("end", "_fwd_kernel")]
    assert not log.logged and "Triton built" not in caplog.text


def test_an_earlier_hook_that_skips_the_build_is_obeyed():
    """Triton skips a build when ``jit_cache_hook`` answers true; nothing is then pending."""
    log = BuildLog(lambda **kw: True, None)
    fn = _fn("tangram_sglang.kernels.kv_write", "_kv_write_kernel")
    assert log.start(key="k", fn=fn) is True
    assert not log.started


def test_install_is_once_per_process_and_keeps_triton_s_hooks(monkeypatch):
    from triton import knobs

    earlier = lambda **kw: None  # noqa: E731
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", earlier)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(knobs.runtime, "kernel_load_end_hook", knobs.HookChain(reversed=True))
    monkeypatch.setattr(build_log, "_installed", None)
    log = build_log.install()
    assert build_log.install() is log
    assert log.previous_start is earlier and log.previous_end is None
    assert knobs.runtime.jit_cache_hook == log.start
    assert knobs.runtime.jit_post_compile_hook == log.end
    assert knobs.runtime.kernel_load_end_hook.calls == [log.loaded]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton builds kernels only on CUDA")
def test_a_real_build_is_logged_once(monkeypatch):
    """The page-id kernel built in a fresh in-memory cache: one line; the same launch again with
    other entry counts (``do_not_specialize``): no further build."""
    from triton import knobs

    from tangram_sglang.kernels.history_attention import PagedHistoryIds
    from tangram_sglang.kernels.history_page_ids import _page_ids_kernel, write_layer_page_ids

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(knobs.runtime, "kernel_load_end_hook", knobs.HookChain(reversed=True))
    monkeypatch.setattr(build_log, "_installed", None)
    log = build_log.install()
    _page_ids_kernel.device_caches.clear()
    device = torch.device("cuda")
    maps = torch.zeros(1, 1, dtype=torch.int64, device=device)
    for nnz in (16, 17):
        ids = PagedHistoryIds(
            table=torch.zeros(1, dtype=torch.int32, device=device),
            head=torch.zeros(nnz, dtype=torch.int64, device=device),
            base=torch.zeros(nnz, dtype=torch.int64, device=device),
            group_offset=maps,
            column_of=maps,
            heads_per_group=1,
        )
        write_layer_page_ids(ids, 0, torch.empty(nnz, dtype=torch.int32, device=device))
    torch.cuda.synchronize()
    assert [label for label, _, _ in log.logged] == ["history_page_ids._page_ids_kernel"]
