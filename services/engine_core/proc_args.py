"""The command line of one engine-core process, declared once.

Three launchers start ``python -m services.engine_core.proc``: the API's
local-engine launcher (``services/api/engine_processes.py``), ``engine-core
--headless`` (``services/engine_core/cli.py``) and tests. They build an
``EngineCoreArgs`` and call ``to_argv()``; the process reads it back with
``EngineCoreArgs.parse``. Each flag is one field below, so a new one cannot
be passed by one side and unknown to the other; ``engine-core --headless``
takes the flags it passes on to its engine cores from here too (``add_flags``),
and each flag's help shows the default its field holds. Torch-free: the API
imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from services.config.cli_args import with_default
from services.processes import DEFAULT_SHUTDOWN_TIMEOUT_S

PROC_MODULE = "services.engine_core.proc"


def _flag(text: str, *, flag: str | None = None, kind: type | None = None, metavar: str | None = None) -> Any:
    """Field metadata: the flag's help, its name when it differs from the field's, and its type."""
    return {"help": text, "flag": flag, "type": kind, "metavar": metavar}


@dataclass(frozen=True, kw_only=True)
class EngineCoreArgs:
    rank: int = field(metadata=_flag("Data-parallel rank of this engine core.", kind=int))
    handshake_address: str = field(metadata=_flag("The API's handshake socket address.", kind=str))
    local: bool = field(default=False, metadata=_flag("Started by the API's launcher on its node."))
    headless: bool = field(default=False, metadata=_flag("Started by `engine-core --headless`."))
    num_threads: int | None = field(
        default=None, metadata=_flag("torch threads per engine core (default: the API's config).", kind=int)
    )
    tensor_parallel_size: int | None = field(
        default=None,
        metadata=_flag("Worker processes per engine core (default: the API's config).", kind=int),
    )
    curve_keys: str | None = field(
        default=None,
        metadata=_flag(
            "Authenticate and encrypt the links to the API with CurveZMQ (keys from `weft keys`).",
            flag="--zmq-curve-keys",
            kind=str,
            metavar="DIR",
        ),
    )
    shutdown_timeout_s: float = field(
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metadata=_flag(
            "On SIGTERM, seconds each engine core may take to finish its requests before it stops anyway.",
            flag="--shutdown-timeout",
            kind=float,
        ),
    )
    engines_on_node: int | None = field(
        default=None,
        metadata=_flag(
            "Engine cores its launcher started on this node, which share its memory (default: the config's).",
            kind=int,
        ),
    )
    available_memory: int | None = field(
        default=None,
        metadata=_flag(
            "Bytes available on this node before its engines started, as their launcher measured "
            "them (with --engines-on-node; default: measured by the worker).",
            kind=int,
        ),
    )
    kv_transfer_config: str | None = field(
        default=None,
        metadata=_flag(
            "Disaggregated prefill/decode role of the engine cores, as JSON (kv_connector, kv_role, "
            "kv_connector_extra_config; default: the API's config).",
            kind=str,
            metavar="JSON",
        ),
    )

    local_dp_rank: int | None = field(
        default=None,
        metadata=_flag(
            "Index of this engine core among those its launcher started on this node: on CUDA its workers "
            "take that share of the visible devices, tensor-parallel size each (default: leave them as given).",
            kind=int,
        ),
    )

    def to_argv(self) -> list[str]:
        """The whole command that starts this engine core."""
        argv = [sys.executable, "-m", PROC_MODULE]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value is False:
                continue
            argv += [_flag_name(f)] if value is True else [_flag_name(f), str(value)]
        return argv

    @classmethod
    def parse(cls, argv: list[str] | None) -> EngineCoreArgs:
        """Read the flags ``to_argv`` writes; bad values exit with a usage error (status 2)."""
        parser = build_parser()
        args = cls(**vars(parser.parse_args(argv)))
        if args.rank < 0:
            parser.error(f"--rank must be non-negative, got {args.rank}.")
        if args.shutdown_timeout_s < 0:
            parser.error(f"--shutdown-timeout must be non-negative, got {args.shutdown_timeout_s}.")
        return args


def _flag_name(f: dataclasses.Field[object]) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def flag_dest(name: str) -> str:
    """Where argparse puts field ``name``'s flag by default (``curve_keys``: ``zmq_curve_keys``)."""
    field = next(f for f in dataclasses.fields(EngineCoreArgs) if f.name == name)
    return _flag_name(field)[2:].replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROC_MODULE}", description="One data-parallel engine-core process."
    )
    add_flags(parser, [f.name for f in dataclasses.fields(EngineCoreArgs)], into_fields=True)
    return parser


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str], *, into_fields: bool = False) -> None:
    """The flags of ``EngineCoreArgs``' fields ``names`` on ``parser``: each into its field's name
    with ``into_fields``, else where argparse puts a flag (``flag_dest``)."""
    fields = {f.name: f for f in dataclasses.fields(EngineCoreArgs)}
    for name in names:
        f = fields[name]
        meta = f.metadata
        dest = f.name if into_fields else flag_dest(f.name)
        if meta["type"] is None:  # a switch
            parser.add_argument(_flag_name(f), dest=dest, action="store_true", help=meta["help"])
            continue
        required = f.default is dataclasses.MISSING
        parser.add_argument(
            _flag_name(f),
            dest=dest,
            type=meta["type"],
            required=required,
            default=None if required else f.default,
            metavar=meta["metavar"],
            help=meta["help"] if required else with_default(meta["help"], f.default),
        )
