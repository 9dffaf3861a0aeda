"""A word-level tokenizer for a model folder that has none (the GPU benchmarks' dummy model).

``--load-format dummy`` serves a model from its ``config.json`` alone, and such a folder has no
tokenizer, so the benchmarks ran it with ``--skip-tokenizer-init``. Some requests need the
tokenizer, though: SGLang refuses ``min_new_tokens`` without one (it needs the EOS id), and the
multi-turn bench holds the output lengths of requests without ``max_new_tokens`` with
``min_new_tokens``. This writes a tokenizer that maps every id of the model's vocabulary to one
word, ``<t{id}>``, with the config's BOS and EOS ids, so the server runs with its tokenizer and
detokenizer as a production server does. The bench's own client sends token ids, so the words
never matter; its ``--client sglang`` sends the words as chat text (a plain chat template joins
the messages), and they encode back to the same ids.

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
# The chat API (``bench.multiturn --client sglang``) needs a chat template; this one joins the
# messages' texts with spaces, so a chat prompt is exactly the words of its history.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


# Far above any released model's vocabulary (256k); the tokenizer holds one word per id, so a
# mistyped vocab_size (1e9) would otherwise fill the memory before anything is written.
MAX_VOCAB = 1 << 21


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _config_ids(config: dict, key: str, path: Path) -> int:
    """The first id of ``config[key]`` (an int or a list of ints)."""
    value = config.get(key)
    if isinstance(value, list) and value:
        value = value[0]
    if not _is_int(value):
        raise ConfigError(
            f"{path}: {key} must be a token id (int, or a list whose first item is one), got "
            f"{value!r}; set it in config.json"
        )
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
        ConfigError: no readable ``config.json`` or not a JSON object; a missing or ill-typed
            ``vocab_size`` (2..``MAX_VOCAB``), token id or ``max_position_embeddings``; the
            tokenizer files cannot be written.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(model_dir)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path}: no such file (give the model folder)") from None
    except OSError as exc:
        raise ConfigError(f"{config_path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{config_path}: must be a JSON object (a model config), got {type(config).__name__}"
        )
    vocab_size = config.get("vocab_size")
    if not _is_int(vocab_size) or not 2 <= vocab_size <= MAX_VOCAB:
        raise ConfigError(
            f"{config_path}: vocab_size must be an int in 2..{MAX_VOCAB}, got {vocab_size!r}"
        )
    max_len = config.get("max_position_embeddings", 131072)
    if not _is_int(max_len) or max_len < 1:
        raise ConfigError(
            f"{config_path}: max_position_embeddings must be a positive int (tokens) or absent, "
            f"got {max_len!r}"
        )
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
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": f"<t{bos}>",
        "eos_token": f"<t{eos}>",
        "unk_token": f"<t{eos}>",
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    try:
        tok.save(str(targets[0]))
        targets[1].write_text(json.dumps(settings, indent=1) + "\n")
    except Exception as exc:  # tokenizers raises a bare Exception on an I/O error
        raise ConfigError(
            f"{folder}: cannot write the tokenizer files ({exc}); give a writable model folder"
        ) from None
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
