"""The KV step on a Ray cluster: the local job's per-batch function mapped over Ray actors.

Each actor loads the model once and opens its own kvstore, then runs
``KVWriter.compute`` and ``KVWriter.write`` (the very functions the local runner
overlaps on threads) for one batch per call, so the store gets the same files.
The driver keeps the chunk database: ``run`` calls ``on_done(batch, nbytes)`` in
the driver once a batch is durable, exactly as ``KVWriter.run`` does.

The actors write to the tiers in ``kv_uris`` themselves: a ``disk:`` tier must be
a path every node sees (one machine, or a shared file system); use ``s3://`` on a
multi-node cluster. Every node needs ragkv installed with the same model files.

Ray is imported only when a runner is built (``ragkv index --runner ray``). This
module knows nothing of the chunk database, the corpus or FAISS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.errors import IndexMismatchError, RagKVError
from ragkv.indexer.kv_job import KVItem, KVWriter, open_store

INSTALL_HINT = "pip install 'ragkv[ray]'"
IN_FLIGHT_PER_WORKER = 2  # batches queued on each actor, so it never idles while the driver marks one done


def import_ray() -> Any:
    """The ``ray`` module, or a RagKVError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RagKVError(f"--runner ray needs Ray, which is not installed ({exc}): {INSTALL_HINT}") from exc
    return ray


@dataclass(frozen=True, slots=True)
class RayRunnerConfig:
    """Where the actors run and what they load."""

    model: str  # LLM spec for engine.load_model, resolvable on every node
    device: str  # torch device inside each actor: "cpu" or "cuda"
    dtype: str  # LLM dtype: float32, bfloat16, float16
    kv_uris: tuple[str, ...]  # kvstore tiers each actor writes through
    address: str | None = None  # ray.init address; None: $RAY_ADDRESS or a new local instance
    workers: int = 0  # actors; 0: one per GPU of the cluster (cuda) or one per CPU (cpu)
    kv_compression: str = "none"  # how the KV files store K and V: none, int8, fp8, int4 or int2


class KVBatchWorker:
    """One Ray actor's state: the loaded model, a store and the local job's KVWriter.

    A plain class so that tests and ``ray.remote`` share it; ``RayKVRunner`` wraps it.
    """

    def __init__(self, config: RayRunnerConfig, prefix_ids: Sequence[int], threads: int) -> None:
        import torch

        from ragkv.engine import Engine, load_model

        if config.device == "cpu":
            torch.set_num_threads(threads)  # the actor's CPU share, not every core of the node
        self.lm = load_model(config.model, device=config.device, dtype=config.dtype)
        self.store = open_store(config.kv_uris, self.lm.fingerprint, self.lm.tokenizer_fingerprint,
                                config.kv_compression)
        self.writer = KVWriter(Engine(self.lm), self.store, prefix_ids)

    def fingerprints(self) -> tuple[str, str]:
        """(model, tokenizer) fingerprints, for the driver to check against its own."""
        return str(self.lm.fingerprint), str(self.lm.tokenizer_fingerprint)

    def run_batch(self, batch: Sequence[KVItem]) -> int:
        """Compute and store one batch; returns the KV bytes written once it is durable."""
        return self.writer.write(batch, self.writer.compute(batch))

    def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            close()


class RayKVRunner:
    """Runs KV batches on Ray actors; a context manager with ``KVWriter.run``'s contract.

    Args:
        config: cluster address, worker count and what each actor loads.
        prefix_ids: the shared prefix.
        model_fp: the driver's model fingerprint (the chunk keys were built with it).
        tokenizer_fp: the driver's tokenizer fingerprint.
    """

    def __init__(self, config: RayRunnerConfig, prefix_ids: Sequence[int], model_fp: str,
                 tokenizer_fp: str) -> None:
        if config.workers < 0:
            raise ValueError(f"ray workers={config.workers}: give a count >= 1, or 0 for one per CPU/GPU")
        self.config = config  # what the actors load
        self.prefix_ids = list(prefix_ids)  # the shared prefix
        self.expected_fps = (str(model_fp), str(tokenizer_fp))  # the actors must load this model
        self._ray: Any = None
        self._started_ray = False  # we called ray.init, so we shut it down
        self._actors: list[Any] = []

    def __enter__(self) -> RayKVRunner:
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=self.config.address, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        try:
            self._start_actors(ray)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        ray = self._ray
        if ray is None:
            return
        for actor in self._actors:
            try:
                ray.get(actor.close.remote())
            except ray.exceptions.RayError:
                pass  # a dead actor holds no open store
            ray.kill(actor)
        self._actors = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def _start_actors(self, ray: Any) -> None:
        cuda = self.config.device.startswith("cuda")
        resources = ray.cluster_resources()
        n = self.config.workers or int(resources.get("GPU" if cuda else "CPU", 0))
        if n < 1:
            raise RagKVError(
                f"the Ray cluster has no {'GPU' if cuda else 'CPU'} for a KV worker ({resources}): "
                "pass --ray-workers or connect to another --ray-address"
            )
        options = {"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": 1}
        remote_cls = ray.remote(**options)(KVBatchWorker)
        self._actors = [remote_cls.remote(self.config, self.prefix_ids, 1) for _ in range(n)]
        for fps in ray.get([a.fingerprints.remote() for a in self._actors]):
            if fps != self.expected_fps:
                raise IndexMismatchError(
                    f"a Ray worker loaded {self.config.model!r} with fingerprints {fps}, the driver "
                    f"{self.expected_fps}: every node must have the same model files"
                )

    def run(
        self,
        batches: Sequence[Sequence[KVItem]],
        on_done: Callable[[Sequence[KVItem], int], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Compute and store each batch on the actors; ``on_done(batch, nbytes)`` in this thread.

        No batch is started once ``should_stop()`` turns true; batches already running are
        finished and handed to ``on_done``. On a failure the running batches are finished
        too, then the first error is raised (the worker's own exception, not Ray's wrapper).
        """
        ray = self._ray
        if ray is None:
            raise RuntimeError("RayKVRunner.run outside its `with` block: this is a bug")
        todo = iter(batches)
        running: dict[Any, tuple[Sequence[KVItem], Any]] = {}  # ObjectRef -> (batch, actor)
        failure: list[BaseException] = []

        def submit(actor: Any) -> None:
            if failure or should_stop():
                return
            batch = next(todo, None)
            if batch is not None:
                running[actor.run_batch.remote(list(batch))] = (batch, actor)

        for _ in range(IN_FLIGHT_PER_WORKER):
            for actor in self._actors:
                submit(actor)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            batch, actor = running.pop(ready[0])
            try:
                nbytes = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                failure.append(cause if isinstance(cause, Exception) else exc)
                continue
            except ray.exceptions.RayError as exc:  # the actor or its node died
                failure.append(exc)
                continue
            on_done(batch, nbytes)
            submit(actor)
        if failure:
            raise failure[0]
