"""A serving process's CPU threads (engine/host_threads.py): the scheduler's thread computes on the
cores, every other thread on one, so that only one OpenMP team is ever busy. Each case runs in a
process of its own: torch's thread counts hold for the whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROCESS = r"""
import json, threading, torch
from ragkv.engine.host_threads import compute_on_one_thread
from ragkv.engine.request import Finished, Request
from ragkv.engine.scheduler import Scheduler, SchedulerConfig

compute_on_one_thread()  # what `ragkv serve` does first
seen = {}

def look(name):
    torch.ones(100_000).sum()  # a parallel op: the thread's count is set by now
    seen[name] = torch.get_num_threads()

before = threading.Thread(target=look, args=("a thread started before",)); before.start(); before.join()
sched = Scheduler(SchedulerConfig())
ended = threading.Event()

def work():
    look("the scheduler's thread")
    return None
    yield

sched.submit(Request(), work(), lambda out: ended.set() if isinstance(out, Finished) else None)
assert ended.wait(30)
after = threading.Thread(target=look, args=("a thread started after",)); after.start(); after.join()
look("the main thread")
sched.close()
print(json.dumps(seen))
"""


def _threads_seen(mode: str) -> dict[str, int]:
    env = {**os.environ, "RAGKV_HOST_THREADS": mode, "OMP_NUM_THREADS": "2"}  # 2 cores, whatever the host has
    done = subprocess.run([sys.executable, "-c", _PROCESS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return seen


def test_a_server_computes_on_the_schedulers_thread_alone() -> None:
    """As `ragkv serve` starts: the scheduler's thread takes the process's 2 cores; the main thread
    (which loads the model) and every other thread, started before or after, run on one, so they
    open no OpenMP team of their own beside the scheduler's (with two, libgomp stops spinning
    between regions and a pass's every op waits for a wake-up: bench/host_threads_bench.py)."""
    assert _threads_seen("engine") == {"a thread started before": 1, "the scheduler's thread": 2,
                                       "a thread started after": 1, "the main thread": 1}


def test_with_default_every_thread_keeps_torchs_count() -> None:
    """RAGKV_HOST_THREADS=default (and any process that does not call `compute_on_one_thread`: index,
    eval, the tests' in-process servers): the scheduler changes no thread's count."""
    assert _threads_seen("default") == {"a thread started before": 2, "the scheduler's thread": 2,
                                        "a thread started after": 2, "the main thread": 2}
