"""End-to-end calibration on the real SmolLM2 (CPU, a few short samples; the CI calibration run)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tangram_sglang.calibrate.cli import _check_output, build_parser, resolve_device
from tangram_sglang.calibrate.cli import main as calibrate_main
from tangram_sglang.calibrate.observe import ScoreObserver
from tangram_sglang.calibrate.show import main as show_main
from tangram_sglang.errors import ConfigError
from tangram_sglang.profile import BudgetProfile, ModelIdentity
from tangram_sglang.scoring import SnapKVScorer

REPO = Path(__file__).resolve().parents[2]

TINY = [
    "--num-samples",
    "2",
    "--dataset",
    "sharegpt",
    "--min-tokens",
    "96",
    "--max-tokens",
    "128",
    "--device",
    "cpu",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    return model.eval()


def test_observer_sees_post_rope_queries_and_keys(smollm2):
    """Scores from the captured q/k equal SnapKV recomputed from HF's own attention weights."""
    ids = torch.randint(100, 20000, (1, 48), generator=torch.Generator().manual_seed(0))
    scorer = SnapKVScorer(obs_window=8, kernel_size=5)
    ours = ScoreObserver(smollm2, scorer).scores(ids[0].tolist())
    smollm2.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = smollm2.model(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        smollm2.config._attn_implementation = "sdpa"
    for layer in (0, 17, 29):
        probs = out.attentions[layer][0, :, -8:, :-8]  # [Hq, w, n - w]
        pooled = F.avg_pool1d(probs.mean(1)[:, None], 5, stride=1, padding=2)[:, 0]
        expected = pooled.reshape(3, 3, -1).mean(1)  # GQA: 3 query heads per KV head
        np.testing.assert_allclose(ours[layer, :, :-8], expected.numpy(), rtol=1e-4, atol=1e-6)
        assert (ours[layer, :, -8:] > ours[layer, :, :-8].max()).all()


@pytest.mark.slow  # a real 2-sample calibration on CPU: ~25 s
def test_tiny_calibration_run_writes_a_valid_profile(smollm2_path, tmp_path, capsys):
    out = tmp_path / "smollm2" / "ada-snapkv-r0.25.json"
    cache = tmp_path / "cache"
    args = [
        "--model-path",
        str(smollm2_path),
        "--scorer",
        "ada-snapkv",
        "--target-ratio",
        "0.25",
        "--page-group-size",
        "4",
        "--scope",
        "global",
        "--cache-dir",
        str(cache),
    ]
    assert calibrate_main([*args, *TINY, "--output", str(out)]) == 0
    profile = BudgetProfile.load(out)
    config = json.loads((smollm2_path / "config.json").read_text())
    profile.check_model(ModelIdentity.from_hf_config(config))
    assert profile.ratio.shape == (30, 3) and profile.grouping.heads_per_group == 4
    assert profile.stats.num_samples == 2
    # AdaKV redistributes a fixed layer budget: the mean observed retention is the target.
    assert profile.stats.mean.mean() == pytest.approx(0.25, abs=0.02)
    assert (profile.ratio >= np.minimum(profile.stats.mean, 1.0) - 1e-12).all()
    assert profile.ratio.std() > 0  # heads differ: the allocation is per head
    prov = profile.provenance
    assert prov["num_samples"] == 2 and prov["allocation"] == "layer"
    assert 96 <= prov["sample_tokens"]["min"] <= prov["sample_tokens"]["max"] <= 128
    assert {"spearman_mean", "padding_waste", "expected_kept_fraction_groups"} <= set(
        prov["stability"]
    )
    assert len(list(cache.rglob("*.npy"))) == 2  # per-sample scores cached (resume)
    assert "Spearman" in capsys.readouterr().out

    # Same samples, another scorer of the family: scores come from the cache.
    snap = tmp_path / "snapkv.json"
    args[3] = "snapkv"
    assert calibrate_main([*args, *TINY, "--output", str(snap)]) == 0
    snap_profile = BudgetProfile.load(snap)
    assert snap_profile.provenance["allocation"] == "global"
    assert snap_profile.provenance["timing_s"]["observe_total"] < 1.0

    png = tmp_path / "plot.png"
    assert show_main(["show", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bad_arguments_fail_before_running_and_write_nothing(smollm2_path, tmp_path, capsys):
    out = tmp_path / "p.json"
    args = [
        "--model-path",
        str(smollm2_path),
        "--scorer",
        "snapkv",
        "--target-ratio",
        "0.25",
        "--output",
        str(out),
        *TINY,
    ]
    assert calibrate_main([*args, "--page-group-size", "2", "--scope", "per_layer"]) == 2
    err = capsys.readouterr().err
    assert "--page-group-size 2 does not divide the model's 3 KV heads" in err
    assert "--scope per_layer needs; pick one of 1, 3 or use --scope global" in err
    assert calibrate_main([*args, "--page-group-size", "7", "--scope", "per_layer"]) == 2
    assert "--page-group-size 7 does not divide" in capsys.readouterr().err
    assert calibrate_main([*args[:5], "1.5", *args[6:]]) == 2
    assert "--target-ratio 1.5" in capsys.readouterr().err
    assert calibrate_main([*args, "--dataset", "nope"]) == 2
    assert not out.exists()


def test_show_rejects_a_bad_profile(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 7}')
    assert show_main(["show", str(bad)]) == 2
    assert "schema_version" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--floor", "0"], "--floor 0.0 must be in (0, 1]"),
        (["--alpha", "nan"], "--alpha nan a finite number"),
        (["--num-samples", "0"], "--num-samples 0 must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens 0 must be >= 1"),  # used to mean "the default"
        (["--min-tokens", "4000", "--max-tokens", "100"], "--min-tokens 4000 > --max-tokens 100: "),
        (["--sink-tokens", "-1"], "--sink-tokens -1 must be >= 0"),
        (["--recent-window", "-1"], "--recent-window -1 must be >= 0"),
        (["--page-group-size", "0"], "--page-group-size 0 must be >= 1"),
        (["--obs-window", "0"], "obs_window=0 must be >= 1"),
        (["--output", "{tmp}/file.txt/p.json"], "is not a writable folder"),
        (["--output", "{tmp}"], "is a folder"),
        (["--device", "gpu"], "--device 'gpu' is not a device; use one of cpu, cuda, cuda:N"),
        (["--device", "cuda:x"], "--device 'cuda:x' is not a device"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_flags_are_reported_before_the_model_is_looked_up(tmp_path, capsys, extra, message):
    """These used to surface only after every sample was observed (hours on a CPU)."""
    (tmp_path / "file.txt").write_text("x")
    args = ["--model-path", str(tmp_path / "no-model"), "--scorer", "snapkv"]
    args += ["--target-ratio", "0.25", "--output", str(tmp_path / "p.json")]
    assert calibrate_main([*args, *(a.format(tmp=tmp_path) for a in extra)]) == 2
    err = capsys.readouterr().err
    assert message in err and "--model-path" not in err


def test_flag_errors_come_before_transformers_is_imported(tmp_path):
    """A bad flag is reported in about a second, not after transformers' import (7-9 s)."""
    import subprocess
    import sys

    code = (
        "import sys; from tangram_sglang.calibrate.cli import main; "
        "rc = main(sys.argv[1:]); assert 'transformers' not in sys.modules, 'imported'; "
        "sys.exit(rc)"
    )
    argv = ["--model-path", "smollm2", "--scorer", "snapkv", "--target-ratio", "0.25"]
    argv += ["--min-tokens", "4000", "--max-tokens", "100", "--output", str(tmp_path / "p.json")]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --min-tokens 4000 > --max-tokens 100: ")


def test_min_tokens_above_the_default_max_tokens_names_both_flags(tmp_path, capsys):
    """Without --max-tokens the cap is the model's context (at most 8192), known from its config."""
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "max_position_embeddings": 512,
    }
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "p.json"
    args = ["--model-path", str(model), "--scorer", "snapkv", "--target-ratio", "0.25"]
    assert calibrate_main([*args, "--output", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--min-tokens 1024 > 512, the default --max-tokens for this model" in err
    assert "num_samples=" not in err and not out.exists()


def test_help_gives_every_flag_a_text_and_its_default_once():
    """--help used to print "(default: ... see observe.py) (default: None)" and a
    "(default: None)" on required flags (ArgumentDefaultsHelpFormatter over hand-written text)."""
    parser = build_parser()
    text = parser.format_help()
    assert "(default: None)" not in text and "observe.py" not in text
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help"
        shown = parser._get_formatter()._expand_help(action)
        assert shown.count("default") == (0 if action.required else 1), (action.dest, shown)
    assert "(default: 50)" in text and "(tokens) (default: 4)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_refused_before_the_model_loads(
    smollm2_path, tmp_path, capsys, device
):
    """Used to load the model, then die in ``.to(device)`` with a 34-line traceback."""
    out = tmp_path / "p.json"
    args = ["--model-path", str(smollm2_path), "--scorer", "snapkv", "--target-ratio", "0.25"]
    assert calibrate_main([*args, "--output", str(out), "--device", device]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --device {device}: no CUDA GPU found; use --device cpu\n"
    assert not out.exists()


def test_resolve_device_checks_names_and_gpu_counts():
    assert resolve_device(None, 0) == "cpu"
    assert resolve_device(None, 2) == "cuda"
    assert resolve_device("cpu", 0) == "cpu"
    assert resolve_device("cuda:1", 2) == "cuda:1"
    with pytest.raises(ConfigError, match="no CUDA GPU found; use --device cpu"):
        resolve_device("cuda", 0)
    with pytest.raises(ConfigError, match=r"only 2 CUDA GPU\(s\) found \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2", 2)
    with pytest.raises(ConfigError, match="use one of cpu, cuda, cuda:N"):
        resolve_device("GPU", 1)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_unwritable_output_is_refused_before_the_model_loads(tmp_path, capsys):
    """``/proc`` passes ``os.access(W_OK)`` for root; the profile write used to fail only after
    the whole calibration."""
    args = ["--model-path", str(tmp_path / "no-model"), "--scorer", "snapkv"]
    args += ["--target-ratio", "0.25", "--output", "/proc/nu/x.json"]
    assert calibrate_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --output /proc/nu/x.json: cannot write there (")
    assert "--model-path" not in err and len(err.splitlines()) == 1


def test_output_check_leaves_no_folder_and_save_creates_it(tmp_path):
    out = tmp_path / "my-profiles" / "sub" / "p.json"
    _check_output(out)  # a missing parent is fine: BudgetProfile.save creates it
    assert not (tmp_path / "my-profiles").exists()
    (tmp_path / "kept").mkdir()
    _check_output(tmp_path / "kept" / "p.json")
    assert list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kernel-size", "4"], "--scorer kvzip-lite with --obs-window None and --kernel-size 4"),
        (["--allocation", "pyramid"], "--allocation pyramid needs an observation window shorter"),
        (["--allocation", "duo"], "pass --obs-window N, or --allocation layer/global"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_kvzip_lite_flags_name_the_flag(tmp_path, capsys, extra, message):
    """kvzip-lite scores every query: pyramid/duo (a window at the sample's end) would silently
    fall back to uniform budgets or mark every head a retrieval head."""
    args = ["--model-path", str(tmp_path / "no-model"), "--scorer", "kvzip-lite"]
    args += ["--target-ratio", "0.25", "--output", str(tmp_path / "p.json"), *extra]
    assert calibrate_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "--model-path" not in err


def test_show_plot_to_an_unwritable_path_is_a_clean_error(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    profile = "calibration/smollm2/snapkv-r0.5.json"
    bad = str(tmp_path / "file.txt" / "out.png")  # parent is a file: was a raw FileExistsError
    assert show_main(["show", str(REPO / profile), "--plot", bad]) == 2
    assert f"--plot {bad}: cannot write the figure" in capsys.readouterr().err


@pytest.mark.slow  # KVzip's scores on 2 short samples, then the budgets: ~40 s on CPU
def test_kvzip_gate_calibration_fits_the_gate_then_its_budgets(smollm2_path, tmp_path):
    """``--scorer kvzip-gate``: the gate fitted on KVzip's scores of the samples (weights in
    ``scorer_options``, the fit's record in ``gate_fit``), then budgets observed with it; the
    profile loads back into the scorer the server builds, which ranks tokens like KVzip."""
    from tangram_sglang.backend.state import build_scorer
    from tangram_sglang.calibrate.gate import gate_training_data

    out = tmp_path / "kvzip-gate-r0.25.json"
    args = ["--model-path", str(smollm2_path), "--scorer", "kvzip-gate", "--target-ratio", "0.25"]
    gate = ["--gate-samples", "2", "--gate-max-tokens", "128", "--cache-dir", str(tmp_path / "c")]
    assert calibrate_main([*args, *TINY, *gate, "--output", str(out)]) == 0
    profile = BudgetProfile.load(out)
    assert profile.scorer == "kvzip-gate" and profile.provenance["allocation"] == "global"
    fit = profile.provenance["gate_fit"]
    assert fit["samples"] == 2 and 0 < fit["tokens"] <= 2 * 128 and fit["train_r2_mean"] > 0.2
    scorer = build_scorer(profile)
    assert scorer.shape == (30, 3, 64)
    assert profile.ratio.std() > 0  # the global allocation gives heads different budgets
    # Another ratio on the same samples reads KVzip's scores back (no second forward) and fits
    # the same gate.
    assert len(list((tmp_path / "c").rglob("kvzip-*/*.npz"))) == 2
    half = tmp_path / "kvzip-gate-r0.5.json"
    args[-1] = "0.5"
    assert calibrate_main([*args, *TINY, *gate, "--output", str(half)]) == 0
    again = BudgetProfile.load(half)
    assert again.provenance["gate_fit"]["seconds"] < fit["seconds"]
    assert again.provenance["scorer_options"] == profile.provenance["scorer_options"]
    assert again.ratio.mean() > profile.ratio.mean()

    # On a context it was not fitted on, the gate's ranking agrees with KVzip's better than
    # chance (Spearman > 0 in most layers).
    from scipy.stats import spearmanr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    text = "The harbour master logged three ships: the Aster at dawn, the Bellis at noon. " * 6
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    feats, kvzip = gate_training_data(model, tok(chat, add_special_tokens=False)["input_ids"])
    table = np.asarray(profile.provenance["scorer_options"]["weights"])
    pred = np.einsum("lhnf,lhf->lhn", feats, table[..., :-1]) + table[..., -1:]
    rho = [spearmanr(pred[i, h], kvzip[i, h])[0] for i in range(30) for h in range(3)]
    assert np.mean(np.asarray(rho) > 0) > 0.7


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--allocation", "duo"], "--allocation duo reads an observation window's attention"),
        (["--obs-window", "8"], "obs_window=8 must be 0 (the gate reads no queries; leave"),
        (["--gate-samples", "0"], "--gate-samples 0 must be >= 1"),
        (["--gate-max-tokens", "10"], "--gate-max-tokens 10 must be >= 64"),
    ],
)
def test_bad_kvzip_gate_flags_name_the_flag(tmp_path, capsys, extra, message):
    argv = ["--model-path", "nosuch-model", "--scorer", "kvzip-gate", "--target-ratio", "0.25"]
    assert calibrate_main([*argv, *extra, "--output", str(tmp_path / "p.json")]) == 2
    assert message in capsys.readouterr().err


def test_kvzip_gate_without_kvpress_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kvpress" else real(name, *a)
    )
    argv = ["--model-path", "nosuch-model", "--scorer", "kvzip-gate", "--target-ratio", "0.25"]
    assert calibrate_main([*argv, "--output", str(tmp_path / "p.json")]) == 2
    assert "bash scripts/install_calibrate_deps.sh" in capsys.readouterr().err
