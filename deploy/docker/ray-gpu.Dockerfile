# A Ray GPU worker: ray.Dockerfile with the CUDA build of torch 2.13.0. Build from the
# repository root:
#   docker build -f deploy/docker/ray-gpu.Dockerfile -t dptune-ray-gpu:0.1.0 .
# The base is the same Python image as the head's, not a CUDA image: Ray refuses a node whose
# Python patch version differs from the head's, and torch's CUDA wheels carry their own CUDA
# runtime, cuDNN and NCCL (pip packages). The host needs only the NVIDIA driver and the NVIDIA
# Container Toolkit (Kubernetes: the NVIDIA device plugin), which mount the driver into the
# container.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# PyPI's Linux x86_64 torch is a CUDA build; for another CUDA version use PyTorch's index for
# it (--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ), within what the
# hosts' driver supports.
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}" \
    && python -c "import torch; assert torch.version.cuda, 'expected a CUDA build of torch'"

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
ENV RAY_AUTH_MODE=token

# KubeRay replaces this command (and passes --num-gpus from the pod's nvidia.com/gpu limit);
# compose.yaml names its own. Ray detects the GPUs the container sees.
CMD ["ray", "start", "--address=ray-head:6379", "--block", "--disable-usage-stats"]
