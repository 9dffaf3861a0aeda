"""``python -m tangram_sglang.eval``: every bad flag exits 2 naming the flag, before any model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram_sglang.eval.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--num-samples", "0"], "--num-samples"),
        (["--num-turns", "-1"], "--num-turns"),
        (["--lengths", "1024,0"], "--lengths"),
        (["--depths", "0.5,7"], "--depths"),
        (["--threads", "-1"], "--threads"),
        (["--skip", "4", "--num-samples", "4"], "--skip must lie in"),
        (["--server-args", '"x'], "--server-args '\"x': No closing quotation"),
        (["--ratios", "0"], "--ratios must lie in (0, 1]"),
        (["--task", "nope"], "--task 'nope' is unknown"),
        (["--systems", "nope"], "--systems: 'nope' is not a system; use a subset of"),
        (
            ["--systems", "full,kvzip-head-alloc,kvzip-lite-head"],
            "did you mean 'kvzip-lite-head-alloc'",
        ),
        (
            ["--systems", "full,expected-atention"],
            "did you mean 'expected-attention'",
        ),
        (["--systems", "full kvzip"], "'full kvzip' is not a system; separate the systems with"),
        (["--systems", "full;kvzip"], "separate the systems with commas"),
        (["--server-args", "--chunked-prefill-size 64"], "--chunked-prefill-size is set by"),
        (["--lengths", "1024,16000"], "--lengths 16000: contexts must stay under"),
        (["--device", "cuda", "--threads", "2"], "--threads sets CPU threads"),
        (["--server-args", "--dtype float16"], "--dtype is set by the harness"),
        (["--grid-cell", "0"], "--grid-cell must be >= 1"),
        (["--systems", "tangram-grid", "--grid-cell", "128"], "would compress nothing"),
        (
            ["--systems", "tangram-grid", "--grid-cell", "512", "--lengths", "256"],
            "longer than every document",
        ),
        (
            [
                "--systems",
                "tangram-grid",
                "--grid-cell",
                "300",
                "--server-args=--tangram-min-compress-tokens 400",
            ],
            "--tangram-min-compress-tokens (400)",
        ),
        (
            ["--server-args", "--tangram-min-compress-tokens x"],
            "--tangram-min-compress-tokens 'x' must be a whole number >= 0",
        ),
        (
            ["--systems", "tangram-grid", "--server-args=--tangram-min-compress-tokens=-3"],
            "--tangram-min-compress-tokens '-3' must be a whole number >= 0",
        ),
        (
            ["--server-args=--tangram-min-compress-tokens"],
            "--tangram-min-compress-tokens '' must be a whole number >= 0",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, match):
    assert main(["--model", "smollm2", *argv]) == 2
    assert match in capsys.readouterr().err


def test_a_missing_profile_of_a_selected_system_is_named_before_any_model(
    capsys, tmp_path, smollm2_path
):
    """A profile folder without kvzip-lite profiles: the default systems (which include
    tangram-kvzip-lite) stop at once naming the system; leaving it out passes the check."""
    import shutil

    for name in ("ada-snapkv-r0.25.json", "ada-snapkv-r0.5.json"):
        shutil.copy(REPO / "calibration" / "smollm2" / name, tmp_path / name)
    argv = ["--model", "smollm2", "--profile-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no kvzip-lite-r<ratio>.json profile (tangram-kvzip-lite's budget)" in err
    assert "leave tangram-kvzip-lite out of --systems" in err
    from tangram_sglang.eval.cli import config_from_args, parse_args

    cfg = config_from_args(parse_args([*argv, "--systems", "full,tangram"]))
    assert cfg.systems == ("full", "tangram")
    assert main([*argv, "--systems", "full,kvzip-budgets"]) == 2  # its budgets: kvzip-lite's
    assert "no kvzip-lite-r<ratio>.json profile (kvzip-budgets's budget)" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--model", "smollm2", "--profile-dir", str(empty), "--systems", "full"]) == 2
    assert "no ada-snapkv-r<ratio>.json profile (every compressed system's budget)" in (
        capsys.readouterr().err
    )


def test_profiles_are_read_by_their_ratio_and_must_hold_the_scorer_they_are_named_for(
    tmp_path, smollm2_path, capsys
):
    """A stray ``<scorer>-r<not a number>.json`` is not a profile of the folder; a file named
    for one scorer that holds another's profile is refused, not run as the other scorer."""
    import shutil

    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.runner import profile_candidates, shipped_profile

    src = REPO / "calibration" / "smollm2"
    shutil.copy(src / "kvzip-lite-r0.5.json", tmp_path / "kvzip-lite-r0.5.json")
    shutil.copy(src / "kvzip-lite-r0.5.json", tmp_path / "kvzip-lite-r0.5.bak.json")
    assert profile_candidates(tmp_path, "kvzip-lite") == {0.5: tmp_path / "kvzip-lite-r0.5.json"}
    assert shipped_profile(tmp_path, 0.5, smollm2_path, "kvzip-lite").scorer == "kvzip-lite"
    for stray in ("kvzip-lite-rnan.json", "kvzip-lite-r0_5.json", "kvzip-lite-r2.json"):
        shutil.copy(src / "kvzip-lite-r0.5.json", tmp_path / stray)
    assert list(profile_candidates(tmp_path, "kvzip-lite")) == [0.5]
    shutil.copy(src / "kvzip-lite-r0.5.json", tmp_path / "kvzip-lite-r0.50.json")
    with pytest.raises(ConfigError, match="are both the kvzip-lite profile of ratio 0.5"):
        profile_candidates(tmp_path, "kvzip-lite")
    (tmp_path / "kvzip-lite-r0.50.json").unlink()
    shutil.copy(src / "ada-snapkv-r0.25.json", tmp_path / "kvzip-lite-r0.25.json")
    mismatch = "holds a profile of scorer 'ada-snapkv', not 'kvzip-lite'"
    with pytest.raises(ConfigError, match=mismatch):
        shipped_profile(tmp_path, 0.5, smollm2_path, "kvzip-lite")
    # the CLI says so before any model loads
    shutil.copy(src / "ada-snapkv-r0.5.json", tmp_path / "ada-snapkv-r0.5.json")
    argv = ["--model", "smollm2", "--profile-dir", str(tmp_path), "--systems", "full,kvzip-budgets"]
    assert main(argv) == 2
    assert mismatch in capsys.readouterr().err


def test_repeated_systems_and_ratios_run_once(smollm2_path):
    from tangram_sglang.eval.cli import config_from_args, parse_args

    argv = ["--model", "smollm2", "--systems", "full, tangram,full", "--ratios", "0.5,0.50"]
    cfg = config_from_args(parse_args(argv))
    assert cfg.systems == ("full", "tangram") and cfg.ratios == (0.5,)


def test_unknown_model_is_named_as_such(capsys):
    assert main(["--model", "nosuch"]) == 2
    assert "--model 'nosuch': not an embedded model" in capsys.readouterr().err


def test_unknown_protocol_or_device_is_refused_by_argparse(capsys):
    for argv in (["--protocol", "nope"], ["--device", "tpu"]):
        with pytest.raises(SystemExit) as exc:
            main(["--model", "smollm2", *argv])
        assert exc.value.code == 2
        assert f"argument {argv[0]}: invalid choice" in capsys.readouterr().err


def test_cuda_without_a_gpu_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert main(["--model", "smollm2", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


def _cfg(smollm2_path, **kw):
    from tangram_sglang.eval.runner import RunConfig

    base = dict(
        model="smollm2",
        model_dir=smollm2_path,
        profile_dir=smollm2_path,
        tasks=("needle",),
        ratios=(0.5,),
        num_samples=1,
        lengths=(512,),
        depths=(0.5,),
        num_turns=1,
        systems=("full",),
        seed=0,
        json_path=None,
    )
    return RunConfig(**{**base, **kw})


def test_cuda_servers_get_bfloat16_and_the_stock_one_the_triton_backend(smollm2_path):
    from tangram_sglang.eval.runner import server_flags

    cpu = _cfg(smollm2_path, server_args=("--mem-fraction-static", "0.85"))
    assert server_flags(cpu, tangram=False) == [
        "--mem-fraction-static",
        "0.85",
        "--chunked-prefill-size",
        "16384",
    ]  # SGLangServer adds the CPU engine's float32
    assert cpu.dtype == "float32"
    cuda = _cfg(smollm2_path, device="cuda", chunked_prefill_tokens=17000)
    stock, tangram = server_flags(cuda, tangram=False), server_flags(cuda, tangram=True)
    for flags in (stock, tangram):
        assert flags[flags.index("--dtype") + 1] == "bfloat16" == cuda.dtype
        assert flags[flags.index("--chunked-prefill-size") + 1] == "17000"
    assert stock[stock.index("--attention-backend") + 1] == "triton"
    assert "--attention-backend" not in tangram  # --tangram picks its own backend
    mine = _cfg(smollm2_path, device="cuda", server_args=("--attention-backend", "flashinfer"))
    assert server_flags(mine, tangram=False).count("--attention-backend") == 1


def test_grid_systems_get_the_grid_cell_as_their_chunk_and_are_not_run_by_default(smollm2_path):
    from tangram_sglang.eval.runner import DEFAULT_SYSTEMS, SYSTEMS, server_flags

    cfg = _cfg(smollm2_path, grid_cell=256)
    grid, plain = server_flags(cfg, tangram=True, grid=True), server_flags(cfg, tangram=True)
    assert grid[grid.index("--chunked-prefill-size") + 1] == "256"
    assert plain[plain.index("--chunked-prefill-size") + 1] == "16384"
    assert {"tangram-grid", "tangram-kvzip-lite-grid"} <= set(SYSTEMS)
    assert not {"tangram-grid", "tangram-kvzip-lite-grid"} & set(DEFAULT_SYSTEMS)
    assert not {"expected-attention", "dynamic-ada-expected-attention"} & set(DEFAULT_SYSTEMS)
    assert {"expected-attention", "dynamic-ada-expected-attention"} <= set(SYSTEMS)


def test_only_grid_systems_get_the_grid_switch():
    from tangram_sglang.eval.runner import SYSTEMS, server_env

    assert server_env("tangram-grid") == {"TANGRAM_GRID_SEGMENTS": "1"}
    assert server_env("tangram-kvzip-lite-grid") == {"TANGRAM_GRID_SEGMENTS": "1"}
    for system in set(SYSTEMS) - {"tangram-grid", "tangram-kvzip-lite-grid"}:
        assert server_env(system) == {"TANGRAM_GRID_SEGMENTS": "0"}, system


def test_cuda_chunk_covers_the_longest_context_up_to_the_models_context(smollm2_path):
    import json

    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.cli import _chunk_tokens

    context = json.loads((smollm2_path / "config.json").read_text())["max_position_embeddings"]
    assert _chunk_tokens(context - 2048, "cuda", smollm2_path) == 16384
    assert _chunk_tokens(20000, "cpu", smollm2_path) == 21024  # (cpu: refused by the CLI)
    assert _chunk_tokens(context - 1024, "cuda", smollm2_path) == max(16384, context)
    with pytest.raises(ConfigError, match=f"--lengths {context}: contexts must stay under"):
        _chunk_tokens(context, "cuda", smollm2_path)


def test_resume_refuses_a_report_of_another_protocol(smollm2_path, tmp_path):
    import json

    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.runner import _resumed

    path = tmp_path / "acc.json"
    rec = _needle_record()
    rep = {"model": "smollm2", "config": {}, "samples": [], "records": [rec]}
    path.write_text(json.dumps(dict(rep, protocol="query-agnostic")))
    aware = _cfg(smollm2_path, json_path=path, resume=True, protocol="query-aware")
    with pytest.raises(
        ConfigError, match="--resume: .* --protocol query-agnostic, not query-aware"
    ):
        _resumed(aware, {"needle:0"}, print)
    path.write_text(json.dumps(dict(rep, protocol="query-aware")))
    assert _resumed(aware, {"needle:0"}, print) == ([rec], NOTHING_RECORDED)


def test_resume_refuses_a_report_of_another_device(smollm2_path, tmp_path):
    import json

    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.runner import _resumed

    path = tmp_path / "acc.json"
    rec = _needle_record()
    rep = {"model": "smollm2", "samples": [], "records": [rec], "protocol": "query-agnostic"}
    path.write_text(json.dumps(dict(rep, config={"device": "cpu", "dtype": "float32"})))
    cuda = _cfg(smollm2_path, json_path=path, resume=True, device="cuda")
    with pytest.raises(ConfigError, match="--resume: .* --device cpu, not cuda"):
        _resumed(cuda, {"needle:0"}, print)
    path.write_text(json.dumps(dict(rep, config={})))  # written before --device: cpu
    assert _resumed(_cfg(smollm2_path, json_path=path, resume=True), {"needle:0"}, print) == (
        [rec],
        NOTHING_RECORDED,
    )
    files = {"budgets": {"0.5": "calibration/smollm2/ada-snapkv-r0.5.json"}}
    path.write_text(json.dumps(dict(rep, config={"profile_files": files})))
    assert _resumed(_cfg(smollm2_path, json_path=path, resume=True), {"needle:0"}, print) == (
        [rec],
        dict(NOTHING_RECORDED, profile_files=files),
    )
    # this run's files join the report's; another file for one (system, ratio) stops the run
    # here, before any server starts, naming --resume and the report
    more = {"tangram": {"0.5": "calibration/smollm2/ada-snapkv-r0.5.json"}}
    resumed = _cfg(smollm2_path, json_path=path, resume=True)
    assert _resumed(resumed, {"needle:0"}, print, {"profile_files": more}) == (
        [rec],
        dict(NOTHING_RECORDED, profile_files=files | more),
    )
    other = {"budgets": {"0.5": "/elsewhere/ada-snapkv-r0.5.json"}}
    with pytest.raises(ConfigError, match=rf"^--resume: {path}: budgets at ratio 0.5 read"):
        _resumed(resumed, {"needle:0"}, print, {"profile_files": other})


def test_resume_keeps_and_checks_the_scorer_options_of_the_profiles(smollm2_path, tmp_path):
    """``--resume`` joins this run's ``profile_scorer_options`` with the report's, as it does
    ``profile_files``; a report whose profile had other scorer options for one (system, ratio)
    stops the run naming the options that differ and the fix; a report written before the
    field is resumed with this run's options (and says so in the log)."""
    import json

    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.runner import _resumed

    path = tmp_path / "acc.json"
    rec = _needle_record()
    rep = {"model": "smollm2", "samples": [], "records": [rec], "protocol": "query-agnostic"}
    files = {"tangram-kvzip-lite": {"0.5": "/tmp/pd-share/kvzip-lite-r0.5.json"}}
    shared = {"tangram-kvzip-lite": {"0.5": {"local_band": 32, "window_share": 0.25}}}
    config = {"profile_files": files, "profile_scorer_options": shared}
    path.write_text(json.dumps(dict(rep, config=config)))
    resumed = _cfg(smollm2_path, json_path=path, resume=True)
    assert _resumed(resumed, {"needle:0"}, print) == ([rec], config)  # survives --resume
    more = {"tangram": {"0.5": {"obs_window": 32}}}
    assert _resumed(resumed, {"needle:0"}, print, {"profile_scorer_options": more}) == (
        [rec],
        dict(config, profile_scorer_options=shared | more),
    )
    shipped = {"tangram-kvzip-lite": {"0.5": {"local_band": 32}}}  # the same path, other options
    with pytest.raises(ConfigError) as err:
        _resumed(resumed, {"needle:0"}, print, dict(config, profile_scorer_options=shipped))
    assert str(err.value) == (
        f"--resume: {path}: tangram-kvzip-lite at ratio 0.5 read a profile whose scorer "
        "options have window_share=0.25 in one run and a profile whose scorer options have "
        "window_share unset in another; run them with the same --profile-dir; pass that run's "
        "--profile-dir or use another --json"
    )
    path.write_text(json.dumps(dict(rep, config={"profile_files": files})))  # before the field
    logged: list[str] = []
    assert _resumed(resumed, {"needle:0"}, logged.append, config) == ([rec], config)
    assert "predates config.profile_scorer_options: what its 1 records" in logged[0]


def test_profiles_of_another_model_are_named_before_any_model_loads(
    tmp_path, smollm2_path, capsys, monkeypatch
):
    """Qwen2.5-0.5B's profiles under ``--model smollm2``: exit 2 naming the file, the model and
    ``--profile-dir`` (a JSON read, not a traceback after the tokenizer loads); a corrupt
    profile is named as such, not as another model's."""
    import shutil

    import tangram_sglang.eval.cli as cli

    def no_run(cfg):
        raise AssertionError("the run started: the check must come before any model loads")

    monkeypatch.setattr(cli, "run", no_run)
    qwen = REPO / "calibration" / "qwen2.5-0.5b"
    shutil.copy(qwen / "ada-snapkv-r0.25.json", tmp_path / "ada-snapkv-r0.25.json")
    argv = ["--model", "smollm2", "--profile-dir", str(tmp_path), "--systems", "full,tangram"]
    assert main([*argv, "--ratios", "0.25"]) == 2
    err = capsys.readouterr().err
    assert f"--profile-dir {tmp_path}: ada-snapkv-r0.25.json does not fit --model smollm2" in err
    assert "model.num_layers=24 but the served model has 30" in err
    assert "pass --profile-dir calibration/smollm2 (or leave --profile-dir out)" in err
    (tmp_path / "ada-snapkv-r0.25.json").write_text("{not json")
    assert main([*argv, "--ratios", "0.25"]) == 2
    err = capsys.readouterr().err
    assert "--profile-dir:" in err and "does not fit" not in err
    assert "or move it out of --profile-dir to use the nearest other ratio" in err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2')  # truncated
    shipped = str(REPO / "calibration" / "smollm2")
    argv = ["--model", str(model), "--profile-dir", shipped, "--systems", "full,tangram"]
    assert main(argv) == 2
    assert f"--model {model}: {model}/config.json is not a readable HF model config" in (
        capsys.readouterr().err
    )


def test_the_report_records_which_profile_file_each_system_read(tmp_path, smollm2_path):
    """``profile_files``: the nearest-ratio file of each system's scorer (the budgets' one
    when a kvpress press without a profile of its own runs), repository paths relative to its
    root; the report copies what the run recorded (no file read when it is written), and
    ``report.merge`` keeps the union of its reports' records and refuses two files for one
    (system, ratio)."""
    import shutil
    from dataclasses import replace

    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval import report
    from tangram_sglang.eval.cli import config_from_args, parse_args
    from tangram_sglang.eval.runner import profile_files

    systems = ("full", "tangram-kvzip-lite", "kvzip-budgets")
    src = "calibration/smollm2/"
    files = profile_files(REPO / src, (0.5, 0.3), systems)
    assert files == {  # no "budgets": no kvpress press without a profile of its own runs
        "tangram-kvzip-lite": {
            "0.5": src + "kvzip-lite-r0.5.json",
            "0.3": src + "kvzip-lite-r0.25.json",
        },
        "kvzip-budgets": {
            "0.5": src + "kvzip-lite-r0.5.json",
            "0.3": src + "kvzip-lite-r0.25.json",
        },
    }
    shutil.copy(REPO / src / "ada-snapkv-r0.5.json", tmp_path / "ada-snapkv-r0.5.json")
    assert profile_files(tmp_path, (0.5,), ("full", "full-hf")) == {}  # no profile read
    assert profile_files(tmp_path, (0.5,), ("full", "uniform-snapkv")) == {
        "budgets": {"0.5": str((tmp_path / "ada-snapkv-r0.5.json").resolve())}
    }
    cfg = config_from_args(parse_args(["--model", "smollm2", "--systems", ",".join(systems)]))
    assert report.build(cfg, [], [], 0.0)["config"]["profile_files"] is None  # not yet run
    ran = replace(cfg, profile_files=files)
    ran = replace(ran, profile_dir=tmp_path / "nowhere")  # the report reads no profile folder
    first = report.build(ran, [], [], 0.0)
    assert first["config"]["profile_files"] == files
    later = {"tangram": {"0.25": src + "ada-snapkv-r0.25.json"}}
    later["kvzip-budgets"] = {"0.25": src + "kvzip-lite-r0.25.json"}
    second = report.build(replace(ran, profile_files=later), [], [], 0.0)
    merged = report.merge([first, second])["config"]["profile_files"]
    assert merged["tangram"] == later["tangram"]
    assert merged["kvzip-budgets"] == {**files["kvzip-budgets"], **later["kvzip-budgets"]}
    old = report.build(replace(ran, profile_files=None), [], [], 0.0)  # before the field
    assert report.merge([old, first])["config"]["profile_files"] == files
    clash = {"kvzip-budgets": {"0.5": "elsewhere/kvzip-lite-r0.5.json"}}
    with pytest.raises(ConfigError, match="kvzip-budgets at ratio 0.5 read calibration/smollm2/"):
        report.merge([first, report.build(replace(ran, profile_files=clash), [], [], 0.0)])
    with pytest.raises(ConfigError, match="config.profile_files must map each system"):
        report.merge([first, report.build(replace(ran, profile_files={"x": ["bad"]}), [], [], 0.0)])


def test_the_report_records_the_scorer_options_of_each_profile_file(tmp_path, smollm2_path):
    """``profile_scorer_options``: the ``provenance.scorer_options`` of each file that
    ``profile_files`` names (a copy of the profiles with ``window_share`` set says so after the
    copy is gone; kvzip-gate's fitted weights as a digest); the report copies the run's record,
    ``report.merge`` keeps the union, merges reports written before the field (None) and refuses
    two runs whose profiles had different options for one (system, ratio), naming both."""
    import json
    import shutil
    from dataclasses import fields, replace

    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval import report
    from tangram_sglang.eval.cli import config_from_args, parse_args
    from tangram_sglang.eval.runner import profile_files, profile_scorer_options

    src = REPO / "calibration" / "smollm2"
    systems = ("full", "tangram-kvzip-lite", "tangram-kvzip-gate", "uniform-snapkv")
    shipped = profile_scorer_options(src, (0.5,), systems)
    assert shipped.keys() == profile_files(src, (0.5,), systems).keys()
    assert shipped["budgets"]["0.5"] == {  # the file's own dict, alpha_safeguard included
        "obs_window": 32,
        "kernel_size": 5,
        "pooling": "avg",
        "gqa_reduce": "mean",
        "alpha_safeguard": 0.2,
    }
    lite = shipped["tangram-kvzip-lite"]["0.5"]
    assert "window_share" not in lite and lite["local_band"] == 32
    weights = shipped["tangram-kvzip-gate"]["0.5"]["weights"]  # ~100 KB of floats: a digest
    assert isinstance(weights, str) and weights.startswith("sha256:") and len(weights) == 23
    share = tmp_path / "pd-share"
    shutil.copytree(src, share)
    for path in share.glob("kvzip-lite-r*.json"):
        profile = json.loads(path.read_text())
        profile["provenance"]["scorer_options"]["window_share"] = 0.25
        path.write_text(json.dumps(profile))
    options = profile_scorer_options(share, (0.5,), systems)
    assert options["tangram-kvzip-lite"]["0.5"] == dict(lite, window_share=0.25)
    assert {s: v for s, v in options.items() if s != "tangram-kvzip-lite"} == {
        s: v for s, v in shipped.items() if s != "tangram-kvzip-lite"
    }

    cfg = config_from_args(parse_args(["--model", "smollm2", "--systems", ",".join(systems)]))
    assert set(report.PER_RATIO_FIELDS) <= {f.name for f in fields(cfg)}  # run() sets them
    assert report.build(cfg, [], [], 0.0)["config"]["profile_scorer_options"] is None
    ran = replace(cfg, profile_dir=tmp_path / "nowhere", profile_scorer_options=options)
    first = report.build(ran, [], [], 0.0)  # the report reads no profile folder
    assert first["config"]["profile_scorer_options"] == options
    later = {"tangram": {"0.25": {"obs_window": 32}}}
    second = report.build(replace(ran, profile_scorer_options=later), [], [], 0.0)
    assert report.merge([first, second])["config"]["profile_scorer_options"] == options | later
    old = report.build(replace(ran, profile_scorer_options=None), [], [], 0.0)
    del old["config"]["profile_scorer_options"]  # a report written before the field
    assert report.merge([old, first])["config"]["profile_scorer_options"] == options
    assert report.merge([old, old])["config"]["profile_scorer_options"] is None
    clash = report.build(replace(ran, profile_scorer_options=shipped), [], [], 0.0)
    with pytest.raises(ConfigError) as err:
        report.merge([first, clash])
    assert str(err.value) == (
        "tangram-kvzip-lite at ratio 0.5 read a profile whose scorer options have "
        "window_share=0.25 in one run and a profile whose scorer options have window_share "
        "unset in another; run them with the same --profile-dir"
    )
    bad = replace(ran, profile_scorer_options={"tangram": {"0.5": 0.25}})
    with pytest.raises(ConfigError, match="config.profile_scorer_options must map each system"):
        report.merge([first, report.build(bad, [], [], 0.0)])


# what _resumed returns of a run that recorded nothing of its profiles (not resumed, or joined
# with a report written before the fields)
NOTHING_RECORDED = {"profile_files": None, "profile_scorer_options": None}


def _needle_record() -> dict:
    """One record as ``python -m tangram_sglang.eval --json`` writes it (report.RECORD_TYPES)."""
    return {
        "task": "needle",
        "sample_id": "needle:0",
        "turn": 0,
        "system": "full",
        "ratio": None,
        "contains_answer": 1.0,
        "exact_match": 1.0,
        "kept_fraction": 1.0,
        "cached_tokens": 0,
    }
