"""engine.memory: the host allocator tuning applies on glibc and can be turned off."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_PROBE = "import os, ragkv.engine.memory as m; print(m.tune_host_allocator(), os.environ['THP_MEM_ALLOC_ENABLE'])"


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
