"""``weft serve --help`` and ``engine-core --help`` show the defaults the config classes hold.

Each default is rendered from the field or constant that holds it (``services/config/cli_args.py``,
``services/engine_core/proc_args.py``), so the help cannot state a stale one.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from services import cli
from services.api.server import build_parser as serve_parser
from services.config.dense_copy import (
    AMX_INT8_MAX_ROWS,
    AVX2_INT8_DENSE_MIN_ROWS,
    DEFAULT_DENSE_MIN_ROWS,
    INT8_MIN_ROWS,
    OWN_INT8_GEMM_DENSE_MIN_ROWS,
)
from services.config.engine_args import (
    AVX2_STEP_BUDGET,
    CPU_BLOCK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_STEP_BUDGET,
    GPU_BLOCK_SIZE,
    LONG_PREFILL_PERCENT,
    EngineArgs,
)
from services.config.memory_plan import MIN_FITTED_MAX_MODEL_LEN
from services.engine_core import cli as engine_core_cli
from services.engine_core.proc_args import EngineCoreArgs, build_parser, flag_dest
from services.processes import DEFAULT_SHUTDOWN_TIMEOUT_S


def help_text(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``main(argv)`` prints for ``--help``, its whitespace (argparse's wrapping) collapsed."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def flag_help(parser: argparse.ArgumentParser, flag: str) -> str:
    action = parser._option_string_actions[flag]
    return argparse.HelpFormatter(parser.prog)._expand_help(action)


@pytest.mark.parametrize(
    "field",
    [f for f in dataclasses.fields(EngineArgs) if f.default is not None],
    ids=lambda f: f.name,
)
def test_serve_help_shows_each_engine_argument_default(field: dataclasses.Field) -> None:
    text = flag_help(serve_parser(), "--" + field.name.replace("_", "-"))
    assert f"(default: {field.default})" in text or (str(field.default) in text and "default" in text)


def test_serve_help_states_the_rules_of_its_defaults_from_their_constants(capsys) -> None:
    text = help_text(cli.main, ["serve", "--help"], capsys)
    for stated in (
        f"(default {DEFAULT_STEP_BUDGET}; {AVX2_STEP_BUDGET} on a CPU with neither AMX nor AVX-512 VNNI",
        f"Most requests running at once (default {DEFAULT_MAX_NUM_SEQS}).",
        f"(default: {CPU_BLOCK_SIZE} on CPU, as vLLM's CPU backend; {GPU_BLOCK_SIZE} on CUDA)",
        f"no fewer than {MIN_FITTED_MAX_MODEL_LEN} tokens",
        f"default {LONG_PREFILL_PERCENT}% of --max-model-len",
        f"{AVX2_INT8_DENSE_MIN_ROWS} with the int8 copy on weft's own AVX2 int8 GEMM, "
        f"{OWN_INT8_GEMM_DENSE_MIN_ROWS} on its AMX int8 tiles or AVX-512 VNNI GEMMs, and "
        f"{DEFAULT_DENSE_MIN_ROWS} otherwise",
        f"up to {AMX_INT8_MAX_ROWS} rows on AMX int8 tiles",
        f"for steps of {INT8_MIN_ROWS} rows and more",
        f"ended with an error (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g}).",
    ):
        assert stated in text


def test_engine_core_help_shows_the_defaults_of_the_flags_it_passes_on(capsys) -> None:
    text = help_text(engine_core_cli.main, ["--help"], capsys)
    fields = {f.name: f for f in dataclasses.fields(EngineCoreArgs)}
    for name in engine_core_cli.PASSED_ON:
        help_of_flag = fields[name].metadata["help"].removesuffix(".")
        assert " ".join(help_of_flag.split()) in text  # the one declaration's help
        if fields[name].default is not None:
            assert f"(default: {fields[name].default})" in text
    assert f"(default: {DEFAULT_SHUTDOWN_TIMEOUT_S})" in text


def test_the_engine_core_process_and_its_launcher_read_the_same_flags() -> None:
    launcher, process = engine_core_cli.build_parser(), build_parser()
    for name in engine_core_cli.PASSED_ON:
        (flag,) = [f for f, a in process._option_string_actions.items() if a.dest == name]
        ours, theirs = launcher._option_string_actions[flag], process._option_string_actions[flag]
        assert (ours.dest, ours.default, ours.type, ours.help) == (
            flag_dest(name),
            theirs.default,
            theirs.type,
            theirs.help,
        )
