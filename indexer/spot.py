"""Stopping cleanly on a Spot interruption notice or SIGTERM.

A watcher thread polls the EC2 instance metadata service (IMDSv2: PUT a session
token, then GET ``/latest/meta-data/spot/instance-action``; 404 means no notice)
and a SIGTERM handler does the same job: both set one ``StopSignal``. The index
job checks it between batches, finishes the batch in flight, flushes, checkpoints
and raises ``IndexInterrupted``; the CLI turns that into exit code 75
(EX_TEMPFAIL), which the Batch job's retry policy matches.
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import urllib.error
import urllib.request
from types import FrameType

from ragkv.errors import RagKVError

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: interrupted, safe to retry the same command
DEFAULT_IMDS_ENDPOINT = "http://169.254.169.254"
_TOKEN_PATH = "/latest/api/token"
_ACTION_PATH = "/latest/meta-data/spot/instance-action"
_TOKEN_TTL_S = 21600  # seconds an IMDSv2 token lives (the maximum)

log = logging.getLogger(__name__)


class StopReason(enum.Enum):
    """Why a job was asked to stop."""

    SIGTERM = "sigterm"  # the process got SIGTERM (Batch/ECS stop, docker stop, Spot)
    SPOT_NOTICE = "spot_notice"  # IMDS announced a Spot interruption
    REQUESTED = "requested"  # code asked (tests, embedding callers)


class IndexInterrupted(RagKVError):
    """The job stopped early on request; everything finished so far is saved.

    Rerun the same command to resume. The CLI exits with ``EXIT_INTERRUPTED``.
    """

    def __init__(self, reason: StopReason, detail: str = "") -> None:
        super().__init__(
            f"indexing stopped ({reason.value}{': ' + detail if detail else ''}); progress is "
            f"saved: rerun the same command to resume"
        )
        self.reason = reason  # why it stopped


class StopSignal:
    """A one-way flag: once set, stays set, remembering the first reason."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: StopReason | None = None  # the first reason given
        self.detail = ""  # e.g. the IMDS notice body

    def set(self, reason: StopReason, detail: str = "") -> None:
        if not self._event.is_set():
            self.reason, self.detail = reason, detail
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def check(self) -> None:
        """Raise IndexInterrupted when set."""
        if self.is_set():
            raise IndexInterrupted(self.reason or StopReason.REQUESTED, self.detail)


class SpotWatcher:
    """Sets ``stop`` on SIGTERM and, with an endpoint, on an IMDS Spot interruption notice.

    Use as a context manager around the job; the previous SIGTERM handler comes back
    on exit. Signal handlers can only be installed from the main thread; elsewhere
    only the IMDS poller runs.
    """

    def __init__(
        self, stop: StopSignal, endpoint: str | None = None, interval_s: float = 5.0,
        timeout_s: float = 1.0,
    ) -> None:
        self.stop = stop  # the flag to set
        self.endpoint = endpoint.rstrip("/") if endpoint else None  # IMDS base URL, None = no polling
        self.interval_s = interval_s  # seconds between polls (AWS gives a 2-minute notice)
        self.timeout_s = timeout_s  # seconds per HTTP request
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_handler: object = None

    def __enter__(self) -> SpotWatcher:
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.endpoint:
            self._thread = threading.Thread(target=self._poll, name="spot-watcher", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s * 3 + 1)
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)  # type: ignore[arg-type]

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.stop.set(StopReason.SIGTERM)

    def _poll(self) -> None:
        token: str | None = None
        while not self._done.is_set() and not self.stop.is_set():
            try:
                if token is None:
                    token = self._token()
                notice = self._instance_action(token)
                if notice is not None:
                    log.warning("spot interruption notice: %s", notice)
                    self.stop.set(StopReason.SPOT_NOTICE, notice)
                    return
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    token = None  # expired token: fetch a new one next round
                else:
                    log.debug("IMDS poll failed: %s", exc)
            except (urllib.error.URLError, OSError) as exc:
                log.debug("IMDS unreachable at %s: %s", self.endpoint, exc)
            self._done.wait(self.interval_s)

    def _token(self) -> str:
        req = urllib.request.Request(
            f"{self.endpoint}{_TOKEN_PATH}", method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return resp.read().decode("utf-8").strip()

    def _instance_action(self, token: str) -> str | None:
        req = urllib.request.Request(
            f"{self.endpoint}{_ACTION_PATH}", headers={"X-aws-ec2-metadata-token": token}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None  # no interruption scheduled
            raise
