# One image for every role: the API (`weft serve`), the engine cores
# (`engine-core --headless`), the P/D services and the one-shot `keys`
# service of docker-compose.yml. `make install model` installs weft and the
# default model into the image; compose mounts /app/models as a shared
# volume, which Docker seeds from the image on first use.
# g++ builds the CPU attention kernel, here once for every container (the
# build targets AVX2, not the build machine's own CPU).
# Everything runs as the unprivileged user `weft` (uid 10001): it owns /app
# (the venv, the models and the kernel build) and the folders compose mounts
# the keys volumes on (/keys, and each role's share under /roles: Docker
# seeds a new volume with the folder's owner and mode); nothing in the image
# needs root at run time.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 --user-group weft \
    && mkdir -p /app /keys /roles/api /roles/engine /roles/kv-transfer /roles/pd-server /roles/pd-proxy /roles/grafana \
    && chown -R weft:weft /app /keys /roles && chmod 0700 /keys /roles/*
WORKDIR /app
COPY --chown=weft:weft . /app
USER weft
RUN make install model && .venv/bin/python -m kernels.cpu_attention && .venv/bin/python -m kernels.cpu_fused
ENV PATH=/app/.venv/bin:$PATH
EXPOSE 8000 29550
CMD ["weft", "serve", "--host", "0.0.0.0", "--port", "8000"]
