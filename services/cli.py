"""The ``weft`` command. Each subcommand is imported lazily, so ``weft
serve``'s API process never loads torch."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap


def _generate(argv: list[str]) -> int:
    from services.config.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser(prog="weft generate", description="Complete one prompt offline.")
    parser.add_argument("--prompt", required=True, help="Text to complete.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--seed", dest="request_seed", type=int, default=None, help="Sampling seed of this request."
    )
    parser.add_argument("--chat", action="store_true", help="Wrap the prompt in the chat template.")
    add_engine_args(parser, skip=("seed",))
    args = parser.parse_args(argv)

    from services import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.request_seed
        )
        llm = LLM(**dataclasses.asdict(engine_args_from(args, skip=("seed",))))
        if args.chat:
            output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        else:
            output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    except (ValueError, FileNotFoundError) as e:
        print(f"weft generate: {e}", file=sys.stderr)
        return 2
    completion = output.outputs[0]
    print((args.prompt if not args.chat else "") + completion.text)
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _bench(argv: list[str]) -> int:
    from benchmarks.bench.cli import main as bench_main

    return bench_main(argv)


def _serve(argv: list[str]) -> int:
    from services.api.server import main as serve_main

    return serve_main(argv)


def _keys(argv: list[str]) -> int:
    from protocol.curve import generate_keys, generate_node_keys

    parser = argparse.ArgumentParser(
        prog="weft keys",
        description=(
            "Generate the CurveZMQ keypairs that authenticate and encrypt the links between the API and "
            "its engine cores (`--zmq-curve-keys DIR` on weft serve and engine-core). Copy the folder to "
            "every node, readable only by the user that runs weft."
        ),
    )
    parser.add_argument("--dir", required=True, help="Folder to write the keys into (created mode 0700).")
    parser.add_argument("--force", action="store_true", help="Replace keys already in the folder.")
    parser.add_argument(
        "--node",
        default=None,
        metavar="NAME",
        help="Add a keypair of the engine node NAME to an existing folder: the API "
        "binds each rank to the node key that shook hands for it.",
    )
    args = parser.parse_args(argv)
    try:
        if args.node is not None:
            paths = generate_node_keys(args.dir, args.node, overwrite=args.force)
        else:
            paths = generate_keys(args.dir, overwrite=args.force)
    except (FileExistsError, OSError, ValueError) as e:
        print(f"weft keys: {e}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths))
    return 0


def _kv_transfer(argv: list[str]) -> int:
    from services.kv_transfer.service import main as service_main

    return service_main(argv)


def _pd(argv: list[str]) -> int:
    from services.kv_transfer.pd_up import main as pd_main

    return pd_main(argv)


def _pd_proxy(argv: list[str]) -> int:
    from services.kv_transfer.proxy import main as proxy_main

    return proxy_main(argv)


COMMANDS = {
    "serve": (_serve, "Serve the OpenAI-compatible API and its engine cores."),
    "keys": (_keys, "Generate CurveZMQ keys for the links between the API and engine cores."),
    "generate": (_generate, "Complete a prompt with the offline engine."),
    "bench": (_bench, "Benchmarks, one subcommand each (below; weft bench NAME --help)."),
    "kv-transfer": (_kv_transfer, "Run the KV transfer service of disaggregated prefill/decode."),
    "pd": (_pd, "`weft pd up`: disaggregated prefill/decode on this machine, keys and secret generated."),
    "pd-proxy": (
        _pd_proxy,
        "Run the disaggregated prefill/decode proxy in front of prefill and decode servers.",
    ),
}


def _bench_lines() -> list[str]:
    """Each ``weft bench`` subcommand with its help."""
    from benchmarks.bench.cli import OWN_PARSERS, SUBCOMMANDS

    texts = {name: sub.help for name, sub in SUBCOMMANDS.items()} | {
        name: text for name, (text, _) in OWN_PARSERS.items()
    }
    return [
        textwrap.fill(text, 100, initial_indent=f"  {name:15} ", subsequent_indent=" " * 18)
        for name, text in texts.items()
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:12} {text}" for name, (_, text) in COMMANDS.items()]
        print(
            "usage: weft COMMAND [ARGS]\n\ncommands:\n"
            + "\n".join(lines)
            + "\n\nbenchmarks (weft bench NAME):\n"
            + "\n".join(_bench_lines()),
            file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
