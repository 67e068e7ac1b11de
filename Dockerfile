# glm53 image: CUDA torch + exllamav3 (extension compiled here, at build time) + the glm53 package.
#   docker build -t glm53 .                                   (arches 8.6 8.9 9.0 12.0: RTX 30xx, 40xx, H100, 50xx)
#   docker build --build-arg TORCH_CUDA_ARCH_LIST=8.6 -t glm53 .   (one arch: a much faster build)
ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_CUDA_ARCH_LIST="8.6;8.9;9.0;12.0"
ENV DEBIAN_FRONTEND=noninteractive TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} MAX_JOBS=8 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ninja-build git g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/glm53
COPY pyproject.toml setup.py README.md ./
COPY docker/install.sh docker/
COPY glm53 glm53
COPY store store
RUN python3 -m venv /opt/venv \
    && TORCH_SPEC="torch>=2.6" bash docker/install.sh /opt/venv/bin/python gpu
# exllamav3 JIT-compiles its CUDA extension on first import (~5 minutes). Do it now, for the arches asked
# for, and install the result as a precompiled module so the runtime image needs no compiler.
RUN /opt/venv/bin/python -c "import exllamav3.ext" \
    && cp "$(find /opt/torch_extensions -name 'exllamav3_ext*.so' | head -n1)" \
          "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/exllamav3_ext.so"

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
ENV DEBIAN_FRONTEND=noninteractive PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    GLM53_HOST=0.0.0.0 GLM53_PORT=30000 GLM53_CACHE_DIR=/cache GLM53_ALLOW_NO_API_KEY=1 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID
# CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA numbers the GPUs as nvidia-smi does, so cuda:N is the card the plan sized.
# GLM53_ALLOW_NO_API_KEY=1: inside the container the server must bind 0.0.0.0; who can reach it is decided by
# `-p 127.0.0.1:30000:30000` on the host. Publish on another address only with -e GLM53_API_KEY=... set.
RUN apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/glm53 /opt/glm53
COPY entrypoint.sh /opt/glm53/entrypoint.sh
COPY docker/healthcheck.sh /opt/glm53/docker/healthcheck.sh
WORKDIR /opt/glm53
VOLUME ["/cache"]
EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 CMD ["/opt/glm53/docker/healthcheck.sh"]
ENTRYPOINT ["/opt/glm53/entrypoint.sh"]
CMD ["serve"]
