# The payment-worker image: one image for the migrate job, worker, beat, exporter and the
# gateway simulator (see docker-compose.yml); each service picks its own command.
# Multi-arch (amd64, arm64): every locked dependency has a wheel or an sdist for both; the
# embedded servers (pgserver, whose 0.1.x has no aarch64 wheel) are an extra the image leaves
# out: it always runs against DATABASE_URL and REDIS_URL.

# --- build: the wheel of this checkout ------------------------------------------------------
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY payment_worker ./payment_worker
RUN pip wheel --no-deps --wheel-dir /dist .

# --- run ------------------------------------------------------------------------------------
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini as PID 1: forwards SIGTERM to Celery (a warm shutdown) and reaps orphans
RUN apt-get update \
    && apt-get install --yes --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# dependencies first, exactly as locked (hashes checked), so a code change reinstalls nothing
COPY requirements/runtime.lock /tmp/runtime.lock
RUN pip install --require-hashes -r /tmp/runtime.lock && rm /tmp/runtime.lock
# the wheel itself, not an editable checkout: migrations and the sample batch are inside it
COPY --from=build /dist/*.whl /tmp/
RUN pip install --no-deps /tmp/*.whl && rm /tmp/*.whl

# a non-root user: nothing in the service needs root
RUN useradd --create-home --uid 10001 app
USER app
WORKDIR /home/app
ENV PAYMENT_WORKER_HOME=/home/app/.payment-worker
EXPOSE 9810 9809 8700
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["payment-worker", "--help"]
