"""llama.cpp's server through the ``xllamacpp`` wheel, run inside its own venv.

The wheel ships a prebuilt CPU ``llama-server`` behind ``xllamacpp.Server(CommonParams)``:
no compiler is needed. This script imports nothing from weft; it starts the
server on the given port, prints one JSON line with its address, and serves
until SIGTERM/SIGINT.

    .peers/llamacpp/bin/python benchmarks/peers/llamacpp_server.py --model M.gguf --port 8080 --parallel 64
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading


def build_params(args: argparse.Namespace):
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_parallel = args.parallel  # slots: requests decoded together
    # Each slot gets n_ctx / n_parallel positions: give every slot the context it asks for.
    params.n_ctx = args.ctx_per_slot * args.parallel
    params.cont_batching = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.model_alias = {args.alias}
    if not args.cache_prompt:  # no reuse of a slot's previous prompt, no host-RAM prompt cache
        params.cache_prompt = False
        params.cache_ram_mib = 0
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="The GGUF file.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parallel", type=int, default=64, help="Server slots (concurrent sequences).")
    parser.add_argument("--ctx-per-slot", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--alias", default="llamacpp", help="The model name the server answers to.")
    parser.add_argument(
        "--no-cache-prompt",
        dest="cache_prompt",
        action="store_false",
        help="Prefill every prompt in full (as weft and vLLM do without prefix caching).",
    )
    args = parser.parse_args()

    import xllamacpp

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xllamacpp.Server(build_params(args))
    print(json.dumps({"listening": server.listening_address, "xllamacpp": xllamacpp.__version__}), flush=True)
    stop.wait()
    del server  # the handle's destructor stops the HTTP threads


if __name__ == "__main__":
    main()
