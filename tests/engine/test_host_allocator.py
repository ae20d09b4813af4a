"""engine.kv.host_allocator: the host allocator tuning applies on glibc and can be turned off."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_PROBE = "import os, ragkv.engine.kv.host_allocator as m; print(m.tune_host_allocator(), os.environ['THP_MEM_ALLOC_ENABLE'])"


def _probe(**env: str) -> str:
    import os

    full = {k: v for k, v in os.environ.items() if k not in ("RAGKV_HOST_ALLOCATOR", "THP_MEM_ALLOC_ENABLE")}
    return subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env={**full, **env}, check=True,
                          capture_output=True, text=True).stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc's")
def test_tuned_on_glibc_unless_asked_not_to():
    assert _probe() == ["True", "1"]
    assert _probe(RAGKV_HOST_ALLOCATOR="default") == ["False", "1"]
    assert _probe(THP_MEM_ALLOC_ENABLE="0") == ["True", "0"]  # an explicit setting wins


_HOLE = """
import ctypes, ragkv.engine.kv.host_allocator as m
m.tune_host_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) // 1024
hole = libc.malloc(256 << 20)
ctypes.memset(hole, 1, 256 << 20)
above = libc.malloc(1 << 20)  # keeps the freed block inside the heap, not at its top
ctypes.memset(above, 1, 1 << 20)
libc.free(ctypes.c_void_p(hole))
before = rss()
print(m.trim_host_heap(), before, rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_gives_a_freed_hole_back_that_the_tuned_heap_keeps():
    trimmed, before, after = subprocess.run([sys.executable, "-c", _HOLE], cwd=REPO, check=True,
                                            capture_output=True, text=True).stdout.split()
    assert trimmed == "True"
    assert int(before) - int(after) >= 200, (before, after)  # MiB: the 256 MiB hole was resident until the trim
