"""Picks the faster ``TANGRAM_SCORE_KERNEL`` setting from two ``bench.prefill_profile`` runs.

Usage: ``python scripts/pick_score_kernel.py OFF.json ON.json CASE`` prints ``1`` when the run
with the scoring kernels on (``ON.json``) has a lower ``select_ms`` on ``CASE`` and kept the
reference's tokens there (``select_rows_differing`` under 0.1%), else ``0``. Exits 2 with a
message when a file lacks the case.
"""

import json
import sys

MAX_ROWS_DIFFERING = 1e-3


def fail(message: str) -> None:
    """Print ``message`` to stderr and exit with status 2."""
    print(f"pick_score_kernel: {message}", file=sys.stderr)
    sys.exit(2)


def case_result(path: str, case: str) -> dict:
    """The result of ``case`` in a ``bench.prefill_profile --json`` file; exits 2 if absent."""
    try:
        with open(path) as fh:
            results = json.load(fh)["results"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"{path}: not a bench.prefill_profile --json file ({exc!r})")
    for res in results:
        if res.get("case") == case:
            return res
    fail(f"{path} has no case {case!r}; run prefill_profile with it")


def main() -> int:
    if len(sys.argv) != 4:
        fail(__doc__)
    off, on = (case_result(p, sys.argv[3]) for p in sys.argv[1:3])
    differing = on.get("select_rows_differing")
    if not isinstance(differing, (int, float)):
        fail(f"{sys.argv[2]} has no select_rows_differing for {sys.argv[3]}")
    faster = on["select_ms"] < off["select_ms"]
    same = differing < MAX_ROWS_DIFFERING
    print(
        f"{sys.argv[3]}: select_ms off {off['select_ms']:.3f}, on {on['select_ms']:.3f}, "
        f"rows differing on {on.get('select_rows_differing')}",
        file=sys.stderr,
    )
    print(1 if faster and same else 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
