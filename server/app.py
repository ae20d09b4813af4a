"""RagServer: assembles the grpc.aio server and runs its life cycle.

start: bind, serve health (NOT_SERVING) and reflection at once, load the backend
(indexes and model) off the loop, then flip health to SERVING.
drain (SIGTERM/SIGINT): health NOT_SERVING, refuse new RPCs (UNAVAILABLE), give
in-flight requests `grace_seconds` to finish, cancel what is left, stop, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ragkv.engine.scheduler import Scheduler
from ragkv.server.admission import Admission
from ragkv.server.answering import QueryRunner
from ragkv.server.api_keys import KeyRing, check_exposure
from ragkv.server.auth import AuthInterceptor
from ragkv.server.backend import QueryBackend
from ragkv.server.metrics import ServerMetrics
from ragkv.server.service import RagService
from ragkv.server.settings import ServerSettings
from ragkv.server.undecodable import UndecodableRequestInterceptor
from ragkv.v1 import ragkv_pb2 as pb
from ragkv.v1 import ragkv_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RagService"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Answers carry whole chunk texts; allow sent messages well above gRPC's 4 MiB default.
# What a client sends is capped by settings.max_request_bytes.
_MAX_SEND_BYTES = 64 * 1024 * 1024

BackendFactory = Callable[[ServerSettings], QueryBackend]


class RagServer:
    """One ragkv gRPC server.

    Args:
        settings: The configuration.
        backend_factory: Builds the backend (slow: loads model and indexes); runs on a
            worker thread after the port is bound, while health says NOT_SERVING.
        metrics: Metrics to record into; a fresh registry by default.
    """

    def __init__(
        self, settings: ServerSettings, backend_factory: BackendFactory, metrics: ServerMetrics | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self._factory = backend_factory
        self._admission = Admission(settings.max_queue, self.metrics.queue_depth.set)
        self.keys: KeyRing = settings.key_ring()  # who may call: named keys, the single token, or none
        self._retrieve_pool = ThreadPoolExecutor(settings.retrieve_workers, thread_name_prefix="ragkv-retrieve")
        # The engine is not thread-safe: one scheduler thread runs every answer, batched.
        self._scheduler = Scheduler(settings.scheduler())
        self.metrics.watch_scheduler(self._scheduler.stats)
        self._runner = QueryRunner(admission=self._admission, metrics=self.metrics,
                                   retrieve_pool=self._retrieve_pool, scheduler=self._scheduler)
        self.service = RagService(
            keys=self.keys,
            limits=settings.limits(),
            admission=self._admission,
            metrics=self.metrics,
            retrieve_pool=self._retrieve_pool,
            runner=self._runner,
        )
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self.port: int | None = None  # bound gRPC port, after start()
        self.metrics_port: int | None = None  # bound metrics port, after start()
        self.http_port: int | None = None  # bound OpenAI-compatible HTTP port, after start(); None = off
        self._http = None  # http_server.HttpServer when settings.http_port is set
        self.load_error: BaseException | None = None  # why loading failed, if it did

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int:
        """Bind and start serving; loading continues in the background.

        Returns:
            The bound gRPC port.
        """
        s = self.settings
        check_exposure(s.host, self.keys, s.insecure_no_auth)  # fail closed: no credentials, no network port
        interceptors = []
        if self.keys.enabled:  # refuses a call without a key before its body is parsed
            interceptors.append(AuthInterceptor(
                self.keys, on_reject=lambda m: self.metrics.errors.labels(m.rsplit("/", 1)[-1], "UNAUTHENTICATED").inc()))
        # after auth, so a caller without the token hears UNAUTHENTICATED whatever it sent
        interceptors.append(UndecodableRequestInterceptor(
            on_reject=lambda m: self.metrics.errors.labels(m.rsplit("/", 1)[-1], "INVALID_ARGUMENT").inc()))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", s.max_request_bytes),
                ("grpc.max_send_message_length", _MAX_SEND_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_RagServiceServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        address = f"{s.host}:{s.port}"
        if s.tls_cert is not None and s.tls_key is not None:
            creds = grpc.ssl_server_credentials([(s.tls_key.read_bytes(), s.tls_cert.read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind the gRPC port at {address}")
        await self._set_health(_NOT_SERVING)
        await server.start()
        self._server, self.port = server, port
        if s.metrics_port is not None:
            self.metrics_port = self.metrics.serve(s.metrics_port, s.metrics_host)
        if s.http_port is not None:
            self.http_port = await self._start_http()
        self._load_task = asyncio.create_task(self._load())
        log.info("ragkv serving on %s:%d (tls=%s, keys=%s)", s.host, port, s.tls_cert is not None,
                 ", ".join(self.keys.names) or "none: open")
        return port

    async def _start_http(self) -> int:
        """Serve the OpenAI-compatible API on this loop, over the same backend and scheduler."""
        from ragkv.server.http_server import HttpServer  # starlette/uvicorn only when asked for
        from ragkv.server.openai_api import OpenAIApi
        from ragkv.server.responses_api import with_responses

        s = self.settings
        api = OpenAIApi(runner=self._runner, admission=self._admission, limits=s.limits(), metrics=self.metrics,
                        backend=lambda: self.service.backend, keys=self.keys, max_body_bytes=s.max_request_bytes)
        self._http = HttpServer(with_responses(api, s), s.host, s.http_port, s.tls_cert, s.tls_key)
        port = await self._http.start()
        log.info("OpenAI-compatible HTTP API on %s:%d (/v1/chat/completions, /v1/models, /health)", s.host, port)
        return port

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            backend = await loop.run_in_executor(self._retrieve_pool, self._factory, self.settings)
        except Exception as exc:  # a server that cannot load must not linger NOT_SERVING
            self.load_error = exc
            log.error("loading the backend failed; stopping", exc_info=exc)
            asyncio.ensure_future(self.drain(0.0))
            return
        self.service.backend = backend
        parts = backend.parts()
        if parts.tier_errors is not None:
            self.metrics.watch_tier_errors(parts.tier_errors)
        if parts.kv_tree is not None:
            self.metrics.watch_kv_tree(parts.kv_tree.stats)
        self.metrics.observe_served(parts.served)
        if parts.decoder is not None:
            decoder = parts.decoder
            self.metrics.watch_decoder(lambda: decoder.stats, lambda: decoder.pool)
        if parts.speed is not None:  # its tree counts in --kv-budget-bytes; its decoder runs the decode steps
            self._scheduler.share_engine(parts.kv_tree, parts.speed, parts.decoder)
        await self._set_health(_SERVING)
        log.info("backend loaded: %d collection(s)", len(backend.collections()))

    async def wait_loaded(self, timeout: float) -> bool:
        """Wait for loading to finish; True when the backend is serving."""
        if self._load_task is None:
            raise RuntimeError("wait_loaded() before start(): a caller bug")
        await asyncio.wait_for(asyncio.shield(self._load_task), timeout)
        return self.service.backend is not None

    async def drain(self, grace: float | None = None) -> None:
        """Stop gracefully: NOT_SERVING, refuse new RPCs, let in-flight ones finish, stop."""
        if self._server is None or self._stopped.is_set():
            return
        grace = self.settings.grace_seconds if grace is None else grace
        log.info("draining: %d RPC(s) in flight, grace %.1f s", self._admission.in_flight, grace)
        await self._set_health(_NOT_SERVING)
        self._admission.start_draining()
        finished = await self._admission.wait_idle(grace)
        if not finished:
            log.warning("grace period over with %d RPC(s) in flight; cancelling them", self._admission.in_flight)
        if self._http is not None:
            await self._http.stop()
        await self._server.stop(0)
        if self._load_task is not None and self._load_task is not asyncio.current_task():
            self._load_task.cancel()
        self.metrics.close()
        self._retrieve_pool.shutdown(wait=False, cancel_futures=True)
        self._scheduler.close(timeout=5.0)
        await self._persist_conversations()
        self._stopped.set()

    async def _persist_conversations(self) -> None:
        """Write the KV tree's conversations to its disk tier (--kv-tree-dir), for the next server."""
        backend = self.service.backend
        tree = None if backend is None else backend.parts().kv_tree
        if tree is None or tree.files is None:
            return
        try:
            written = await asyncio.get_running_loop().run_in_executor(None, tree.persist)
            log.info("KV tree: %d node(s) written to its disk tier for the next start", written)
        except Exception:  # a full disk: the conversations are recomputed, the stop goes on
            log.exception("KV tree: could not write its conversations to disk")

    async def wait_stopped(self) -> None:
        """Return once drain() has finished."""
        await self._stopped.wait()


async def run(settings: ServerSettings, backend_factory: BackendFactory) -> int:
    """Serve until SIGTERM or SIGINT, then drain.

    Returns:
        The exit status: 0 after a drain, 1 when loading the backend failed.
    """
    server = RagServer(settings, backend_factory)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    await server.wait_stopped()
    if server.load_error is not None:
        log.error("exiting: %s", server.load_error)
        return 1
    log.info("stopped")
    return 0
