FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN make install model
ENV PATH=/app/.venv/bin:$PATH
