"""``kernels.build_log``: a log line per Triton build of a Tangram kernel, hooks chained."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tangram_sglang.kernels import build_log
from tangram_sglang.kernels.build_log import BuildLog


def _fn(module: str, name: str, compiled: dict | None = None):
    """The fields of ``triton.runtime.jit.JitFunctionInfo`` the hooks read; ``compiled``: the
    JIT function's in-memory cache on device 0 (specialisation key -> compiled kernel)."""
    jit = SimpleNamespace(device_caches={0: (compiled if compiled is not None else {},)})
    return SimpleNamespace(module=module, name=name, jit_function=jit)


def _build(log: BuildLog, fn, key: str, **extra) -> None:
    """Triton's two build hooks, as ``JITFunction._do_compile`` calls them."""
    assert not log.start(key=key, fn=fn, repr="r", compile={"device": 0}, **extra)
    log.end(key=key, fn=fn, repr="r", compile={"device": 0}, **extra)


def test_a_build_of_a_tangram_kernel_is_logged_from_cache_miss_to_device_load(caplog):
    log = BuildLog()
    compiled = {}
    fn = _fn("tangram_sglang.kernels.kv_write", "_kv_write_kernel", compiled)
    with caplog.at_level("INFO", logger=build_log.__name__):
        for i, key in enumerate(("a", "b")):
            compiled[key] = SimpleNamespace(hash=f"hash-{key}")
            _build(log, fn, key)
            assert len(log.logged) == i  # not before the device load
            log.loaded(None, None, "_kv_write_kernel", None, f"hash-{key}")
            assert len(log.logged) == i + 1
    assert log.builds["kv_write._kv_write_kernel"] == 2
    assert [label for label, _, _ in log.logged] == ["kv_write._kv_write_kernel"] * 2
    assert all(total >= compile_ms >= 0 for _, total, compile_ms in log.logged)
    assert not log.started and not log.loading
    assert "Triton built kv_write._kv_write_kernel in" in caplog.text
    assert "; build 2 of it in this process)" in caplog.text


def test_a_build_without_a_launch_is_logged_at_its_compile():
    """Triton's ``warmup`` compiles without loading; a kernel missing from the cache (no hash
    to wait for) is logged at its compile too."""
    log = BuildLog()
    fn = _fn(
        "tangram_sglang.kernels.kv_write", "_kv_write_kernel", {"a": SimpleNamespace(hash="h")}
    )
    _build(log, fn, "a", is_manual_warmup=True)
    _build(log, fn, "not-in-cache")
    assert [label for label, _, _ in log.logged] == ["kv_write._kv_write_kernel"] * 2
    assert not log.loading


def test_loads_match_builds_by_hash_not_by_name():
    """Another module's kernel of the same name, or a load with no build waiting, logs nothing;
    a build whose load never came (a failed launch) is not matched to a later load."""
    log = BuildLog()
    fn = _fn("tangram_sglang.kernels.kv_write", "_kernel", {"a": SimpleNamespace(hash="ours")})
    _build(log, fn, "a")
    log.loaded(None, None, "_kernel", None, "theirs")
    assert not log.logged
    log.loaded(None, None, "_kernel", None, "ours")
    assert len(log.logged) == 1


def test_a_failing_load_hook_never_raises_and_says_so_once(caplog):
    log = BuildLog()
    log.loading = None  # anything that makes the lookup fail
    with caplog.at_level("WARNING", logger=build_log.__name__):
        log.loaded(None, None, "k", None, "h")
        log.loaded(None, None, "k", None, "h")
    assert caplog.text.count("the Triton build log failed") == 1


def test_other_packages_kernels_are_not_logged_and_earlier_hooks_still_run(caplog):
    seen = []
    log = BuildLog(
        lambda **kw: seen.append(("start", kw["fn"].name)),
        lambda **kw: seen.append(("end", kw["fn"].name)),
    )
    fn = _fn(
        "sglang.srt.layers.attention.triton_ops", "_fwd_kernel", {"k": SimpleNamespace(hash="h")}
    )
    with caplog.at_level("INFO", logger=build_log.__name__):
        _build(log, fn, "k")
        log.loaded(None, None, "_fwd_kernel", None, "h")
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
    assert knobs.runtime.kernel_load_end_hook.calls == [log.loaded] and log.load_hook


def test_install_without_a_load_hook_chain_logs_at_compile(monkeypatch, caplog):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(knobs.runtime, "kernel_load_end_hook", None)
    monkeypatch.setattr(build_log, "_installed", None)
    with caplog.at_level("WARNING", logger=build_log.__name__):
        log = build_log.install()
    assert not log.load_hook and "not a HookChain" in caplog.text
    fn = _fn(
        "tangram_sglang.kernels.kv_write", "_kv_write_kernel", {"a": SimpleNamespace(hash="h")}
    )
    _build(log, fn, "a")
    assert len(log.logged) == 1


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
