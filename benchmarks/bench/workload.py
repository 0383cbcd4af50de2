"""Benchmark workloads: JSON files of prompts with exact output lengths.

The format is described in ``benchmarks/workloads/README.md``. A workload is
checked whole on load (types, ranges, declared totals), so a benchmark never
starts on a file it would misreport.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from benchmarks import BENCHMARKS_DIR
from services import env


class WorkloadRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int  # the exact output length (the workload runs with ignore_eos)


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    requests: list[WorkloadRequest]
    description: str = ""
    ignore_eos: bool = True
    # Declared in the file and checked against the requests on load.
    total_prompt_tokens: int | None = None
    total_output_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def summary(self) -> str:
        """The first words of a benchmark's table: name, requests and tokens."""
        return (
            f"workload {self.name}: {len(self.requests)} requests, "
            f"{self.num_prompt_tokens} prompt + {self.num_output_tokens} output tokens"
        )

    def head(self, num_prompts: int) -> Workload:
        """The first ``num_prompts`` requests, in workload order."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {num_prompts}.")
        requests = self.requests[:num_prompts]
        return msgspec.structs.replace(
            self,
            requests=requests,
            total_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            total_output_tokens=sum(r.max_tokens for r in requests),
        )


def workloads_dir() -> Path:
    """Where bare workload names resolve: ``$WEFT_WORKLOADS_DIR``, else ``benchmarks/workloads``
    (in a checkout, and in an installed weft, whose wheel carries them)."""
    return Path(env.get("WEFT_WORKLOADS_DIR") or BENCHMARKS_DIR / "workloads")


def resolve_dataset(dataset: str) -> Path:
    """A path as given, or a bare workload name (``smoke-8``) in ``workloads_dir()``."""
    path = Path(dataset)
    if path.exists() or path.suffix or len(path.parts) > 1:
        return path
    return workloads_dir() / f"{dataset}.json"


def workload_file(name: str, description: str, requests: list[dict]) -> dict:
    """A generated workload as its JSON file holds it, the totals counted from ``requests``."""
    return {
        "name": name,
        "description": description,
        "ignore_eos": True,
        "total_prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "total_output_tokens": sum(r["max_tokens"] for r in requests),
        "requests": requests,
    }


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file, or raise ValueError saying what is wrong."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"Cannot read workload {path}: {e.strerror or e}.") from e
    try:
        workload = msgspec.json.decode(raw, type=Workload)
    except msgspec.DecodeError as e:
        raise ValueError(f"Workload {path} is not valid: {e}.") from e
    _check(workload, path)
    return workload


def _check(workload: Workload, path: Path) -> None:
    if not workload.requests:
        raise ValueError(f"Workload {path} has no requests.")
    if not workload.ignore_eos:
        raise ValueError(
            f"Workload {path} has ignore_eos false; max_tokens is an exact output "
            "length only with ignore_eos true."
        )
    for i, request in enumerate(workload.requests):
        where = f"Workload {path}, request {i}"
        if not request.prompt_token_ids:
            raise ValueError(f"{where}: prompt_token_ids is empty.")
        if min(request.prompt_token_ids) < 0:
            raise ValueError(f"{where}: prompt_token_ids must be non-negative token ids.")
        if request.max_tokens < 1:
            raise ValueError(f"{where}: max_tokens must be at least 1, got {request.max_tokens}.")
    _check_total(path, "total_prompt_tokens", workload.total_prompt_tokens, workload.num_prompt_tokens)
    _check_total(path, "total_output_tokens", workload.total_output_tokens, workload.num_output_tokens)


def _check_total(path: Path, field: str, declared: int | None, actual: int) -> None:
    if declared is not None and declared != actual:
        raise ValueError(f"Workload {path}: {field} says {declared}, but the requests hold {actual}.")
