"""``--config FILE.yaml``: any flag of a command, read from a file (as ``vllm serve --config``).

The file is a YAML mapping of flag names (``max-model-len`` or
``max_model_len``) to values::

    model: /models/Qwen2.5-0.5B-Instruct
    port: 8000
    max-model-len: 4096
    enable-prefix-caching: true
    speculative-config: {method: ngram, num_speculative_tokens: 4}

Each entry becomes the command-line words it stands for and is parsed by the
command's own parser, so types, choices and checks are the flag's. Where one
flag is set in several places, the last of these wins: the file, a ``WEFT_*``
override (``services/env.py``), the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from services import env

MAX_CONFIG_BYTES = 1 << 20  # a config file is small; refuse to read a huge one whole


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with ``--config FILE`` and the env overrides applied first;
    ``argv`` None is the process's command line, as for argparse."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _add_config_argument(parser)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config or env.get("WEFT_CONFIG")
    on_command_line = _dests_in(parser, argv)
    words = []
    if path is not None:
        words += _drop(parser, config_words(parser, load_config(parser, path)), on_command_line)
    words += _drop(parser, _env_words(parser), on_command_line)
    return parser.parse_args(words + argv)


def _add_config_argument(parser: argparse.ArgumentParser) -> None:
    if "--config" in parser._option_string_actions:
        return
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="Read flags from this YAML file (flag: value); the command line wins over it. "
        "$WEFT_CONFIG names one when this is not given.",
    )
    overrides = [v for v in env.VARIABLES if v.flag in parser._option_string_actions and v.flag != "--config"]
    if overrides and parser.epilog is None:
        parser.epilog = "Environment overrides: " + ", ".join(f"{v.name} ({v.flag})" for v in overrides) + "."


def load_config(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The file's mapping, or a usage error (exit 2) saying what is wrong with it."""
    import yaml

    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        parser.error(f"--config {path}: {e.strerror or e}.")
    if len(raw) > MAX_CONFIG_BYTES:
        parser.error(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes.")
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        parser.error(f"--config {path} is not valid YAML: {e}")
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        parser.error(f"--config {path} must be a mapping of flag names to values.")
    return data


def config_words(parser: argparse.ArgumentParser, data: dict[str, Any]) -> list[str]:
    """The command-line words the mapping stands for; an unknown flag is a usage error naming it."""
    words = []
    for key, value in data.items():
        flag = "--" + key.removeprefix("--").replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None or flag == "--config":
            parser.error(f"--config: {key!r} is not a flag of {parser.prog}.")
        words += _words_for(parser, action, flag, value)
    return words


def _words_for(parser: argparse.ArgumentParser, action: argparse.Action, flag: str, value: Any) -> list[str]:
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # a switch
        if not isinstance(value, bool):
            parser.error(f"--config: {flag[2:]} takes true or false, got {value!r}.")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if value is None:
        return []
    if isinstance(value, list) and (isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")):
        items = [_word(v) for v in value]
        return [word for item in items for word in (flag, item)] if action.nargs is None else [flag, *items]
    return [flag, _word(value)]


def _word(value: Any) -> str:
    """One value as the command line would spell it (JSON flags take JSON)."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _env_words(parser: argparse.ArgumentParser) -> list[str]:
    known = {flag for flag in parser._option_string_actions if flag != "--config"}
    return [word for variable, value in env.flag_overrides(known) for word in (variable.flag, value)]


def _dests_in(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations the command line sets itself (its flags win over file and environment)."""
    dests = set()
    for word in argv:
        flag = word.split("=", 1)[0]
        action = parser._option_string_actions.get(flag)
        if action is not None:
            dests.add(action.dest)
    return dests


def _drop(parser: argparse.ArgumentParser, words: list[str], dests: set[str]) -> list[str]:
    """``words`` without the flags (and their values) whose destination is in ``dests``."""
    kept, skipping = [], False
    for word in words:
        action = parser._option_string_actions.get(word) if word.startswith("--") else None
        if action is not None:
            skipping = action.dest in dests
        if not skipping:
            kept.append(word)
    return kept
