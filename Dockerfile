# syntax=docker/dockerfile:1
# encode-server image. CUDA runtime base by default; `--build-arg VARIANT=cpu` for a CPU-only image.
# The two variants share every step: they differ only in the base image and the index torch comes from.
#   docker build -t encode-server .                                  # CUDA 12.8, torch cu128 wheels
#   docker build -t encode-server:cpu --build-arg VARIANT=cpu .
#   podman build --format docker -t encode-server:cpu --build-arg VARIANT=cpu .   # OCI drops HEALTHCHECK
#
# Build arguments for a proxy, a mirror, an air-gapped host or a local wheelhouse; all unset by
# default, so that a plain build on a host with internet uses PyPI and download.pytorch.org:
#   TORCH_INDEX_URL      the index torch comes from (default: the variant's download.pytorch.org index)
#   PIP_INDEX_URL        the index for everything else (default: PyPI)
#   PIP_EXTRA_INDEX_URL  more indexes, space-separated
#   PIP_FIND_LINKS       wheel directories or URLs, space-separated (mount a directory into the build:
#                        `podman build -v /opt/wheels:/opt/wheels:ro`, or serve it over HTTP)
#   PIP_TRUSTED_HOST     hosts pip may reach without TLS verification
# and the secret `pip-ca`, a CA bundle pip trusts (a TLS-intercepting proxy), which never lands in a
# layer: `--secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt` (Docker and podman alike).
#
# Layers, from the least to the most often rebuilt: the base; torch (deploy/torch.txt, the project's
# one torch pin); the dependencies of the two pyproject files; then the project's own code (two small
# wheels), so that a code change rebuilds a few hundred kilobytes, not the venv. The model is not
# baked in: it is read from the hub or a mounted directory at start and cached in the volume /models.
ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=python:3.11-slim-bookworm
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG CPU_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS base-cuda
# Ubuntu 24.04's Python is 3.12. CUDA 12.8: torch's cu124 index stopped at 2.6; cu128 carries recent releases.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM ${CPU_IMAGE} AS base-cpu

# The venv with torch and every dependency, but none of the project's code.
FROM base-${VARIANT} AS deps
ARG VARIANT
ARG CUDA_TORCH_INDEX_URL
ARG CPU_TORCH_INDEX_URL
ARG TORCH_INDEX_URL
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY deploy/torch.txt /tmp/torch.txt
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && case "$VARIANT" in cpu) index="$CPU_TORCH_INDEX_URL" ;; *) index="$CUDA_TORCH_INDEX_URL" ;; esac \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -r /tmp/torch.txt --index-url "${TORCH_INDEX_URL:-$index}"
# The two projects' metadata only (no packages yet): installs the dependencies of both. The server
# depends on the client package, which is installed from ./clients/python, never from an index.
# setuptools and wheel go into a separate build venv, not the image's.
WORKDIR /src
COPY pyproject.toml ./
COPY clients/python/pyproject.toml clients/python/
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && touch README.md \
    && /opt/venv/bin/pip install ./clients/python . \
    && python3 -m venv /opt/build \
    && /opt/build/bin/pip install "setuptools>=68" wheel \
    && rm -rf /src/*

# The project's code, as two wheels: rebuilt on every code change, and small.
FROM deps AS wheels
COPY README.md pyproject.toml ./
COPY encode_server ./encode_server
COPY clients/python ./clients/python
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels ./clients/python .

FROM base-${VARIANT} AS runtime
RUN groupadd --system --gid 10001 encode \
    && useradd --system --uid 10001 --gid encode --home-dir /home/encode --create-home encode \
    && mkdir -p /models \
    && chown encode:encode /models
COPY --from=deps /opt/venv /opt/venv
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    /opt/venv/bin/pip install --no-deps --no-index --force-reinstall --no-cache-dir \
        --disable-pip-version-check --root-user-action=ignore /wheels/*.whl \
    && /opt/venv/bin/encode-server --help >/dev/null
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/models \
    ENCODE_SERVER_HOST=0.0.0.0 \
    ENCODE_SERVER_PORT=8000 \
    ENCODE_SERVER_LOG_FORMAT=json
# Hugging Face downloads (or a mounted model directory) live here, not in the image layer.
VOLUME ["/models"]
USER 10001:10001
EXPOSE 8000 50051
# SIGTERM starts the drain (/ready 503, in-flight requests finish within ENCODE_SERVER_DRAIN_SECONDS);
# give `docker stop -t` / stop_grace_period more than that.
STOPSIGNAL SIGTERM
# Liveness only: /health answers while a large model is still loading; /ready is for routing. The
# probe resolves the server's own command line and environment with the server's parser, so it
# follows the port however it was set (--port N, --port=N, ENCODE_SERVER_PORT, default).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["/opt/venv/bin/python", "-m", "encode_server.healthcheck"]
ENTRYPOINT ["encode-server"]
