"""A child process that runs file parsers on untrusted input, under a time and a memory limit.

A crafted PDF, HTML or .docx file can make its parser run for hours or allocate gigabytes
(decompression bombs, pathological markup). `Sandbox.call` runs a parsing function, named
``"module:function"``, in a child Python process whose address space is capped
(``RLIMIT_AS``): an allocation past the cap fails there, not in the indexer. The call waits
at most a given number of seconds; past it the child is killed. Either way the caller gets a
`SandboxOverrun` saying which, and a later call starts a fresh child.

The child is reused across calls (starting one costs a Python start and the parsers'
imports, about half a second), so a corpus of many small documents costs one start. It reads
requests from its stdin and writes replies to its stdout, one JSON line each: a reply is
data (lists, dicts, strings, numbers), never pickled objects, so whatever a hostile file does
to the parser cannot become code in the indexer.

POSIX only (``resource``, ``select``); elsewhere `Sandbox.call` runs the function in-process.

Knows nothing of documents: the functions it runs are named by their callers.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

SUPPORTED = os.name == "posix"
_START_TIMEOUT_S = 60.0  # a child's Python start and first imports (not counted in a call's time)
_BOOT = "from ragkv.indexer.sandbox import _serve; _serve()"


class SandboxError(Exception):
    """The function raised in the child: ``kind`` is its exception's class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class SandboxOverrun(Exception):
    """The child ran past its time or memory limit, or died (``reason``: "time", "memory", "crash")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Sandbox:
    """One child process at a time, started on first use and replaced after an overrun."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._memory: int | None = None  # the running child's address-space cap, bytes (0: none)
        self._owner = os.getpid()  # a forked copy of this object must not use its parent's child
        self._lock = threading.Lock()
        self.started = 0  # children started (tests count them)

    def call(self, target: str, args: list[Any], *, timeout_s: float, memory_bytes: int,
             max_reply_bytes: int) -> Any:
        """``target(*args)`` in the child; its JSON-able return value.

        Args:
            target: ``"package.module:function"``.
            timeout_s: Seconds the call may take (the child's start not counted).
            memory_bytes: The child's address-space cap (0: none).
            max_reply_bytes: The longest reply accepted; a longer one is an overrun ("memory").

        Raises:
            SandboxError: The function raised (its message and class name).
            SandboxOverrun: Past ``timeout_s``, past ``memory_bytes``, a reply past
                ``max_reply_bytes``, or the child died.
        """
        if not SUPPORTED:
            module, _, name = target.partition(":")
            return getattr(importlib.import_module(module), name)(*args)
        with self._lock:
            proc = self._child(memory_bytes)
            request = json.dumps({"target": target, "args": args}).encode() + b"\n"
            try:
                assert proc.stdin is not None
                proc.stdin.write(request)
                proc.stdin.flush()
            except (BrokenPipeError, OSError):  # died since the last call (killed from outside): once more
                self._stop()
                proc = self._child(memory_bytes)
                assert proc.stdin is not None
                proc.stdin.write(request)
                proc.stdin.flush()
            try:
                reply = self._read(proc, time.monotonic() + timeout_s, timeout_s, max_reply_bytes)
            except SandboxOverrun:
                raise
            except BaseException:  # interrupted: the child's reply would answer the next call
                self._stop()
                raise
        if "ok" in reply:
            return reply["ok"]
        if reply.get("overrun") == "memory":
            with self._lock:
                self._stop()  # a MemoryError may leave the child's state half-made: a fresh one next
            raise SandboxOverrun("memory", reply.get("message", "out of memory"))
        raise SandboxError(reply.get("kind", "Exception"), reply.get("message", ""))

    def close(self) -> None:
        """Stop the child (a later call starts another)."""
        with self._lock:
            self._stop()

    def _child(self, memory_bytes: int) -> subprocess.Popen[bytes]:
        if self._owner != os.getpid():  # forked: the child belongs to the parent process
            self._proc, self._owner = None, os.getpid()
        if self._proc is not None and (self._proc.poll() is not None or self._memory != memory_bytes):
            self._stop()
        if self._proc is None:
            proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    bufsize=0, close_fds=True)
            self._proc, self._memory = proc, memory_bytes
            self.started += 1
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"path": [p for p in sys.path if isinstance(p, str)],
                                         "memory_bytes": memory_bytes}).encode() + b"\n")
            proc.stdin.flush()
            reply = self._read(proc, time.monotonic() + _START_TIMEOUT_S, _START_TIMEOUT_S, 1 << 16)
            if not reply.get("ready"):
                self._stop()
                raise SandboxOverrun("crash", f"the parser process did not start: {reply.get('message', reply)}")
        return self._proc

    def _read(self, proc: subprocess.Popen[bytes], deadline: float, timeout_s: float,
              max_bytes: int) -> dict[str, Any]:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop()
                raise SandboxOverrun("time", f"the parser ran past its time limit of {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # the child ended: killed by the kernel (memory), or crashed
                code = proc.wait()
                self._proc = None
                raise SandboxOverrun("memory" if code < 0 else "crash",
                                     f"the parser process died ({_exit_text(code)}), most likely past its memory limit")
            buf += chunk
            if buf.endswith(b"\n"):
                return json.loads(bytes(buf))
            if len(buf) > max_bytes:
                self._stop()
                raise SandboxOverrun("memory", f"the parser's output passed {max_bytes:,} bytes")

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _exit_text(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


SANDBOX = Sandbox()
atexit.register(SANDBOX.close)


def _serve() -> None:
    """The child: cap the address space, then answer one JSON request per line until stdin ends."""
    proto = os.fdopen(os.dup(1), "wb")  # replies go here; anything a parser prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    config = json.loads(sys.stdin.buffer.readline())
    sys.path[:] = config["path"]
    import logging
    import resource

    logging.basicConfig(level=logging.WARNING, format="ragkv parser process: %(name)s: %(message)s")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if config["memory_bytes"] > 0:
        resource.setrlimit(resource.RLIMIT_AS, (config["memory_bytes"], config["memory_bytes"]))

    def send(obj: dict[str, Any]) -> None:
        # a lone surrogate (a PDF's broken text) goes as its JSON escape, \udXXX
        proto.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n")
        proto.flush()

    send({"ready": True})
    functions: dict[str, Any] = {}
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            target = request["target"]
            if target not in functions:
                module, _, name = target.partition(":")
                functions[target] = getattr(importlib.import_module(module), name)
            result = functions[target](*request["args"])
            send({"ok": result})
        except MemoryError:
            send({"overrun": "memory", "message": "the parser ran out of memory"})
            return  # the caller starts a fresh process
        except Exception as exc:  # the caller re-raises it, naming the file
            send({"kind": type(exc).__name__, "message": str(exc)})
