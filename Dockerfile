# syntax=docker/dockerfile:1
# rlscale on a CUDA PyTorch base, for the KubeRay manifests of `rlscale cluster render` (`image:`).
# Build and push (docs/cluster.md):
#   docker build -t REGION-docker.pkg.dev/PROJECT/REPO/rlscale:0.1.0 .
#   docker push REGION-docker.pkg.dev/PROJECT/REPO/rlscale:0.1.0
# Two stages: the first builds rlscale's wheel from the source, the second installs that wheel
# (and Ray at the manifests' rayVersion) on the PyTorch image and runs as a non-root user. No
# secret is passed at build time: HF_TOKEN, WANDB_API_KEY and the Ray token reach the pods from
# Kubernetes Secrets at run time.

# CUDA 12.8 or later for B200 (sm_100); the seed's NeMo-RL image is CUDA 12.9 / PyTorch 2.7+.
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rlscale/ rlscale/
RUN python -m pip wheel --no-deps --no-cache-dir --wheel-dir /wheels .

FROM ${BASE_IMAGE}
# = ray_version of the cluster spec (the RayCluster's rayVersion); token authentication needs >= 2.52
ARG RAY_VERSION=2.54.0
# wget: KubeRay's readiness and liveness probes call the raylet and the dashboard with it
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels/ /tmp/wheels/
RUN python -m pip install --no-cache-dir /tmp/wheels/rlscale-*.whl "ray[default]==${RAY_VERSION}" \
    && rm -rf /tmp/wheels
RUN groupadd --gid 1000 rlscale && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash rlscale
# the model cache on the shared volume (storage.mount_path of the cluster spec), as the pods' env sets it
ENV HF_HOME=/lustre/huggingface_cache \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/rlscale
