"""Shared fixtures: no hub at test time, tiny random models, the shipped SmolLM2 and
embedder, and a small corpus for the indexer and retriever tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a test process computes on its main thread too: the benches' in-process servers leave torch's threads
# as they are (tests/engine/test_host_threads.py sets up a server's in processes of their own)
os.environ.setdefault("RAGKV_HOST_THREADS", "default")

import pytest

# The slow part of the suite, marked `slow` here by where it lives: the model-judgement tests
# (the agents' standard suites and cited answers on the shipped SmolLM2) and the benches' smoke
# runs. `make test` leaves them out; `make test-slow` runs them; CI (.ci/run) runs both.
SLOW_PATHS = ("tests/agents/", "tests/bench/test_soak.py", "tests/bench/test_slow_tier.py", "tests/bench/test_slow_client.py",
              "tests/cli/test_eval_bench.py", "tests/bench/test_agents_bench.py", "tests/test_gpu_bench.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        rel = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if rel.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with the session's status once every report is written, without the interpreter's
    teardown of native libraries (torch, FAISS, gRPC, Ray threads): with the slow tests running
    beside the rest (.ci/run), one run's pytest passed every test and then died of SIGSEGV in
    that teardown. RAGKV_TEST_HARD_EXIT=0 keeps the teardown (to chase the crash)."""
    if _EXIT_STATUS and os.environ.get("RAGKV_TEST_HARD_EXIT", "1") != "0":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from ragkv.evals.testing import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def smollm2():
    """The real shipped model (converted from GGUF once, then loaded from the cache)."""
    from ragkv.engine import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M (the `gemma` extra), converted once; skips naming the extra when absent."""
    import importlib.util

    from ragkv.engine import load_model
    from ragkv.engine.model_loading import SHIPPED

    shipped = SHIPPED["gemma3-270m"]
    if importlib.util.find_spec(shipped.module) is None:
        pytest.skip(f"Gemma 3 270M is not installed: it comes with the gemma extra ({shipped.install})")
    return load_model(shipped.name, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_lm(tiny_llama_dir):
    from ragkv.engine import load_model

    return load_model(str(tiny_llama_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def embedder():
    from ragkv.retriever.embedder import Embedder

    return Embedder.load()


@pytest.fixture()
def corpus(tmp_path):
    from tests.indexer.helpers import write_corpus

    return write_corpus(tmp_path / "corpus")


@pytest.fixture()
def job_config(tmp_path, corpus, tiny_llama_dir):
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig
    from tests.indexer.helpers import CHUNK_SIZE, OVERLAP

    return IndexJobConfig(corpus=corpus, out=tmp_path / "index", model=str(tiny_llama_dir),
                          chunking=ChunkingConfig(CHUNK_SIZE, OVERLAP), progress=False, kv_batch=2)
