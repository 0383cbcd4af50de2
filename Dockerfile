# One image for every role: the API (`weft serve`) and the engine cores
# (`engine-core --headless`). `make install model` installs weft and the
# default model into the image; compose mounts /app/models as a shared
# volume, which Docker seeds from the image on first use.
# g++ builds the CPU attention kernel, here once for every container (the
# build targets AVX2, not the build machine's own CPU).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN make install model && .venv/bin/python -m kernels.cpu_attention
ENV PATH=/app/.venv/bin:$PATH
EXPOSE 8000 29550
CMD ["weft", "serve", "--host", "0.0.0.0", "--port", "8000"]
