# syntax=docker/dockerfile:1
# moed, AMD backend: kernels built by hipcc for gfx90a (MI210/MI250) and gfx942
# (MI300); other targets: --build-arg MOE_HIP_ARCHS="gfx90a;gfx942;...".
# From the repository root:
#   docker build -f deploy/docker/amd.Dockerfile -t moed-amd:dev .
#   docker run --rm --device /dev/kfd --device /dev/dri --group-add video --group-add render \
#     --read-only --tmpfs /tmp -v "$PWD/demo-models:/models" -p 8000:8000 -p 8001:8001 -p 8002:8002 moed-amd:dev
# (--group-add render needs a group of that name in the image; otherwise give
# the host's render group id: --group-add "$(getent group render | cut -d: -f3)".)
# The HIP runtime (libamdhip64 and what it loads) is the ROCm base image's;
# deploy/build.sh bundles the other libraries.
ARG ROCM_VERSION=6.4.1

FROM rocm/dev-ubuntu-24.04:${ROCM_VERSION} AS build
ARG MOE_HIP_ARCHS="gfx90a;gfx942"
WORKDIR /src
COPY . .
RUN MOE_HIP_ARCHS="${MOE_HIP_ARCHS}" bash deploy/build.sh hip --deps --build-dir /build --prefix /opt/moed

FROM rocm/dev-ubuntu-24.04:${ROCM_VERSION}
LABEL org.opencontainers.image.title="moed (AMD)" \
      org.opencontainers.image.description="Mixture-of-Experts layer ops over KServe v2 gRPC, HIP kernels"
COPY --from=build /opt/moed /opt/moed
RUN mkdir -p /models && chown 10001:10001 /models
ENV PATH=/opt/moed/bin:$PATH \
    LD_LIBRARY_PATH=/opt/moed/lib \
    MOED_MODEL_REPOSITORY=/models \
    HOME=/tmp
VOLUME ["/models"]
USER 10001:10001
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["moec", "-a", "127.0.0.1:8001", "--timeout-ms", "3000", "health"]
ENTRYPOINT ["moed"]
