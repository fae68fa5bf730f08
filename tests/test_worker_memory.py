"""release_free_memory hands a process's freed C-heap pages back to the OS (the soak's actor_infer creep)."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")

# In a new interpreter, so that the heap holds nothing else: 160 MB of small blocks (below the mmap threshold),
# all freed but the last, which pins the top of the heap, so glibc's own trimming on free gives nothing back.
PROBE = """
import ctypes, ctypes.util, json, psutil
from workers.base import release_free_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
proc = psutil.Process()
base = proc.memory_info().rss
blocks = [libc.malloc(4096) for _ in range(40_000)]
for block in blocks:
    ctypes.memset(block, 1, 4096)
for block in blocks[:-1]:
    libc.free(block)
freed = proc.memory_info().rss
release_free_memory()
trimmed = proc.memory_info().rss
print(json.dumps({"freed_mb": (freed - base) / 2**20, "trimmed_mb": (trimmed - base) / 2**20}))
"""


def test_freed_heap_pages_below_a_live_block_stay_resident_until_released():
    # glibc's malloc settings pinned to its defaults (a host may set others through the environment), one arena
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    } | {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=131072:glibc.malloc.mmap_threshold=131072"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    mb = json.loads(out.stdout.strip().splitlines()[-1])
    assert mb["freed_mb"] > 120, mb  # freed, yet resident
    assert mb["trimmed_mb"] < 20, mb  # handed back


def test_a_minimum_interval_skips_releases_that_come_too_soon(monkeypatch):
    from workers import base

    calls = []
    monkeypatch.setattr(base, "_libc_malloc_trim", lambda: calls.append)
    monkeypatch.setattr(base, "_last_release", time.monotonic())
    assert base.release_free_memory(min_interval_s=60.0) is False  # released a moment ago
    assert calls == []
    assert base.release_free_memory() is True  # no interval asked for: always
    assert calls == [0]
    monkeypatch.setattr(base, "_last_release", time.monotonic() - 61.0)
    assert base.release_free_memory(min_interval_s=60.0) is True
    assert calls == [0, 0]
    assert base.release_free_memory(min_interval_s=60.0) is False  # the release just now counts
    assert calls == [0, 0]
