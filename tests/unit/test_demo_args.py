"""The demo's server flags and banner without a server (the real servers: tests/e2e)."""

from __future__ import annotations

from tangram_sglang.demo import demo_server_args, server_banner


def test_full_kv_on_cuda_picks_triton_and_never_tangram():
    assert demo_server_args(True, "cuda", "p.json") == ["--attention-backend", "triton"]
    assert demo_server_args(True, "cpu", "p.json") == []  # serving.py adds torch_native on CPU


def test_tangram_args_carry_the_profile_when_given():
    assert demo_server_args(False, "cuda", None) == ["--tangram"]
    assert demo_server_args(False, "cpu", "p.json") == ["--tangram", "--tangram-profile", "p.json"]


def test_banner_names_the_profile_only_for_a_tangram_server():
    base = {"version": "0.5.17", "attention_backend": "triton", "dtype": "auto"}
    stock = server_banner({**base, "tangram": False})  # a stock server reports the flag
    assert stock == ["server up: sglang 0.5.17, attention backend triton, KV dtype auto"]
    info = {**base, "tangram": {"profile_path": "p.json", "mean_kept_ratio": 0.31,
                                "num_head_groups": 14}}  # fmt: skip
    assert server_banner(info)[1] == "Tangram profile p.json: mean kept ratio 0.310, 14 head groups"
