# The control plane's image: router (`controlplane serve`), KV-event indexer (`controlplane
# indexer`) and autoscaler (`controlplane autoscale run`); the Helm chart (helm/controlplane)
# runs each with its own arguments. Engines use the official vllm/vllm-openai image.
#
#   docker build -t vllm-controlplane:0.1.0 .
#   docker build --build-arg EXTRA_PACKAGES='ray[serve]==2.60.0' -t vllm-controlplane:0.1.0-ray .
#
# Two stages: the wheel is built and installed into a virtual environment in the first; the
# final stage copies only that environment onto the same pinned base, runs as a non-root user
# and holds no compiler, pip cache or source tree.
# checkov:skip=CKV_DOCKER_2: no HEALTHCHECK; Kubernetes probes /ready and /health (the chart)

FROM python:3.11.11-slim-bookworm AS build
ARG EXTRA_PACKAGES=""
WORKDIR /src
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY controlplane ./controlplane
COPY router ./router
COPY autoscaler ./autoscaler
COPY deploy ./deploy
RUN /opt/venv/bin/python -m build --wheel --outdir /dist . \
    && python -m venv /opt/controlplane \
    && /opt/controlplane/bin/pip install --no-cache-dir /dist/*.whl ${EXTRA_PACKAGES} \
    && /opt/controlplane/bin/pip uninstall --yes pip

# the same pinned base as the build stage (an exact tag; pin its digest in your registry mirror)
FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="vllm-fleet-controlplane" \
      org.opencontainers.image.description="Router, KV-event indexer and headroom autoscaler for vLLM fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 controlplane \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin controlplane
COPY --from=build /opt/controlplane /opt/controlplane
ENV PATH=/opt/controlplane/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["controlplane"]
CMD ["--help"]
