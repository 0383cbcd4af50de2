"""The README states what the code does.

- Every ``weft ...`` (and ``engine-core ...``) command in a README code block uses only flags
  its subcommand's parser has. The parsers are the real ones, caught in-process as the
  command would build them (no subprocess).
- The facts the README states about defaults (supported architectures, the quantization
  default, the dtype rule) sit between generated markers and are rendered here from the code.
  ``python -m tests.repo.test_readme`` rewrites that section.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys

import pytest

from services import cli
from services.config import architectures, engine_args
from services.worker import gguf_repack
from tests.utils import REPO_ROOT

README = REPO_ROOT / "README.md"
BEGIN = "<!-- BEGIN GENERATED: model-defaults -->"
END = "<!-- END GENERATED: model-defaults -->"
SHELL_ENDS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"}
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")  # a word shaped otherwise is not a flag (a diagram's `--x)`)
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _catch(monkeypatch: pytest.MonkeyPatch, run) -> argparse.ArgumentParser:
    """The first parser of a weft command that ``run`` asks to parse (helper parsers, such as
    the one that looks for ``--config`` first, have another prog and are let through)."""
    original = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        if self.prog.startswith(("weft", "engine-core")):
            raise _Caught(self)
        return original(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    try:
        run()
    except _Caught as caught:
        return caught.parser
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", original)
    raise AssertionError("the command parsed no arguments")


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """Down the subcommands the positional words name (``weft bench peers``)."""
    for word in words:
        if word.startswith("-"):
            break
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


def command_lines(text: str) -> list[list[str]]:
    """Each ``weft``/``engine-core`` command of the text's code blocks, as words, up to the first
    shell operator (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # not shell (a log line, YAML)
            for start in (i for i, w in enumerate(words) if w in ("weft", "engine-core")):
                before = words[start - 1] if start else None
                if before is not None and before not in SHELL_ENDS and not ENV_WORD.match(before):
                    continue  # not a command: a word of prose or of a diagram
                if before is not None and ENV_WORD.match(before) and not _starts_command(words, start):
                    continue
                rest = words[start:]
                end = next((i for i, w in enumerate(rest) if w in SHELL_ENDS), len(rest))
                commands.append(rest[:end])
    return commands


def _starts_command(words: list[str], start: int) -> bool:
    """Only ``VAR=value`` words (after a shell operator, or none) before ``words[start]``."""
    i = start - 1
    while i >= 0 and ENV_WORD.match(words[i]):
        i -= 1
    return i < 0 or words[i] in SHELL_ENDS


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def parser_of(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The flags the command ``argv`` (``weft serve ...``) accepts."""
    if argv[0] == "engine-core":
        from services.engine_core import cli as engine_core_cli

        return _flags_of(_catch(monkeypatch, lambda: engine_core_cli.main(["--help"])))
    words = argv[1:]
    # `weft bench soak` hands its words to a parser of its own; others are subparsers.
    head = [w for w in words[:2] if not w.startswith("-")]
    parser = _catch(monkeypatch, lambda: cli.main([*head, "--help"]))
    parser = _subparser(parser, words[len(parser.prog.split()) - 1 :])  # past `weft bench`
    flags = _flags_of(parser)
    if words[:2] == ["pd", "up"]:  # the words it does not take go to both `weft serve`s
        flags |= _flags_of(_catch(monkeypatch, lambda: cli.main(["serve", "--help"])))
    return flags


def test_every_documented_command_uses_flags_its_parser_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's commands, and those of the docs/ pages it links."""
    readme = command_lines(README.read_text())
    assert len(readme) >= 15  # the extraction still finds them
    assert {c[1] for c in readme if c[0] == "weft"} >= {"serve", "generate", "keys", "pd", "pd-proxy"}
    cache: dict[tuple[str, ...], set[str]] = {}
    unknown = []
    for doc in DOCS:
        for argv in command_lines(doc.read_text()):
            key = tuple(w for w in argv[:3] if not w.startswith("-"))
            if key not in cache:
                cache[key] = parser_of(argv, monkeypatch)
            for word in argv[1:]:
                flag = word.split("=", 1)[0]
                if FLAG.match(flag) and flag not in cache[key]:
                    unknown.append((doc.name, " ".join(argv[:3]), flag))
    assert not unknown, f"documented commands use flags their parsers lack: {unknown}"


def test_the_check_catches_a_flag_that_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    (argv,) = command_lines("```bash\nweft serve --port 1 --no-such-flag  # x\n```\n")
    flags = parser_of(argv, monkeypatch)
    assert "--port" in flags and "--no-such-flag" not in flags
    assert command_lines("```bash\ncat x | weft keys --dir k && engine-core --headless\n```\n") == [
        ["weft", "keys", "--dir", "k"],
        ["engine-core", "--headless"],
    ]


# --- the generated facts ---------------------------------------------------------------

BF16_FLAG_CANDIDATES = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma")


def bf16_flags() -> list[str]:
    """The CPU flags that make ``--dtype auto`` pick bf16, as the code decides."""
    return [f for f in BF16_FLAG_CANDIDATES if engine_args.cpu_has_fast_bf16({f})]


def model_defaults_markdown() -> str:
    names = {}
    for model_type, architecture in architectures._MODEL_TYPES.items():
        names.setdefault(architecture, []).append(f"`{model_type}`")
    rows = [f"| `{a}` | {', '.join(names.get(a, []))} |" for a in architectures.ARCHITECTURES]
    gguf_cpu = engine_args.resolve_quantization(None, is_gguf=True, device="cpu", load_format="auto")
    gguf_cuda = engine_args.resolve_quantization(None, is_gguf=True, device="cuda", load_format="auto")
    folder = engine_args.resolve_quantization(None, is_gguf=False, device="cpu", load_format="auto")
    flags = " or ".join(f"`{f}`" for f in bf16_flags())
    packed = ", ".join(sorted(gguf_repack._REPACKERS))
    return "\n".join(
        [
            f"Supported architectures ({len(architectures.ARCHITECTURES)}):",
            "",
            "| architecture | `model_type` / GGUF `general.architecture` |",
            "|---|---|",
            *rows,
            "",
            f"- `--quantization` default: `{gguf_cpu}` for a GGUF file on CPU (its weights stay packed), "
            f"`{gguf_cuda}` for a GGUF file on CUDA (dequantized at load), `{folder}` for safetensors.",
            f"- GGUF types kept packed on CPU: {packed}; other types are dequantized at load.",
            f"- `--dtype auto`: `{engine_args.resolve_dtype('auto', 'cuda')}` on CUDA (fp16 below compute "
            f"capability 8.0); on CPU `bfloat16` only where the CPU has bf16 math ({flags} in its flags) "
            "and steps run dense weights (safetensors, `--quantization none`, or a dense copy); "
            "otherwise `float32`, as for a GGUF kept packed (the default).",
        ]
    )


def test_the_dtype_rule_the_readme_states_is_the_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bf16_flags()  # some flag makes bf16 fast
    for fast in (True, False):
        monkeypatch.setattr(engine_args, "cpu_has_fast_bf16", lambda flags=None, fast=fast: fast)
        dense = "bfloat16" if fast else "float32"
        assert engine_args.resolve_dtype("auto", "cpu", "none") == dense
        assert engine_args.resolve_dtype("auto", "cpu", "gguf", dense_copy=True) == dense
        assert engine_args.resolve_dtype("auto", "cpu", "gguf", dense_copy=False) == "float32"
        assert engine_args.resolve_dtype("auto", "cuda") == "bfloat16"


def generated_section(text: str) -> str:
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "the README lost its generated markers"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_the_readmes_model_defaults_are_rendered_from_the_code() -> None:
    assert generated_section(README.read_text()) == model_defaults_markdown(), (
        "README's generated section is stale: run `python -m tests.repo.test_readme`"
    )


def write() -> None:
    text = README.read_text()
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    README.write_text(f"{before}{BEGIN}\n{model_defaults_markdown()}\n{END}{after}")


def test_the_readme_is_for_users() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 600
    assert "## Contents" in text
    assert text.count("## Security model") == 1
    # Dated measurement logs live in benchmarks/results/, not here.
    assert len(re.findall(r"\bpeers-r\d+", text)) <= 1


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_of_the_readme_and_docs_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append((doc.name, target))
            elif anchor and file.is_file() and anchor not in _anchors(file.read_text()):
                broken.append((doc.name, target))
    assert not broken, f"links to nothing: {broken}"


if __name__ == "__main__":
    write()
    sys.exit(0)
