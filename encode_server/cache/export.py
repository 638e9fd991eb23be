"""The file layout of vLLM's stock EC connector, for deployments that want no plugin at all.

With ``--export-dir DIR`` the server also writes every embedding it resolves to
``DIR/<identifier>/encoder_cache.safetensors`` (tensor ``ec_cache``, shape ``[N, D]``, the server's
dtype), which is what vLLM's ``ECExampleConnector`` reads when started with
``"ec_connector_extra_config": {"shared_storage_path": "DIR"}`` on a shared filesystem. The
identifier is the item's ``uuid`` for vLLM (``CacheKey.identifier``): an image's ``mm_hash``, or
``video:<mm_hash>`` for a video, so that one file's bytes as an image and as a video never share a
folder.

- Atomic: each file is written to a temporary name in its folder, flushed, then renamed over the
  final name, so a reader sees a whole file or none.
- Bounded: vLLM never deletes these files, so the exporter keeps them within ``--export-max-mb``,
  evicting the least recently written or re-used first (oldest mtime; a re-used embedding has its
  mtime refreshed). Files already in DIR at start count against the budget.
- One model per directory: the layout has no fingerprint, so DIR holds a ``FINGERPRINT`` file and
  the server refuses a DIR written by another model (another model's embeddings under the same
  ``mm_hash`` would be silently wrong for vLLM).
- No tenants: the layout has no tenant either, so it is refused together with
  ``--tenant-isolation`` (checked by the settings).

Writes run on one worker thread. ``export`` (awaited) is what the EPD hand-off uses: the file is
there when the response leaves. ``export_behind`` queues the write behind the response; when the
queue is full a write is dropped (and counted), never awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from encode_server.core.types import Embedding
from encode_server.core.wire import WireTensor, dump_safetensors

__all__ = ["FILE_NAME", "TENSOR_NAME", "FileExporter", "check_directory"]

log = logging.getLogger(__name__)

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
_MARKER = "FINGERPRINT"
_MAX_QUEUED = 256


def check_directory(directory: str | os.PathLike[str]) -> None:
    """Make ``directory`` (and its parents) if need be; ``OSError`` when it cannot be made or
    written. Cheap, so the server checks it before it opens a port."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{path} is not writable by this process")


class FileExporter:
    """Writes embeddings in vLLM's stock EC file layout under ``directory``, within ``max_bytes``."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, fingerprint: str) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the export budget must be positive, got {max_bytes} bytes")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.dropped = 0
        self.evicted = 0
        self._files: OrderedDict[str, int] = OrderedDict()  # identifier -> bytes, oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self._queued = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="export")
        self._claim_directory()
        self._scan()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def path(self, mm_hash: str) -> Path:
        return self.directory / mm_hash / FILE_NAME

    # -- start -------------------------------------------------------------------------------------

    def _claim_directory(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        marker = self.directory / _MARKER
        if marker.exists():
            found = marker.read_text().strip()
            if found != self.fingerprint:
                raise ValueError(
                    f"--export-dir {self.directory} holds embeddings of another model (fingerprint {found[:12]}..., "
                    f"this one is {self.fingerprint[:12]}...): use one directory per model"
                )
            return
        tmp = marker.with_name(f".{_MARKER}.{os.getpid()}.tmp")
        tmp.write_text(self.fingerprint + "\n")
        os.replace(tmp, marker)

    def _scan(self) -> None:
        """Count the files already there against the budget, oldest first; drop stale temporaries."""
        found = []
        for folder in self.directory.iterdir():
            if not folder.is_dir():
                continue
            for stale in folder.glob(f".{FILE_NAME}.*.tmp"):
                stale.unlink(missing_ok=True)
            file = folder / FILE_NAME
            try:
                stat = file.stat()
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime, folder.name, stat.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self._bytes += size
        self._evict()

    # -- writes ------------------------------------------------------------------------------------

    async def export(self, items: Sequence[tuple[str, Embedding]]) -> None:
        """Write ``(identifier, embedding)`` pairs now (off the event loop) and return once they are on disk."""
        if items:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._write_all, list(items))

    def export_behind(self, items: Sequence[tuple[str, Embedding]]) -> None:
        """Queue the writes behind the response; dropped (counted) when the queue is full."""
        if not items:
            return
        with self._lock:
            if self._queued >= _MAX_QUEUED:
                self.dropped += len(items)
                return
            self._queued += 1
        future = self._pool.submit(self._write_all, list(items))
        future.add_done_callback(self._done)

    def _done(self, future: object) -> None:
        with self._lock:
            self._queued -= 1

    def _write_all(self, items: list[tuple[str, Embedding]]) -> None:
        for mm_hash, embedding in dict(items).items():
            try:
                self._write(mm_hash, embedding)
            except OSError as exc:  # a full or read-only disk must not fail the request
                log.warning("export of %s to %s failed: %s", mm_hash, self.directory, exc)

    def _write(self, mm_hash: str, embedding: Embedding) -> None:
        path = self.path(mm_hash)
        with self._lock:
            known = mm_hash in self._files
        if known and path.exists():
            os.utime(path)  # re-used: youngest again
            with self._lock:
                self._files.move_to_end(mm_hash)
            return
        t = embedding.tensor
        blob = dump_safetensors(
            [WireTensor(TENSOR_NAME, t.dtype, t.shape, t.data)],
            {"fingerprint": self.fingerprint, "mm_hash": mm_hash},
        )
        if len(blob) > self.max_bytes:
            log.warning("embedding of %s (%d bytes) is larger than the export budget; not exported", mm_hash, len(blob))
            return
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with self._lock:
            self._bytes += len(blob) - self._files.pop(mm_hash, 0)
            self._files[mm_hash] = len(blob)
        self._evict()

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.max_bytes or not self._files:
                    return
                mm_hash, size = self._files.popitem(last=False)
                self._bytes -= size
                self.evicted += 1
            folder = self.directory / mm_hash
            (folder / FILE_NAME).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty (a write in progress elsewhere) or gone
                folder.rmdir()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
