# A Ray node (head or CPU worker) that can run dptune's jobs: Ray 2.60 (the pin in
# pyproject.toml), the CPU build of torch 2.13.0, and this repository installed so that
# `python -m runner <id>` (a job's entrypoint, run on the head) and the trials' `workers`
# engine import. Build from the repository root:
#   docker build -f deploy/docker/ray.Dockerfile -t dptune-ray:0.1.0 .
# Every node of a cluster must run the same Python patch version as the head (Ray refuses
# others): build all images from one PYTHON_IMAGE, pinned to a patch tag or a digest when
# they are built at different times.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}" \
    && python -c "import torch; assert torch.version.cuda is None, 'expected a CPU build of torch'"

WORKDIR /src
COPY pyproject.toml README.md ./
RUN mkdir core service workers runner && pip install .
COPY core core
COPY service service
COPY workers workers
COPY runner runner
COPY dptune dptune
RUN pip install --no-deps --force-reinstall . && cd / && rm -rf /src

RUN useradd --create-home --uid 1000 --user-group dptune \
    && mkdir /data && chown dptune:dptune /data
USER dptune
WORKDIR /home/dptune
# Fail closed: a node started without the cluster's token (RAY_AUTH_TOKEN or
# RAY_AUTH_TOKEN_PATH) refuses to start rather than run without authentication.
ENV RAY_AUTH_MODE=token

# KubeRay replaces this command; compose.yaml names its own.
CMD ["ray", "start", "--head", "--block", "--dashboard-host=0.0.0.0", "--disable-usage-stats"]
