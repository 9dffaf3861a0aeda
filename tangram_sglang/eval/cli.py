"""``python -m tangram_sglang.eval``: accuracy of full KV, Tangram and kvpress on the same samples.

Example (issue 8)::

    python -m tangram_sglang.eval --model qwen2.5-0.5b --task needle,squad,multiturn-squad \
        --ratios 0.5,0.25 --num-samples 4 --lengths 1024,2048 \
        --json benchmarks/results/accuracy.json

On a GPU (the servers and the transformers model in bfloat16)::

    python -m tangram_sglang.eval --device cuda --protocol query-aware --lengths 2048,4096,8192 \
        --task all --num-samples 30 --json /tmp/accuracy-qa.json

Protocols (``tasks.PROTOCOLS``): query-agnostic (default): the context is compressed without the
question; query-aware (SnapKV): the whole first prompt, question included, is compressed.

Every flag is checked before a model or server starts; bad values exit 2 with the flag named.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import sys
from pathlib import Path

from tangram_sglang.errors import TangramError
from tangram_sglang.eval.runner import (
    CHUNKED_PREFILL_TOKENS,
    DEFAULT_SYSTEMS,
    GRID_CELL_TOKENS,
    SYSTEMS,
    TEMPLATE_MARGIN,
    RunConfig,
    run,
)
from tangram_sglang.eval.tasks import PROTOCOLS, TASKS, check_sizes

REPO = Path(__file__).resolve().parents[2]
# SGLang's automatic static-memory fraction goes negative on a shared CPU host with little free
# memory (it refuses to start); 0.85 lets it start, and --max-total-tokens bounds the KV pool.
# On cuda: half the GPU for a server's weights + KV pool, the rest for CUDA graphs and for a
# transformers model of another eval process on the same GPU (a 0.5B model needs ~2 GB); the
# harness sends one request at a time, so decode CUDA graphs up to batch 8 only (faster start).
DEFAULT_SERVER_ARGS = {
    "cpu": "--mem-fraction-static 0.85",
    "cuda": "--mem-fraction-static 0.5 --disable-prefill-cuda-graph --cuda-graph-max-bs-decode 8",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tangram_sglang.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="qwen2.5-0.5b", help="embedded model name or HF folder")
    p.add_argument("--task", default="needle", help=f"comma list of {', '.join(TASKS)} or 'all'")
    p.add_argument("--ratios", default="1.0,0.5,0.25", help="average kept ratios in (0, 1]")
    p.add_argument("--num-samples", type=int, default=4, help="samples per task")
    p.add_argument("--lengths", default="1024,2048", help="document lengths (tokens)")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1]")
    p.add_argument("--num-turns", type=int, default=3, help="questions per multi-turn sample")
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"subset of {SYSTEMS} (default: all but the *-grid ones and the diagnostic "
        "presses: kvzip-budgets, the kvzip*-alloc / kvzip-lite-* ones, kvzip-gate-budgets and the "
        "*expected-attention ones)",
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="folder with the shipped profiles: ada-snapkv-r<ratio>.json, and <scorer>-r<ratio>"
        ".json of each selected Tangram or profile-budget system (default calibration/<model>)",
    )
    p.add_argument(
        "--server-args",
        default=None,
        help="extra launch_server flags for both servers (one string; default "
        f"{DEFAULT_SERVER_ARGS})",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the servers and the transformers model run (cuda: bfloat16)",
    )
    p.add_argument(
        "--protocol",
        default="query-agnostic",
        choices=tuple(PROTOCOLS),
        help="what is compressed: the context alone, or the first prompt with "
        "its question (SnapKV)",
    )
    p.add_argument(
        "--grid-cell",
        type=int,
        default=GRID_CELL_TOKENS,
        help="cell of the *-grid systems' segment grid (tokens; their "
        "--chunked-prefill-size, TANGRAM_GRID_SEGMENTS=1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (kvpress side)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--markdown", action="store_true", help="print the RESULTS.md table")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the records in --json and run only the missing ones",
    )
    p.add_argument(
        "--skip",
        type=int,
        default=0,
        help="leave out the first N samples (a 2nd process filling a run)",
    )
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Validate flags into a :class:`RunConfig` (resolves the model folder: may convert it).

    Raises:
        TangramError: a bad flag (ConfigError) or model (ModelError); the message names it.
    """
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.models import MODELS, model_path

    tasks = TASKS if args.task == "all" else tuple(_split(args.task, "--task", str))
    lengths = tuple(_split(args.lengths, "--lengths", int))
    depths = tuple(_split(args.depths, "--depths", float))
    check_sizes(tasks, args.num_samples, lengths, depths, args.num_turns)
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if not 0 <= args.skip < args.num_samples * len(tasks):
        raise ConfigError(f"--skip must lie in [0, num_samples x tasks), got {args.skip}")
    ratios = tuple(dict.fromkeys(_split(args.ratios, "--ratios", float)))
    if any(not 0 < r <= 1 for r in ratios):
        raise ConfigError(f"--ratios must lie in (0, 1], got {args.ratios}")
    systems = tuple(dict.fromkeys(_split(args.systems, "--systems", str)))
    for system in systems:
        if system not in SYSTEMS:
            near = difflib.get_close_matches(system, SYSTEMS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            if any(sep in system for sep in " ;\t"):
                hint = "separate the systems with commas; "
            raise ConfigError(
                f"--systems: {system!r} is not a system; {hint}use a subset of {', '.join(SYSTEMS)}"
            )
    if args.model not in MODELS and not Path(args.model).is_dir():
        raise ConfigError(
            f"--model {args.model!r}: not an embedded model ({', '.join(MODELS)}) "
            "nor an HF model folder"
        )
    text = DEFAULT_SERVER_ARGS[args.device] if args.server_args is None else args.server_args
    try:
        server_args = tuple(shlex.split(text))
    except ValueError as exc:
        raise ConfigError(f"--server-args {args.server_args!r}: {exc}") from None
    if args.threads is not None and args.device != "cpu":
        raise ConfigError("--threads sets CPU threads; leave it out with --device cuda")
    if any(a.startswith("--dtype") for a in server_args):
        raise ConfigError(
            "--server-args: --dtype is set by the harness from --device (the same "
            "dtype as the transformers model); remove it"
        )
    # Tangram must compress each context as ONE segment (same scope as kvpress's press) for the
    # per-head budgets and scores to be comparable; the template adds < 1k tokens.
    if any(a.startswith("--chunked-prefill-size") for a in server_args):
        raise ConfigError(
            "--server-args: --chunked-prefill-size is set by the harness (each "
            "context is one compressed segment); remove it"
        )
    if args.device == "cpu" and max(lengths) + TEMPLATE_MARGIN > CHUNKED_PREFILL_TOKENS:
        limit = CHUNKED_PREFILL_TOKENS - TEMPLATE_MARGIN
        raise ConfigError(
            f"--lengths {max(lengths)}: contexts must stay under {limit} tokens "
            "on cpu (one prefill chunk, the CPU KV pool)"
        )
    _min_compress_tokens(server_args)  # a bad value stops here, for every system
    _check_grid_cell(args.grid_cell, systems, lengths, server_args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is visible here; use --device cpu")
    name = args.model if args.model in MODELS else Path(args.model).name
    profile_dir = Path(args.profile_dir or REPO / "calibration" / name)
    if not profile_dir.is_dir():
        raise ConfigError(f"--profile-dir {profile_dir} does not exist; pass one")
    _check_profiles(profile_dir, systems)
    model_dir = model_path(args.model) if args.model in MODELS else Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {args.model}: no config.json in {model_dir}")
    _check_profile_models(profile_dir, systems, ratios, model_dir, args.model)
    chunk = _chunk_tokens(max(lengths), args.device, model_dir)
    return RunConfig(
        model=args.model,
        model_dir=model_dir,
        profile_dir=profile_dir,
        tasks=tasks,
        ratios=ratios,
        num_samples=args.num_samples,
        lengths=lengths,
        depths=depths,
        num_turns=args.num_turns,
        systems=systems,
        seed=args.seed,
        json_path=Path(args.json) if args.json else None,
        threads=args.threads,
        server_args=server_args,
        resume=args.resume,
        skip=args.skip,
        device=args.device,
        protocol=args.protocol,
        chunked_prefill_tokens=chunk,
        grid_cell=args.grid_cell,
    )


def _check_grid_cell(
    cell: int, systems: tuple[str, ...], lengths: tuple[int, ...], server_args: tuple[str, ...]
) -> None:
    """``--grid-cell`` must give the ``*-grid`` systems whole cells that get compressed.

    Raises:
        ConfigError: a cell below 1, or (with a grid system selected) a cell longer than every
            document or shorter than the servers' ``--tangram-min-compress-tokens`` (a cell that
            short is kept whole: nothing would be compressed).
    """
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.systems import GRID_SYSTEMS

    if cell < 1:
        raise ConfigError(f"--grid-cell must be >= 1 token, got {cell}")
    if not any(s in GRID_SYSTEMS for s in systems):
        return
    min_compress = _min_compress_tokens(server_args)
    if cell < min_compress:
        raise ConfigError(
            f"--grid-cell {cell}: cells shorter than --tangram-min-compress-tokens "
            f"({min_compress}) are kept whole, so the grid systems would compress nothing; use "
            f"--grid-cell >= {min_compress}"
        )
    if cell > max(lengths):
        raise ConfigError(
            f"--grid-cell {cell}: longer than every document (--lengths {max(lengths)}), so "
            "the grid systems would compress nothing; use a cell <= the longest document"
        )


def _min_compress_tokens(server_args: tuple[str, ...]) -> int:
    """The servers' ``--tangram-min-compress-tokens`` in ``--server-args`` (tokens; the default
    when absent).

    Raises:
        ConfigError: a value that is missing or not a whole number >= 0 (checked here, before
            any server or model starts, not by the first server after minutes).
    """
    from tangram_sglang.config import DEFAULT_MIN_COMPRESS_TOKENS
    from tangram_sglang.errors import ConfigError

    flag = "--tangram-min-compress-tokens"
    tokens = DEFAULT_MIN_COMPRESS_TOKENS
    for i, arg in enumerate(server_args):
        if arg != flag and not arg.startswith(flag + "="):
            continue
        value = arg.partition("=")[2] if "=" in arg else " ".join(server_args[i + 1 : i + 2])
        if not value.isdecimal():
            raise ConfigError(
                f"--server-args: {flag} {value!r} must be a whole number >= 0 (tokens; segments "
                "shorter than this are kept whole)"
            )
        tokens = int(value)
    return tokens


def _check_profiles(profile_dir: Path, systems: tuple[str, ...]) -> None:
    """The shipped profiles the run loads are in ``--profile-dir`` (before any model loads).

    ``ada-snapkv-r<ratio>.json`` always (it sets every compressed system's budget), and each
    selected Tangram system's ``<scorer>-r<ratio>.json`` (``runner.TANGRAM_SYSTEMS``) or press
    system's whose budgets come from a profile (``systems.PROFILE_BUDGET_SYSTEMS``:
    ``kvzip-budgets`` and the per-request allocations), as ``runner.profile_candidates`` reads
    them (a ratio that is not a decimal in (0, 1]: not a profile; each file's ``scorer`` field
    must be the one its name says).

    Raises:
        ConfigError: a missing profile, with the systems that need it and the fix; a profile
            of another scorer under a scorer's name, or two files of one ratio.
    """
    from tangram_sglang.errors import ConfigError
    from tangram_sglang.eval.runner import TANGRAM_SYSTEMS, profile_candidates
    from tangram_sglang.eval.systems import PROFILE_BUDGET_SYSTEMS

    wanted = {"ada-snapkv": []}
    for system, scorer in (TANGRAM_SYSTEMS | PROFILE_BUDGET_SYSTEMS).items():
        if system in systems:
            wanted.setdefault(scorer, []).append(system)
    for scorer, users in wanted.items():
        if profile_candidates(profile_dir, scorer):
            continue
        fix = f"leave {', '.join(users)} out of --systems, or " if scorer != "ada-snapkv" else ""
        raise ConfigError(
            f"--profile-dir {profile_dir} holds no {scorer}-r<ratio>.json profile "
            f"({', '.join(users) or 'every compressed system'}'s budget); {fix}calibrate one: "
            f"python -m tangram_sglang.calibrate --model-path MODEL --scorer {scorer} "
            f"--target-ratio R --output {profile_dir}/{scorer}-rR.json (calibration/README.md)"
        )


def _check_profile_models(
    profile_dir: Path,
    systems: tuple[str, ...],
    ratios: tuple[float, ...],
    model_dir: Path,
    model: str,
) -> None:
    """Every profile the run reads was calibrated for ``--model`` (JSON reads, before any model
    or server starts; ``BudgetProfile.check_model``).

    Raises:
        ConfigError: an unreadable model ``config.json``, a profile that does not load, one
            calibrated for another model (naming the file, ``--model`` and ``--profile-dir``,
            and the fix), one whose scorer options are refused (``build_scorer``), or a
            per-request split system (``*-group-alloc``, ``*-head-alloc``) on a profile with a
            ``window_share``.
    """
    import json

    from tangram_sglang.backend.state import build_scorer
    from tangram_sglang.errors import ConfigError, ProfileError
    from tangram_sglang.eval.runner import nearest_profile_path, profile_scorers
    from tangram_sglang.eval.systems import (
        ALLOCATION_OF,
        OBSERVED_SCORE_SYSTEMS,
        PROFILE_BUDGET_SYSTEMS,
    )
    from tangram_sglang.models import MODELS
    from tangram_sglang.profile import BudgetProfile, ModelIdentity
    from tangram_sglang.scoring.snapkv import window_share_of

    try:
        local = ModelIdentity.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError) as exc:
        raise ConfigError(
            f"--model {model}: {model_dir}/config.json is not a readable HF model config "
            f"({type(exc).__name__}: {exc}); pass an HF model folder"
        ) from None
    shipped = REPO / "calibration" / model
    where = (
        f"--profile-dir {shipped.relative_to(REPO)} (or leave --profile-dir out)"
        if model in MODELS and shipped.is_dir() and shipped.resolve() != profile_dir.resolve()
        else "the --profile-dir of this model's profiles"
    )
    paths = {
        nearest_profile_path(profile_dir, r, scorer)
        for scorer in {"ada-snapkv", *profile_scorers(systems).values()}  # run() loads ada-snapkv
        for r in ratios
    }
    for path in sorted(paths):
        try:
            profile = BudgetProfile.load(path)
        except ProfileError as exc:
            raise ConfigError(
                f"--profile-dir: {exc} (replace it with a new calibration, or move it out of "
                "--profile-dir to use the nearest other ratio's profile)"
            ) from None
        try:
            profile.check_model(local)
        except ProfileError as exc:
            raise ConfigError(
                f"--profile-dir {profile_dir}: {path.name} does not fit --model {model} ({exc}); "
                f"pass {where}, or calibrate profiles for this model"
            ) from None
        try:  # its scorer options (window_share...), as a server or the HF twin builds them
            scorer = build_scorer(profile)
        except ConfigError as exc:
            raise ConfigError(f"--profile-dir {profile_dir}: {path.name}: {exc}") from None
        if window_share_of(scorer):  # a per-request split compares scores across heads
            split = [
                s
                for s in systems
                if ALLOCATION_OF.get(s, "static") != "static"
                and s in OBSERVED_SCORE_SYSTEMS
                and PROFILE_BUDGET_SYSTEMS.get(s) == profile.scorer
            ]
            if split:
                raise ConfigError(
                    f"--systems {','.join(split)}: these split the budget per request by "
                    f"comparing scores across heads, but {path.name} sets window_share="
                    f"{scorer.window_share}, whose fused scores are per-head ranks; run the "
                    "static-budget twin (*-budgets) or a --profile-dir without window_share"
                )


def _chunk_tokens(max_length: int, device: str, model_dir: Path) -> int:
    """The servers' prefill chunk (tokens): >= every prompt, so each one is ONE Tangram segment
    (the scope kvpress's press compresses). cuda: up to the model's context length.

    Raises:
        ConfigError: ``--lengths`` + the template margin exceeds the model's context (cuda).
    """
    import json

    from tangram_sglang.errors import ConfigError

    need = max_length + TEMPLATE_MARGIN
    if device == "cuda":
        config = json.loads((model_dir / "config.json").read_text())
        context = int(config.get("max_position_embeddings", need))
        if need > context:
            raise ConfigError(
                f"--lengths {max_length}: contexts must stay under "
                f"{context - TEMPLATE_MARGIN} tokens (the model's context "
                f"length {context})"
            )
    return max(CHUNKED_PREFILL_TOKENS, need)


def _split(text: str, flag: str, kind: type) -> list:
    from tangram_sglang.errors import ConfigError

    try:
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a comma list of {kind.__name__}") from None
    if not values:
        raise ConfigError(f"{flag} is empty")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
        rep = run(cfg)
    except TangramError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tangram_sglang.eval.report import markdown_table

    print(markdown_table(rep))
    print({k: v for k, v in rep["summary"].items() if not k.endswith("by_task")})
    return 0
