"""The allocator tuning and the idle give-back: freed heap memory stays for reuse while requests
come, and goes back to the OS once they stop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from encode_server.app import give_back_memory
from encode_server.core.budget import ByteBudget
from encode_server.malloc import _glibc

glibc = pytest.mark.skipif(_glibc() is None, reason="glibc's allocator only (musl, macOS: nothing to tune)")

_PROBE = textwrap.dedent("""
    import sys
    from encode_server.malloc import release_free_memory, tune_allocator

    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024

    assert tune_allocator()
    blocks, pins = [], []
    for _ in range(96):
        blocks.append(bytearray(1 << 20))  # under the 16 MiB threshold: from the heap
        pins.append(bytearray(4096))  # kept between them: freed blocks cannot merge into the top
    grown = rss_mib()
    del blocks
    kept = rss_mib()
    assert release_free_memory()
    print(grown, kept, rss_mib())
""")


@glibc
def test_freed_heap_memory_is_kept_for_reuse_until_given_back() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=60)
    grown, kept, after = map(int, out.stdout.split())
    assert kept > grown - 16, "freed 1 MiB buffers were unmapped: each request would fault them in again"
    assert after < kept - 64, f"malloc_trim gave back too little: {kept} -> {after} MiB"


def test_memory_is_given_back_once_requests_stop_and_every_busy_period_under_load() -> None:
    budget = ByteBudget(None)
    calls: list[float] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(
            give_back_memory(budget, quiet_s=0.02, busy_s=1.0, release=lambda: calls.append(loop.time()))
        )
        await asyncio.sleep(0.15)
        assert not calls, "nothing happened: nothing to give back"
        with budget.charged(10):  # a request in flight is not quiet, however long it takes
            await asyncio.sleep(0.1)
        assert not calls
        await asyncio.sleep(0.15)
        assert len(calls) == 1, "quiet after a request: given back once"
        await asyncio.sleep(0.15)
        assert len(calls) == 1, "and not again while nothing comes"
        started = loop.time()
        while loop.time() - started < 2.3:  # steady load: a request every 5 ms, never quiet
            with budget.charged(1):
                await asyncio.sleep(0.005)
        assert 2 <= len(calls) - 1 <= 3, calls  # every busy_s under load
        task.cancel()

    asyncio.run(scenario())
