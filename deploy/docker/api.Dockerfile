# The control plane: `dptune serve` (HTTP API, PostgreSQL, the Ray Jobs client).
# Build from the repository root:
#   docker build -f deploy/docker/api.Dockerfile -t dptune-api:0.1.0 .
# The same base as the Ray images (PYTHON_IMAGE): a job's entrypoint is this image's Python
# (`/usr/local/bin/python -m runner <id>`), run on the Ray head.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# torch is a dependency of the package though the service never trains: the CPU build keeps
# the image gigabytes smaller than PyPI's CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}" \
    && python -c "import torch; assert torch.version.cuda is None, 'expected a CPU build of torch'"

# Dependencies first (a layer that survives source edits), then the package itself.
WORKDIR /src
COPY pyproject.toml README.md ./
RUN mkdir core service workers runner && pip install '.[postgres]'
COPY core core
COPY service service
COPY workers workers
COPY runner runner
COPY dptune dptune
RUN pip install --no-deps --force-reinstall '.[postgres]' && cd / && rm -rf /src

RUN useradd --create-home --uid 1000 --user-group dptune \
    && mkdir /data && chown dptune:dptune /data
USER dptune
WORKDIR /home/dptune
# Shared storage (the same path on every Ray node); Ray's token is required (head.py). The
# service's own state (the SQLite database when there is no DPTUNE_DATABASE_URL, a Ray token
# file) stays in the home of the image's user, never on a volume Ray nodes mount.
ENV DPTUNE_DATA_DIR=/data \
    DPTUNE_STATE_DIR=/home/dptune/state \
    RAY_AUTH_MODE=token

EXPOSE 8000
CMD ["dptune", "serve", "--host", "0.0.0.0", "--port", "8000"]
