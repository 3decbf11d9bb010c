# syntax=docker/dockerfile:1
# moed, NVIDIA backend: kernels built by nvcc for sm_80 (A100) and sm_90 (H100,
# H200; sm_90a for the tensor-core path) plus compute_90 PTX. From the
# repository root:
#   docker build -f deploy/docker/nvidia.Dockerfile -t moed-nvidia:dev .
#   docker run --rm --gpus all --read-only --tmpfs /tmp -v "$PWD/demo-models:/models" \
#     -p 8000:8000 -p 8001:8001 -p 8002:8002 moed-nvidia:dev
# CUDA 13.0 is what the kernels are built and tested with (bench/RESULTS.md):
# the node's driver must be 580 or newer. The CUDA runtime is linked
# statically and libcuda comes from the driver (mounted by the NVIDIA
# container toolkit), so the runtime stage is CUDA's `base` flavor (cudart
# only, no math libraries). Other -gencode targets: --build-arg
# MOE_CUDA_ARCH_FLAGS="..." (and MOE_CUDA_TC_ARCH_FLAGS).
ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG MOE_CUDA_ARCH_FLAGS=""
ARG MOE_CUDA_TC_ARCH_FLAGS=""
WORKDIR /src
COPY . .
RUN MOE_CUDA_ARCH_FLAGS="${MOE_CUDA_ARCH_FLAGS}" MOE_CUDA_TC_ARCH_FLAGS="${MOE_CUDA_TC_ARCH_FLAGS}" \
    bash deploy/build.sh cuda --deps --build-dir /build --prefix /opt/moed

FROM nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU}
LABEL org.opencontainers.image.title="moed (NVIDIA)" \
      org.opencontainers.image.description="Mixture-of-Experts layer ops over KServe v2 gRPC, CUDA kernels"
COPY --from=build /opt/moed /opt/moed
RUN mkdir -p /models && chown 10001:10001 /models
ENV PATH=/opt/moed/bin:$PATH \
    LD_LIBRARY_PATH=/opt/moed/lib \
    MOED_MODEL_REPOSITORY=/models \
    HOME=/tmp \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/models"]
USER 10001:10001
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["moec", "-a", "127.0.0.1:8001", "--timeout-ms", "3000", "health"]
ENTRYPOINT ["moed"]
