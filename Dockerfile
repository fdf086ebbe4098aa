# The payment-worker image: one image for the migrate job, worker, beat, exporter and the
# gateway simulator (see docker-compose.yml); each service picks its own command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# a non-root user: nothing in the service needs root
RUN useradd --create-home --uid 10001 app
WORKDIR /app

# dependencies first, so a code change does not reinstall them
COPY pyproject.toml README.md ./
COPY payment_worker/__init__.py payment_worker/
RUN pip install -e . && rm -rf payment_worker

# an editable install of the repository: migrations/ and alembic.ini are found next to the
# package (payment_worker/db/migrate.py resolves them from the source tree)
COPY alembic.ini ./
COPY migrations ./migrations
COPY payment_worker ./payment_worker
RUN pip install --no-deps -e . && chown -R app:app /app

USER app
ENV PAYMENT_WORKER_HOME=/home/app/.payment-worker
EXPOSE 9808 9809 8700
CMD ["payment-worker", "--help"]
