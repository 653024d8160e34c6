# extproc: the ext_proc router, its status reconciler and the engine simulator in one image.
#   docker build -t extproc:dev .
#   docker run --rm extproc:dev serve --help
# The generated protobuf code is committed (extproc/pb), so no code generator runs here.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/extproc
WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc ./extproc
# A regular (non-editable) install: the venv is all the final image needs.
RUN /opt/extproc/bin/pip install . \
 && /opt/extproc/bin/extproc --version

FROM ${PYTHON_IMAGE}
# HOME=/tmp: the root filesystem is read-only in the shipped Deployment; /tmp is an emptyDir.
ENV PATH=/opt/extproc/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
RUN groupadd --gid 65532 extproc \
 && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin extproc
# Same base image in both stages, so the venv's interpreter path stays valid.
COPY --from=builder /opt/extproc /opt/extproc
USER 65532:65532
# 9002 gRPC ext_proc + health, 9090 serve's admin (/metrics), 9091 reconcile's admin.
EXPOSE 9002 9090 9091
ENTRYPOINT ["extproc"]
CMD ["--help"]
