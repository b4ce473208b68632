# syntax=docker/dockerfile:1
#
# One image for every agentbus service; the container command names the service
# module, because the entry point is `python -m`:
#
#   docker build -t agentbus .
#   docker run --rm -e NATS_URL=... -e DATABASE_URL=... agentbus session_events
#
# docker-compose.yml and deploy/k8s/ use it the same way (`command:` / `args:`).

ARG PYTHON_IMAGE=python:3.11-slim
# The uv that wrote uv.lock (.tools/ holds the same one).
ARG UV_VERSION=0.13.9

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1


# Only uv.lock and the workspace's pyproject.toml files, at their paths. The
# dependency layer below is keyed on this stage's *output*, so editing source code
# does not reinstall the dependencies, and a new workspace member (services/*,
# libs/*) needs no new line here.
FROM base AS manifests
WORKDIR /src
COPY . .
RUN mkdir /manifests \
 && find . \( -name pyproject.toml -o -name uv.lock \) -not -path './.venv/*' \
        -exec cp --parents {} /manifests/ \;


FROM base AS builder
ARG UV_VERSION
RUN pip install "uv==${UV_VERSION}"
# Use the image's own interpreter (never download one), compile to bytecode at
# install time (the runtime filesystem may be read-only), and copy out of the cache
# mount rather than hard-linking into it.
ENV UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON=/usr/local/bin/python3 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy
WORKDIR /app

# 1. third-party dependencies only, from the lock (cached while no manifest changes):
#    what runs, never the root's dev group (`--no-dev`: test tools, the embedded NATS and
#    Postgres, FastStream, the test kit of libs/testkit, which is no workspace member for
#    that reason). tests/test_image_dependencies.py exports the set these `uv sync` flags
#    select and fails if any of that is in it.
COPY --from=manifests /manifests/ ./
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --all-packages --no-install-workspace

# 2. the workspace itself (contracts, libs, services: every member, by the workspace
#    glob, so a new service needs no line here), installed editable into
#    the same venv, so package data beside the code (migrations/*.sql, web files)
#    is read from where it sits in the tree.
COPY . .
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --all-packages \
 && .venv/bin/python -m compileall -q contracts libs services


FROM base AS runtime
RUN groupadd --system --gid 10001 agentbus \
 && useradd --system --uid 10001 --gid agentbus --home-dir /home/agentbus --create-home \
        --shell /usr/sbin/nologin agentbus
# Owned by root and read-only to the service user: the code cannot rewrite itself.
COPY --from=builder /app /app
WORKDIR /app
ENV PATH="/app/.venv/bin:${PATH}" \
    VIRTUAL_ENV=/app/.venv
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
ENTRYPOINT ["python", "-m"]
