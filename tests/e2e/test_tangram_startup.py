"""Start-up of the real ``python -m sglang.launch_server --tangram`` on CPU (patched sglang).

Bad inputs stop the server before it serves, with the message naming the problem; a good
profile starts it on the ``tangram`` attention backend and ``/server_info`` shows the Tangram
settings (ServerArgs fields plus the scheduler's resolved summary and pool numbers).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tangram_sglang.errors import TangramError
from tangram_sglang.grouping import HeadGrouping
from tangram_sglang.profile import BudgetProfile, ModelIdentity
from tangram_sglang.serving import SGLangServer

pytestmark = pytest.mark.e2e


def write_profile(path, model: ModelIdentity) -> str:
    ratio = np.full((model.num_layers, model.num_kv_heads), 0.5)
    BudgetProfile(
        model=model,
        scorer="ada-snapkv",
        target_ratio=0.5,
        ratio=ratio,
        sink_tokens=4,
        recent_window=8,
        grouping=HeadGrouping.build(ratio, model.num_kv_heads, "global"),
    ).save(path)
    return str(path)


@pytest.fixture(scope="module")
def smollm2_identity(smollm2_path):
    return ModelIdentity.from_hf_config(json.loads((smollm2_path / "config.json").read_text()))


def start_fails(smollm2_path, args, log_path) -> str:
    server = SGLangServer(smollm2_path, args=args, log_path=log_path, startup_timeout_s=300)
    with pytest.raises(TangramError, match="exited with code"):
        server.start()
    server.stop()
    return server.log_path.read_text()


def test_profile_for_another_model_refuses_to_start(smollm2_path, tmp_path):
    other = ModelIdentity(
        "LlamaForCausalLM", num_layers=4, num_kv_heads=3, num_qo_heads=9, head_dim=64
    )
    profile = write_profile(tmp_path / "other.json", other)
    log = start_fails(
        smollm2_path, ["--tangram", "--tangram-profile", profile], tmp_path / "server.log"
    )
    assert "ProfileError" in log
    assert "model.num_layers=4 but the served model has 30" in log
    assert "python -m tangram_sglang.calibrate" in log


def test_incompatible_flag_refuses_to_start(smollm2_path, tmp_path, smollm2_identity):
    profile = write_profile(tmp_path / "good.json", smollm2_identity)
    log = start_fails(
        smollm2_path,
        ["--tangram", "--tangram-profile", profile, "--enable-mixed-chunk"],
        tmp_path / "server.log",
    )
    assert "ConfigError: --enable-mixed-chunk True cannot be combined with --tangram" in log


def test_valid_tangram_setup_starts_with_the_tangram_backend(
    smollm2_path, tmp_path, smollm2_identity
):
    """Flags and profile are valid: the server starts on the compressing backend and says so."""
    profile = write_profile(tmp_path / "good.json", smollm2_identity)
    args = [
        "--tangram",
        "--tangram-profile",
        profile,
        "--tangram-page-size",
        "8",
        "--tangram-target-ratio",
        "0.4",
    ]
    with SGLangServer(smollm2_path, args=args, log_path=tmp_path / "server.log") as server:
        info = server.server_info()
    assert info["tangram_page_size"] == 8 and info["tangram_target_ratio"] == 0.4
    assert info["attention_backend"] == "tangram" and info["disable_radix_cache"] is False
    assert info["radix_cache_backend"] == "tangram"  # reuse of compressed history, by default
    summary = info["tangram"]  # the scheduler's resolved summary, with the pool
    assert summary["page_size"] == 8 and summary["mean_kept_ratio"] == pytest.approx(0.4)
    start = summary["pool_at_start"]  # the live pool is internal_states[0]["tangram_pool"]
    assert start["pages_used"] == 0 and start["pages_total"] > 0
    log = server.log_path.read_text()
    assert "Tangram KV pool:" in log and "full-size token K/V buffers not allocated" in log
    assert "impl=TangramRadixCache" in log  # SGLang built the tangram radix cache backend
