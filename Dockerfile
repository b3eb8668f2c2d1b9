# veloxquant-mlx serve for Linux hosts: MLX on the CPU (mlx[cpu]) with OpenBLAS preloaded.
# Metal is not reachable from containers: on a Mac, run natively (README: "On a Mac").
# The runtime image carries no compiler: the gemv forwarder (--blas-gemv) is a Linux-CPU
# experiment that is off by default and needs one.
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends libopenblas0-pthread curl \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 serve
WORKDIR /app
COPY pyproject.toml README.md ./
COPY veloxquant_mlx ./veloxquant_mlx
RUN pip install --no-cache-dir .

USER serve
ENV XDG_CACHE_HOME=/home/serve/.cache
EXPOSE 8000
# Liveness: /health turns 503 when the engine has failed (the process then exits non-zero).
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s \
  CMD curl -fsS http://127.0.0.1:8000/health || exit 1
# One worker: the engine owns the model and the KV pool; scale with more containers.
# SIGTERM drains (--drain-timeout); give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
CMD ["veloxquant-serve", "--host", "0.0.0.0", "--port", "8000"]
