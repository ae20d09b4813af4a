"""The RAGKV_ environment variables ragkv reads, and a warning for any other.

A misspelt or retired variable (RAGKV_DISK_DIR for RAGKV_KV_DISK_DIR) would otherwise be
ignored without a word; `ragkv serve` and `ragkv index` warn about each at start.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping

from ragkv.cli.index import ENV_NAMES as INDEX_ENV_NAMES

log = logging.getLogger("ragkv.cli")

PREFIX = "RAGKV_"
# read outside the settings objects: name -> where
OTHER_ENV = {
    "RAGKV_CACHE_DIR": "engine.model_loading.cache_dir: converted models, staging, synced indexes",
    "RAGKV_AUTH_TOKEN": "server.auth (the server's token) and ragkv query / the SDK (the client's)",
    "RAGKV_HOST_ALLOCATOR": "engine.kv.host_allocator: `default` keeps glibc's malloc as shipped",
    "RAGKV_HOST_THREADS": "engine.host_threads: `default` leaves every thread of a server on torch's count",
    "RAGKV_ADDR": "ragkv query and ragkv.langchain: the server address",
}


def known_env() -> frozenset[str]:
    """Every RAGKV_ variable some part of ragkv reads."""
    import dataclasses

    from ragkv.server.settings import ENV_PREFIX, ServerSettings

    serve = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(ServerSettings)}
    return frozenset(serve | set(INDEX_ENV_NAMES) | set(OTHER_ENV))


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """The RAGKV_ variables in ``env`` (default os.environ) that nothing reads, sorted."""
    env = os.environ if env is None else env
    known = known_env()
    return sorted(k for k in env if k.startswith(PREFIX) and k not in known)


def warn_unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """Log a warning for each unknown RAGKV_ variable, with the nearest known name; returns them."""
    unknown = unknown_env(env)
    known = sorted(known_env())
    for name in unknown:
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
        hint = f" (did you mean {near[0]}?)" if near else ""
        log.warning("environment variable %s is not a ragkv setting and is ignored%s; known: "
                    "`ragkv serve --help` options as RAGKV_<OPTION>, %s", name, hint,
                    ", ".join(sorted(set(INDEX_ENV_NAMES) | set(OTHER_ENV))))
    return unknown
