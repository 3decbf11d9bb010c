# syntax=docker/dockerfile:1
# moed, CPU backend (Debian 12). From the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t moed-cpu:dev .
#   docker run --rm --read-only --tmpfs /tmp -v "$PWD/demo-models:/models" -p 8000:8000 -p 8001:8001 -p 8002:8002 moed-cpu:dev
# The build stage runs deploy/build.sh, the recipe CI runs too (deploy/check.sh
# --build); the runtime stage installs nothing: deploy/build.sh staged moed and
# the shared libraries it loads in /opt/moed. docs/deploy.md has the rest.

FROM debian:12 AS build
WORKDIR /src
COPY . .
RUN bash deploy/build.sh cpu --deps --build-dir /build --prefix /opt/moed

FROM debian:12-slim
LABEL org.opencontainers.image.title="moed (CPU)" \
      org.opencontainers.image.description="Mixture-of-Experts layer ops over KServe v2 gRPC"
COPY --from=build /opt/moed /opt/moed
# The model repository is a volume, writable by the (numeric, non-root) user
# so that ExpertStore uploads can land there; nothing else is written, so the
# root filesystem can be read-only (mount a tmpfs on /tmp).
RUN mkdir -p /models && chown 10001:10001 /models
ENV PATH=/opt/moed/bin:$PATH \
    LD_LIBRARY_PATH=/opt/moed/lib \
    MOED_MODEL_REPOSITORY=/models \
    HOME=/tmp
VOLUME ["/models"]
USER 10001:10001
# 8000 KServe v2 REST, 8001 gRPC (KServe v2, grpc.health.v1, moe.v1.ExpertStore), 8002 HTTP (/metrics,
# /v2/health/*)
EXPOSE 8000 8001 8002
# exit 0 only when ready (moec health: 3 = live but not ready)
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["moec", "-a", "127.0.0.1:8001", "--timeout-ms", "3000", "health"]
ENTRYPOINT ["moed"]
