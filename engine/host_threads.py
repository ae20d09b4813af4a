"""CPU threads of a serving process: the scheduler's thread computes on every core, the rest on one.

torch runs its CPU ops' parallel regions on OpenMP (libgomp). Each thread that enters one gets a
team of its own, kept while the thread lives, and libgomp counts the threads of every team: once
they outnumber the cores, its threads no longer spin between regions but sleep, and every op of
a pass waits for its team to be woken. A server loads the model on its main thread (one team)
and computes on the scheduler's (another), so on 2 cores its blend passes took 1.3-2x as long
as the same passes on a thread alone in its process, and served blend TTFT 1.2-2x (docs/quality.md,
`python bench/host_threads_bench.py`).

So a server's start-up gives every thread one core for its torch ops (`compute_on_one_thread`:
the main thread's loading, retrieval's query embedding, KV reads and writes make no team), and
the scheduler's thread takes the cores (`take_cores`) for its prompt passes and decode steps.
A process that computes on its main thread (index, eval, a script) calls neither.
`RAGKV_HOST_THREADS=default` leaves torch's threads as they are.
"""

from __future__ import annotations

import os
import threading

_cores: int | None = None  # the engine thread's count, once `compute_on_one_thread` has run


def compute_on_one_thread() -> None:
    """From now on every thread's torch ops run on one core, but the thread that takes the cores
    (`take_cores`: torch's count so far). Call at start-up, before any torch op; with
    RAGKV_HOST_THREADS=default it does nothing."""
    global _cores
    if _cores is not None or os.environ.get("RAGKV_HOST_THREADS", "engine") == "default":
        return
    import torch

    _cores = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's, and the count every thread starts with


def take_cores() -> None:
    """The calling thread (the scheduler's) computes on the process's cores from now on; every other
    thread stays on one. Nothing changes unless `compute_on_one_thread` ran."""
    if _cores is None or _cores == 1:
        return
    import torch

    torch.get_num_threads()  # torch sets a thread's count at its first use: done now, so it is not set later
    torch.set_num_threads(_cores)  # this thread's count, but also the one threads not started yet begin with:
    reset = threading.Thread(target=torch.set_num_threads, args=(1,), name="ragkv-threads-reset")
    reset.start()  # so one thread sets it back to 1 for them (a thread's own count stays its own)
    reset.join()
