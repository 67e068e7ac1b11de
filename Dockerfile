# glm53 image: CUDA torch + exllamav3 (extension compiled here, at build time) + the glm53 package.
#   docker build -t glm53 .                                   (arches 8.6 8.9 9.0 12.0+PTX: RTX 30xx, 40xx, H100, 50xx,
#                                                              and PTX that newer cards compile at load)
#   docker build --build-arg TORCH_CUDA_ARCH_LIST=8.6 -t glm53 .   (one arch: a much faster build)
# Build args: BASE_DEVEL / BASE_RUNTIME (the CUDA images, pinned by digest), TORCH_SPEC / TORCH_INDEX (the torch the
# GPU machine tests), MAX_JOBS (parallel nvcc jobs; default: the build machine's cores), EXLLAMAV3_EXT=0 (skip the
# CUDA compile: an image that serves the CPU demo only, what CI builds on a machine without nvcc).
ARG BASE_DEVEL=nvidia/cuda:13.0.1-devel-ubuntu24.04@sha256:7d2f6a8c2071d911524f95061a0db363e24d27aa51ec831fcccf9e76eb72bc92
ARG BASE_RUNTIME=nvidia/cuda:13.0.1-runtime-ubuntu24.04@sha256:c3fde347d52d578c84fd644bc177bc7ec333feaf11550d990da4084d7612e4c7

FROM ${BASE_DEVEL} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_CUDA_ARCH_LIST="8.6;8.9;9.0;12.0+PTX"
ARG TORCH_SPEC="torch==2.11.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG MAX_JOBS=""
ARG EXLLAMAV3_EXT=1
ENV DEBIAN_FRONTEND=noninteractive TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions PIP_NO_CACHE_DIR=1
# The Ubuntu packages come from the base image's release, which its digest fixes; their versions follow that
# release's security updates (see .hadolint.yaml).
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ninja-build git g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/glm53
# Dependencies first, from pyproject.toml alone: a source edit re-runs only the last, small layers.
COPY pyproject.toml docker/deps.py docker/
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -q --disable-pip-version-check --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
    && python3 docker/deps.py docker/pyproject.toml gpu > /tmp/requirements.txt \
    && /opt/venv/bin/pip install -q --disable-pip-version-check -r /tmp/requirements.txt
# exllamav3 JIT-compiles its CUDA extension on first import (~5 minutes). Do it now, for the arches asked
# for, and install the result as a precompiled module so the runtime image needs no compiler.
RUN if [ "${EXLLAMAV3_EXT}" = 1 ]; then \
      MAX_JOBS=${MAX_JOBS:-$(nproc)} /opt/venv/bin/python -c "import exllamav3.ext" \
      && cp "$(find /opt/torch_extensions -name 'exllamav3_ext*.so' | head -n1)" \
            "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/exllamav3_ext.so"; \
    fi && rm -rf /opt/torch_extensions
COPY pyproject.toml setup.py README.md ./
COPY store store
COPY glm53 glm53
RUN /opt/venv/bin/pip install -q --disable-pip-version-check --no-deps . && rm -rf build

FROM ${BASE_RUNTIME}
ENV DEBIAN_FRONTEND=noninteractive PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    GLM53_HOST=0.0.0.0 GLM53_PORT=30000 GLM53_CACHE_DIR=/cache GLM53_ALLOW_NO_API_KEY=1 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID
# CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA numbers the GPUs as nvidia-smi does, so cuda:N is the card the plan sized.
# GLM53_ALLOW_NO_API_KEY=1: inside the container the server must bind 0.0.0.0; who can reach it is decided by
# `-p 127.0.0.1:30000:30000` on the host. Publish on another address only with -e GLM53_API_KEY=... set. Clients
# that reach it by localhost or an IP address are served; by a name, that name goes in GLM53_ALLOWED_ORIGINS.
# tini is PID 1: it hands SIGTERM to the server at every moment of start-up (a bare PID 1 ignores it) and reaps.
# The user glm53 takes uid 1000 (Ubuntu's images give it to a user `ubuntu`, removed here).
RUN apt-get update && apt-get install -y --no-install-recommends python3 tini && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 --user-group glm53 \
    && mkdir -p /cache /run/glm53 && chown glm53:glm53 /cache /run/glm53
COPY --from=build /opt/venv /opt/venv
COPY entrypoint.sh /opt/glm53/entrypoint.sh
COPY docker/healthcheck.sh /opt/glm53/docker/healthcheck.sh
WORKDIR /opt/glm53
# Not root: what pack-store writes and what /cache holds belong to uid 1000 on the host
# (docker run --user "$(id -u):$(id -g)" to write as yourself).
USER 1000:1000
VOLUME ["/cache"]
EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 CMD ["/opt/glm53/docker/healthcheck.sh"]
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/glm53/entrypoint.sh"]
CMD ["serve"]
