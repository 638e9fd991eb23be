"""Write the small seeded checkpoint a family's tests use (``make checkpoint DIR=... [FAMILY=...]``).

Each is built offline from a config under a fixed seed and ``save_pretrained`` (weights, tokenizer,
processor, chat template): nothing is downloaded, and encode-server loads it with ``--model DIR``.
Its weights are random, so its answers mean nothing; what it is for is trying the whole path
(encode-server, vLLM with the connector, the proxy) on a laptop in seconds.

The table is derived from the tests' own records, never kept here: a family with an EPD contract
gets the checkpoint its vLLM tests load (``tests/vllm/families.py``'s ``PROXY_CASES``: vLLM's CPU
build loads it too); any other family (CLIP, SigLIP2) the one its server tests serve
(``tests/tiny/records.py``). ``qwen2_vl``, the default, is a Qwen2.5-VL.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["DEFAULT", "builders", "main"]

DEFAULT = "qwen2_vl"

Builder = Callable[[Path], Path]


def builders() -> dict[str, tuple[Builder, bool]]:
    """Family name -> (its builder, whether vLLM's CPU build loads the checkpoint)."""
    from tests.tiny.records import RECORDS
    from tests.vllm.families import PROXY_CASES

    table: dict[str, tuple[Builder, bool]] = {name: (r.builders[r.kind], False) for name, r in RECORDS.items()}
    table.update({name: (case.build, True) for name, case in PROXY_CASES.items()})
    return dict(sorted(table.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make checkpoint", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("directory", nargs="?", type=Path, help="where to write it (created; files in it replaced)")
    parser.add_argument("--family", default=DEFAULT,
                        help=f"a family name, as GET /v1/model names it (default {DEFAULT})")
    parser.add_argument("--list", action="store_true", help="print the families and exit")
    args = parser.parse_args(argv)
    table = builders()
    if args.list:
        for name, (_, vllm) in table.items():
            print(f"{name}\t{'encode-server and vLLM' if vllm else 'encode-server'}")
        return 0
    if args.directory is None:
        parser.error("a directory is required: make checkpoint DIR=path [FAMILY=name]")
    if args.family not in table:
        parser.error(f"no tiny checkpoint for family {args.family!r}; one of: {', '.join(table)}")
    build, vllm = table[args.family]
    path = build(args.directory)
    print(f"wrote the tiny {args.family} checkpoint to {Path(path).resolve()}"
          f" (random weights; loads in {'encode-server and vLLM' if vllm else 'encode-server'})", file=sys.stderr)
    print(Path(path).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
