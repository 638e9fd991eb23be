# syntax=docker/dockerfile:1
# encode-server image. CUDA runtime base by default; `--build-arg VARIANT=cpu` for a CPU-only image.
#   docker build -t encode-server .                        # CUDA 12.4, torch cu124 wheels
#   docker build -t encode-server:cpu --build-arg VARIANT=cpu .
# Multi-stage: the build stage installs into /opt/venv; the runtime stage copies only that venv onto
# the same base (same Python path), without pip caches or build tools. The model is not baked in:
# it is read from the hub or a mounted directory at start, and cached under the HF_HOME volume.
ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04
ARG CPU_IMAGE=python:3.11-slim-bookworm

FROM ${CUDA_IMAGE} AS base-cuda
# Ubuntu 22.04's Python is 3.10, which the project supports (requires-python >= 3.10).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124

FROM ${CPU_IMAGE} AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM base-${VARIANT} AS build
ARG TORCH_VERSION=2.6.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
# torch first, from the index that matches the variant, so the project's `torch>=2.4,<3` is already met.
RUN /opt/venv/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY encode_server ./encode_server
RUN /opt/venv/bin/pip install . \
    && /opt/venv/bin/encode-server --help >/dev/null

FROM base-${VARIANT} AS runtime
RUN groupadd --system --gid 10001 encode \
    && useradd --system --uid 10001 --gid encode --home-dir /home/encode --create-home encode \
    && mkdir -p /models \
    && chown encode:encode /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/models \
    ENCODE_SERVER_HOST=0.0.0.0 \
    ENCODE_SERVER_PORT=8000 \
    ENCODE_SERVER_LOG_FORMAT=json
# Hugging Face downloads (or a mounted model directory) live here, not in the image layer.
VOLUME ["/models"]
USER 10001:10001
EXPOSE 8000
# SIGTERM starts the drain (/ready 503, in-flight requests finish within ENCODE_SERVER_DRAIN_SECONDS);
# give `docker stop -t` / stop_grace_period more than that.
STOPSIGNAL SIGTERM
# Liveness only: /health answers while a large model is still loading; /ready is for routing.
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('ENCODE_SERVER_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["encode-server"]
