"""``encode-client``: hash, encode, lookup, tokens and warm from the shell, for images and videos.

A file is sent as a video when its name ends in a video suffix (.mp4 .m4v .mov .webm .mkv .avi)
or its bytes start like one (mp4/mov, webm/mkv, avi); ``--video`` sends every file of ``encode``
and ``tokens`` as a video whatever its name. Anything else is an image (a GIF too, as vLLM reads it).

Every argument is taken on its own: one that cannot be read (for ``lookup``: neither a file nor
an mm_hash) is reported on stderr and the others are still processed; the exit code says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from encode_client._client import AsyncClient, Client
from encode_client._errors import MissingExtra, ReplicaUnavailable, ServerError
from encode_client._images import VIDEO_SUFFIXES, ImageInput, Video, mm_hash
from encode_client._types import LookupItem
from encode_client.safetensors import WireTensor, dump_safetensors

__all__ = ["EXIT_CODES", "IMAGE_SUFFIXES", "VIDEO_SUFFIXES", "main"]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
DEFAULT_URL = "http://127.0.0.1:8000"
_HASH = re.compile(r"^[0-9a-f]{64}$")
EXIT_CODES = """\
exit codes:
  0  success
  1  the server refused something (an error answer, or some images failed in warm)
  2  bad usage (a grpc:// URL without the [grpc] extra too), or some arguments could not be read (the
     others were still processed)
  3  no replica answered

grpc:// replicas need the [grpc] extra (grpcio, protobuf): pip install './clients/python[grpc]'
from a checkout of encode-server, or make dist's client wheel with [grpc]"""

T = TypeVar("T")


class UsageError(Exception):
    pass


def _connection_options(p: argparse.ArgumentParser, *, late: bool) -> None:
    """``--url``, ``--api-key`` and ``--timeout``, before the subcommand or after it. Given after
    it (``late``), they land in their own ``late_*`` fields, so they add to (``--url``) or win
    over (the others) what came before instead of silently replacing it."""
    prefix, default = ("late_", argparse.SUPPRESS) if late else ("", None)
    p.add_argument(
        "--url", action="append", dest=prefix + "url", default=default, metavar="URL",
        help=f"server replica, http://, https:// or grpc:// (grpc:// needs the [grpc] extra, below; repeatable; "
        f"default: $ENCODE_CLIENT_URL, URLs separated by commas, else {DEFAULT_URL})",
    )
    p.add_argument("--api-key", dest=prefix + "api_key", default=default, metavar="KEY",
                   help="sent as Authorization: Bearer KEY (default: $ENCODE_CLIENT_API_KEY)")
    p.add_argument("--timeout", type=float, dest=prefix + "timeout", default=default, metavar="SECONDS",
                   help="per request (default: 60)")


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").strip().replace("``", "")
    formatter = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="encode-client", description=doc, epilog=EXIT_CODES, formatter_class=formatter)
    _connection_options(p, late=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help, epilog=EXIT_CODES, formatter_class=formatter)
        if name != "hash":
            _connection_options(c, late=True)
        return c

    command("hash", "print each file's mm_hash (the same hex as b3sum)").add_argument("files", nargs="+")
    video_help = "send every file as a video, whatever its name (default: by suffix or content)"
    enc = command("encode", "encode images and videos into one safetensors file")
    enc.add_argument("files", nargs="+")
    enc.add_argument("-o", "--output", required=True,
                     help="OUT.safetensors: tensor i per file; metadata: model, fingerprint, items")
    enc.add_argument("--video", action="store_true", help=video_help)
    look = command("lookup", "which tier holds each image or video, by file or by mm_hash (mixed)")
    look.add_argument("items", nargs="+", metavar="FILE_OR_HASH")
    look.add_argument("--video", action="store_true",
                      help="look every item up as a video (default: a file by suffix, a hash as an image)")
    tok = command("tokens", "token count and grid per image or video (a video's from its header), without encoding")
    tok.add_argument("files", nargs="+")
    tok.add_argument("--video", action="store_true", help=video_help)
    settings_help = ("processor settings of every item, a JSON object in vLLM's names (e.g. '{\"max_pixels\": 12544}'; "
                     "a server started with --trust-request-mm-kwargs)")
    for c in (enc, look, tok):
        c.add_argument("--mm-processor-kwargs", type=_settings_arg, default=None, metavar="JSON", help=settings_help)
    warm = command("warm", "pre-warm the cache with every image and video under a folder (by suffix)")
    warm.add_argument("directory")
    warm.add_argument("--concurrency", type=int, default=4, help="uploads in flight (default: 4)")
    return p


def _resolve_connection(args: argparse.Namespace) -> None:
    """Merge the options given before and after the subcommand, then the environment."""
    urls = [*(args.url or []), *getattr(args, "late_url", [])]
    if not urls:
        urls = [u.strip() for u in os.environ.get("ENCODE_CLIENT_URL", DEFAULT_URL).split(",") if u.strip()]
    args.url = urls
    args.api_key = getattr(args, "late_api_key", None) or args.api_key or os.environ.get("ENCODE_CLIENT_API_KEY")
    late_timeout = getattr(args, "late_timeout", None)
    args.timeout = late_timeout if late_timeout is not None else args.timeout if args.timeout is not None else 60.0


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _reader(video: bool) -> Callable[[str], ImageInput]:
    """A file's bytes, wrapped as a ``Video`` when ``--video`` or its suffix says so (the client
    sees only bytes, and detects a video by its content)."""

    def read(path: str) -> ImageInput:
        data = _read(path)
        return Video(data) if video or Path(path).suffix.lower() in VIDEO_SUFFIXES else data

    return read


class Arguments:
    """Each argument turned into what the command sends; those that fail are reported at once
    and left out, and ``failed`` makes the exit code 2."""

    def __init__(self) -> None:
        self.failed = 0

    def each(self, items: Sequence[str], convert: Callable[[str], T]) -> list[tuple[str, T]]:
        out = []
        for item in items:
            try:
                out.append((item, convert(item)))
            except UsageError as exc:
                self.failed += 1
                print(f"encode-client: {exc}", file=sys.stderr)
        return out

    def code(self) -> int:
        return 2 if self.failed else 0


def _hash_of(item: str) -> str:
    """An mm_hash as given, or that of the file named."""
    if _HASH.match(item):
        return item
    try:
        return mm_hash(Path(item).read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read {item}: {exc.strerror or exc} (nor is it a 64-hex mm_hash)") from exc


def _settings_arg(text: str) -> dict[str, Any]:
    """``--mm-processor-kwargs``: a JSON object (the server checks its keys)."""
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _cmd_hash(args: argparse.Namespace, given: Arguments) -> int:
    for f, data in given.each(args.files, _read):
        print(f"{mm_hash(data)}  {f}")
    return given.code()


def _cmd_encode(args: argparse.Namespace, client: Client, given: Arguments) -> int:
    files = given.each(args.files, _reader(args.video))
    if not files:
        return given.code()
    results = client.encode([item for _, item in files], mm_processor_kwargs=args.mm_processor_kwargs)
    answered = {(r.model, r.fingerprint) for r in results}
    if len(answered) != 1:  # one file, one model: mixing them would mislabel the tensors
        print(f"encode-client: the replicas serve different models: {sorted(map(str, answered))}", file=sys.stderr)
        return 1
    ((model, fingerprint),) = answered
    items = [
        {"file": f, "index": r.index, "hash": r.hash, "status": r.status, "source": r.source,
         "num_tokens": r.num_tokens, "shape": list(r.shape), "dtype": r.dtype, "meta": r.meta}
        for (f, _), r in zip(files, results, strict=True)
    ]
    tensors = [WireTensor(str(r.index), r.dtype, r.shape, r.data) for r in results if r.dtype is not None]
    metadata = {"model": model or "", "fingerprint": fingerprint or "", "items": json.dumps(items)}
    Path(args.output).write_bytes(dump_safetensors(tensors, metadata))
    for item in items:
        print(f"{item['hash']}  {item['status']:<8} {item['source'] or '-':<8} {item['shape']}  {item['file']}")
    print(f"wrote {len(tensors)} tensors to {args.output}", file=sys.stderr)
    return given.code()


def _cmd_lookup(args: argparse.Namespace, client: Client, given: Arguments) -> int:
    """One lookup per modality: a file's bytes as a video are another entry than as an image."""
    items = given.each(args.items, _hash_of)
    video = [args.video or (not _HASH.match(item) and Path(item).suffix.lower() in VIDEO_SUFFIXES)
             for item, _ in items]
    found: dict[int, LookupItem] = {}
    for modality in (False, True):
        these = [i for i, v in enumerate(video) if v is modality]
        if these:
            answers = client.lookup([items[i][1] for i in these], modality="video" if modality else "image",
                                    mm_processor_kwargs=args.mm_processor_kwargs)
            found.update(zip(these, answers, strict=True))
    for i, (item, _) in enumerate(items):
        print(f"{found[i].hash}  {'cached' if found[i].cached else 'missing'}  {found[i].tier or '-'}  {item}")
    return given.code()


def _cmd_tokens(args: argparse.Namespace, client: Client, given: Arguments) -> int:
    files = given.each(args.files, _reader(args.video))
    counts = client.tokens([item for _, item in files], mm_processor_kwargs=args.mm_processor_kwargs) if files else []
    for (f, _), count in zip(files, counts, strict=True):
        print(f"{count.num_tokens:>7}  {count.width}x{count.height}  {json.dumps(count.meta)}  {f}")
    return given.code()


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


class Progress:
    """One stderr line redrawn in place: done/total, rate, hits, misses, errors. No dependency."""

    def __init__(self, total: int, unit: str = "img") -> None:
        self.total, self.hits, self.misses, self.errors = total, 0, 0, 0
        self.unit = unit
        self.started = time.monotonic()
        self._drawn = 0.0
        self._drawn_done = -1
        self.tty = sys.stderr.isatty()

    @property
    def done(self) -> int:
        return self.hits + self.misses + self.errors

    def line(self) -> str:
        rate = self.done / max(1e-9, time.monotonic() - self.started)
        width = 24
        filled = width * self.done // max(1, self.total)
        return (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.1f} {self.unit}/s "
                f"hits {self.hits} misses {self.misses} errors {self.errors}")

    def draw(self, force: bool = False) -> None:
        """Redrawn at most every 0.2 s; ``force``: the final line, unless a log (no tty) already has it."""
        now = time.monotonic()
        if force and not self.tty and self._drawn_done == self.done:
            return
        if force or now - self._drawn > 0.2:
            self._drawn, self._drawn_done = now, self.done
            end = "\r" if self.tty and not force else "\n"
            print(self.line(), end=end, file=sys.stderr, flush=True)


async def _warm(args: argparse.Namespace) -> int:
    root = Path(args.directory)
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory")
    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    suffixes = IMAGE_SUFFIXES | VIDEO_SUFFIXES
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    videos = sum(p.suffix.lower() in VIDEO_SUFFIXES for p in files)
    progress = Progress(len(files), "files" if videos else "img")
    semaphore = asyncio.Semaphore(args.concurrency)
    failures: list[str] = []

    async with AsyncClient(args.url, api_key=args.api_key, timeout=args.timeout) as client:

        async def one(path: Path) -> None:
            async with semaphore:
                try:
                    item = (await client.warm([path]))[0]  # a video by its suffix, as the client reads a path
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

        # The first error that ends the run (no replica answered) stops the other uploads, and they
        # are waited for before the client closes: left running, they died with the event loop,
        # their connection attempts never awaited (a RuntimeWarning at exit).
        uploads = [asyncio.ensure_future(one(p)) for p in files]
        try:
            await asyncio.gather(*uploads)
        finally:
            for upload in uploads:
                upload.cancel()
            await asyncio.gather(*uploads, return_exceptions=True)
    progress.draw(force=True)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    elapsed = time.monotonic() - progress.started
    warmed = _count(len(files) - videos, "image") + (f" and {_count(videos, 'video')}" if videos else "")
    print(f"warmed {warmed} in {elapsed:.2f} s: {_count(progress.hits, 'hit')}, "
          f"{_count(progress.misses, 'miss', 'misses')} (encoded), {_count(progress.errors, 'error')}",
          file=sys.stderr)
    return 1 if progress.errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    given = Arguments()
    try:
        if args.command == "hash":
            return _cmd_hash(args, given)
        _resolve_connection(args)
        if args.command == "warm":
            return asyncio.run(_warm(args))
        with Client(args.url, api_key=args.api_key, timeout=args.timeout) as client:
            command = {"encode": _cmd_encode, "lookup": _cmd_lookup, "tokens": _cmd_tokens}[args.command]
            return command(args, client, given)
    except (UsageError, ValueError, MissingExtra) as exc:
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
