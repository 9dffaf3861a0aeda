"""A word-level tokenizer for a model folder that has none (the GPU benchmarks' dummy model).

``--load-format dummy`` serves a model from its ``config.json`` alone, and such a folder has no
tokenizer, so the benchmarks ran it with ``--skip-tokenizer-init``. Some requests need the
tokenizer, though: SGLang refuses ``min_new_tokens`` without one (it needs the EOS id), and the
multi-turn bench holds the output lengths of requests without ``max_new_tokens`` with
``min_new_tokens``. This writes a tokenizer that maps every id of the model's vocabulary to one
word, ``<t{id}>``, with the config's BOS and EOS ids, so the server runs with its tokenizer and
detokenizer as a production server does. The bench sends token ids, so the words never matter.

Usage::

    python -m tangram_sglang.bench.dummy_tokenizer calibration/synthetic/llama3.1-8b-dummy

Built with the ``tokenizers`` library (a ``WordLevel`` model); loads with transformers'
``AutoTokenizer`` as a ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tangram_sglang.errors import ConfigError

FILES = ("tokenizer.json", "tokenizer_config.json")


def _config_ids(config: dict, key: str, path: Path) -> int:
    """The first id of ``config[key]`` (an int or a list of ints)."""
    value = config.get(key)
    if isinstance(value, list) and value:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: {key} must be a token id (int), got {value!r}")
    return value


def write_dummy_tokenizer(model_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir``.

    Args:
        model_dir: a model folder with a ``config.json`` holding ``vocab_size``,
            ``bos_token_id`` and ``eos_token_id`` (an int or a list; the first is the EOS token).
        overwrite: replace tokenizer files already there (default: leave them and return []).

    Returns:
        The files written (empty when both were there and ``overwrite`` is False).

    Raises:
        ConfigError: no ``config.json``, or a missing or ill-typed ``vocab_size``/token id.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(model_dir)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path}: no such file (give the model folder)") from None
    except ValueError as exc:
        raise ConfigError(f"{config_path}: not JSON ({exc})") from None
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ConfigError(f"{config_path}: vocab_size must be an int >= 2, got {vocab_size!r}")
    bos = _config_ids(config, "bos_token_id", config_path)
    eos = _config_ids(config, "eos_token_id", config_path)
    for key, tid in (("bos_token_id", bos), ("eos_token_id", eos)):
        if not 0 <= tid < vocab_size:
            raise ConfigError(
                f"{config_path}: {key} {tid} is outside the vocabulary 0..{vocab_size - 1}"
            )
    targets = [folder / name for name in FILES]
    if not overwrite and all(p.is_file() for p in targets):
        return []
    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=f"<t{eos}>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(targets[0]))
    targets[1].write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": f"<t{bos}>",
                "eos_token": f"<t{eos}>",
                "unk_token": f"<t{eos}>",
                "model_max_length": int(config.get("max_position_embeddings", 131072)),
            },
            indent=1,
        )
        + "\n"
    )
    return targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", help="model folder with config.json")
    p.add_argument("--overwrite", action="store_true", help="replace existing tokenizer files")
    args = p.parse_args(argv)
    try:
        written = write_dummy_tokenizer(args.model_dir, args.overwrite)
    except ConfigError as exc:
        print(f"dummy_tokenizer: {exc}", file=sys.stderr)
        return 2
    print("dummy_tokenizer: " + (", ".join(map(str, written)) or "tokenizer already there"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
