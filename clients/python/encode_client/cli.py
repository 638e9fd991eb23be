"""``encode-client``: hash, encode, lookup, tokens and warm from the shell.

Exit codes: 0 success; 1 the server refused something (an error answer, or some files failed in
``warm``); 2 bad usage or an unreadable file; 3 no replica answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from encode_client._client import AsyncClient, Client
from encode_client._errors import ReplicaUnavailable, ServerError
from encode_client._images import mm_hash

__all__ = ["IMAGE_SUFFIXES", "main"]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
_HASH = re.compile(r"^[0-9a-f]{64}$")


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="encode-client", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--url", action="append", default=None,
        help="server replica (repeatable; http://, https:// or grpc://); env ENCODE_CLIENT_URL, comma-separated",
    )
    p.add_argument("--api-key", default=os.environ.get("ENCODE_CLIENT_API_KEY"), help="env ENCODE_CLIENT_API_KEY")
    p.add_argument("--timeout", type=float, default=60.0)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("hash", help="print each file's mm_hash (same as b3sum)").add_argument("files", nargs="+")
    enc = sub.add_parser("encode", help="encode images into one safetensors file")
    enc.add_argument("files", nargs="+")
    enc.add_argument("-o", "--output", required=True, help="OUT.safetensors: tensor i per file, metadata per item")
    sub.add_parser("lookup", help="which tier holds each image (files or hashes)").add_argument("items", nargs="+")
    sub.add_parser("tokens", help="token count and grid per image, without encoding").add_argument("files", nargs="+")
    warm = sub.add_parser("warm", help="pre-warm the cache with every image under a folder")
    warm.add_argument("directory")
    warm.add_argument("--concurrency", type=int, default=4)
    return p


def _urls(args: argparse.Namespace) -> list[str]:
    if args.url:
        return list(args.url)
    env = os.environ.get("ENCODE_CLIENT_URL", "http://127.0.0.1:8000")
    return [u for u in env.split(",") if u.strip()]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _cmd_hash(args: argparse.Namespace) -> int:
    for f in args.files:
        print(f"{mm_hash(_read(f))}  {f}")
    return 0


def _cmd_encode(args: argparse.Namespace, client: Client) -> int:
    results = client.encode([_read(f) for f in args.files])
    header: dict[str, Any] = {}
    offset = 0
    items = []
    for f, r in zip(args.files, results, strict=True):
        items.append({"file": f, "hash": r.hash, "status": r.status, "source": r.source,
                      "shape": list(r.shape), "dtype": r.dtype, "meta": r.meta})
        code = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[r.dtype or "float32"]
        header[str(r.index)] = {"dtype": code, "shape": list(r.shape), "data_offsets": [offset, offset + len(r.data)]}
        offset += len(r.data)
    header = {"__metadata__": {"items": json.dumps(items)}, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(args.output, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for r in results:
            out.write(r.data)
    for item in items:
        print(f"{item['hash']}  {item['status']:<8} {item['source'] or '-':<8} {item['shape']}  {item['file']}")
    print(f"wrote {len(results)} tensors to {args.output}", file=sys.stderr)
    return 0


def _cmd_lookup(args: argparse.Namespace, client: Client) -> int:
    hashes = [item if _HASH.match(item) else mm_hash(_read(item)) for item in args.items]
    for item, found in zip(args.items, client.lookup(hashes), strict=True):
        print(f"{found.hash}  {'cached' if found.cached else 'missing'}  {found.tier or '-'}  {item}")
    return 0


def _cmd_tokens(args: argparse.Namespace, client: Client) -> int:
    for f, count in zip(args.files, client.tokens([_read(f) for f in args.files]), strict=True):
        print(f"{count.num_tokens:>7}  {count.width}x{count.height}  {json.dumps(count.meta)}  {f}")
    return 0


class Progress:
    """One stderr line redrawn in place: done/total, rate, hits, misses, errors. No dependency."""

    def __init__(self, total: int) -> None:
        self.total, self.hits, self.misses, self.errors = total, 0, 0, 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self.tty = sys.stderr.isatty()

    @property
    def done(self) -> int:
        return self.hits + self.misses + self.errors

    def line(self) -> str:
        rate = self.done / max(1e-9, time.monotonic() - self.started)
        width = 24
        filled = width * self.done // max(1, self.total)
        return (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.1f} img/s "
                f"hits {self.hits} misses {self.misses} errors {self.errors}")

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._drawn > 0.2:
            self._drawn = now
            end = "\r" if self.tty and not force else "\n"
            print(self.line(), end=end, file=sys.stderr, flush=True)


async def _warm(args: argparse.Namespace, urls: list[str]) -> int:
    root = Path(args.directory)
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory")
    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    progress = Progress(len(files))
    semaphore = asyncio.Semaphore(args.concurrency)
    failures: list[str] = []

    async with AsyncClient(urls, api_key=args.api_key, timeout=args.timeout) as client:

        async def one(path: Path) -> None:
            async with semaphore:
                try:
                    item = (await client.warm([path.read_bytes()]))[0]
                except ServerError as exc:
                    progress.errors += 1
                    failures.append(f"{path}: {exc}")
                except OSError as exc:
                    progress.errors += 1
                    failures.append(f"{path}: {exc}")
                else:
                    if item.status == "hit":
                        progress.hits += 1
                    else:
                        progress.misses += 1
                progress.draw()

        await asyncio.gather(*(one(p) for p in files))
    progress.draw(force=True)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    elapsed = time.monotonic() - progress.started
    print(f"warmed {len(files)} images in {elapsed:.2f} s: {progress.hits} hits, {progress.misses} misses "
          f"(encoded), {progress.errors} errors", file=sys.stderr)
    return 1 if progress.errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "hash":
            return _cmd_hash(args)
        urls = _urls(args)
        if args.command == "warm":
            return asyncio.run(_warm(args, urls))
        with Client(urls, api_key=args.api_key, timeout=args.timeout) as client:
            command = {"encode": _cmd_encode, "lookup": _cmd_lookup, "tokens": _cmd_tokens}[args.command]
            return command(args, client)
    except (UsageError, ValueError) as exc:
        print(f"encode-client: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"encode-client: server error: {exc}", file=sys.stderr)
        return 1
    except ReplicaUnavailable as exc:
        print(f"encode-client: no replica answered: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
