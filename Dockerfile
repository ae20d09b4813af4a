# ragkv image for the AWS Batch indexing jobs and, optionally, the serving hosts.
#
#   docker build -t ragkv:0.1.0 .                       # GPU build (CUDA wheels from PyPI)
#   docker build --build-arg EXTRAS=server -t ragkv:cpu .
#
# The NVIDIA driver comes from the host (Batch's ECS_AL2_NVIDIA AMI, the Deep
# Learning AMI with the NVIDIA container toolkit); torch's wheels bring CUDA.
# No ENTRYPOINT: Batch runs `sh -c "exec ragkv index ..."` (see
# terraform/modules/indexing), and the default CMD serves an index mounted at
# /var/lib/ragkv/index.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ragkv ./ragkv
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
    RAGKV_DISK_DIR=/var/lib/ragkv/kv

COPY --from=build /wheels /wheels
# The wheel's name is only known after the build; "$1[extras]" keeps the
# brackets away from the shell's globbing.
RUN set -eu; set -- /wheels/ragkv-*.whl; \
    pip install "$1[${EXTRAS}]" grpcio-health-checking; \
    rm -rf /wheels

RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/ragkv --shell /usr/sbin/nologin ragkv \
 && install -d -o ragkv -g ragkv /var/lib/ragkv/cache /var/lib/ragkv/kv /var/lib/ragkv/index
USER ragkv
WORKDIR /var/lib/ragkv

EXPOSE 50051 9090
# ragkv drains in-flight streams on SIGTERM; the indexer checkpoints and exits 75.
STOPSIGNAL SIGTERM
# Health is judged outside: the NLB via grpc.health.v1, Batch by the exit code.
# A Docker HEALTHCHECK would mark every indexing container unhealthy.
HEALTHCHECK NONE
CMD ["ragkv", "serve", "--index", "/var/lib/ragkv/index", "--port", "50051", "--metrics-port", "9090"]
