# The kvps server image: `kvps node`, `kvps node join`, `kvps status` (no torch: the server does
# not need it; workers install kvps with the torch extra in their own images).
#   docker build -t kvps:latest .
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvps ./kvps
COPY clients ./clients
COPY chaos ./chaos
RUN pip install --no-cache-dir . && useradd --system --uid 10001 --home-dir /data kvps \
    && mkdir -p /data && chown kvps /data
USER kvps
WORKDIR /data
# admin API; shard ports follow it (deploy/README.md, "Ports")
EXPOSE 7100
ENTRYPOINT ["kvps"]
CMD ["--help"]
