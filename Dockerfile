# syntax=docker/dockerfile:1
#
# Shardfold GPU worker image (AWS Batch): `python -m shardfold.functions.container` runs the handler named in
# SHARDFOLD_HANDLER on the event in SHARDFOLD_EVENT (the state machine's batch:submitJob.sync task sets both).
#
#   docker build --platform linux/amd64 -t shardfold-worker .
#
# `pulumi up` builds and pushes this to the stack's ECR repository when pulumi-docker-build is installed
# (or set shardfold:workerImage to an image built elsewhere).
#
# CUDA: torch 2.13.0 from PyPI is the CUDA 13.0 build. Its wheel pulls the CUDA runtime, cuBLAS, cuDNN 9 and
# NCCL in as pip packages, so the base image needs no CUDA toolkit, only the host's NVIDIA driver, which the
# GPU instance mounts into the container. CUDA 13.0 needs driver >= 580: Batch's ECS_AL2023_NVIDIA AMI
# (the stack's default shardfold:gpuImageType) ships 580.x; the older ECS_AL2_NVIDIA (driver 550) cannot
# run it. The GPU instance types (g4dn, g5, g6, p4, p5) are x86_64, hence linux/amd64 only.
#
# Base: Debian 12 slim with CPython 3.12 (glibc 2.36 >= the 2.28 torch's manylinux_2_28 wheels need).
# Pin it by digest for reproducible builds: `docker pull python:3.12.10-slim-bookworm`, then
# `--build-arg PYTHON_IMAGE=python:3.12.10-slim-bookworm@sha256:<digest>`.
ARG PYTHON_IMAGE=python:3.12.10-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# torch first, in its own layer (about 3 GB with its CUDA libraries), so code changes do not re-download it.
# Keep the pin equal to the `inference` extra in pyproject.toml (tests/test_dockerfile.py checks it). The
# lock holds the CPU build the tests ran with; the image takes PyPI's CUDA build of the same release, and
# pip resolves its CUDA libraries (nvidia-*): the one part of the image not installed from the lock.
RUN pip install "torch==2.13.0"
# Then everything else the worker runs with, hash-checked from the lock (requirements/worker.txt: the base
# dependencies and the inference extra, torch left out).
COPY requirements/worker.txt ./requirements/
RUN pip install --require-hashes -r requirements/worker.txt
# The worker needs only shardfold.functions (it imports nothing from client/, orchestrator/, infra/).
COPY pyproject.toml setup.py README.md ./
COPY shardfold ./shardfold
COPY functions ./functions
RUN pip install --no-deps . \
    && python -c "import shardfold.functions.container, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd --system --gid 10001 shardfold \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/shardfold shardfold
COPY --from=build /opt/venv /opt/venv
WORKDIR /home/shardfold
# Not root: the code and libraries stay read-only to the worker; it writes only to $HOME and /tmp.
USER 10001:10001
ENTRYPOINT ["python", "-m", "shardfold.functions.container"]
