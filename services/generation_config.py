"""The model's ``generation_config.json``, read as vLLM reads it. Torch-free.

``--generation-config``:

- ``auto`` (default): the model folder's ``generation_config.json``, or,
  when it has none, what transformers would derive from ``config.json``
  (its ``eos_token_id`` and any sampling fields it carries);
- ``vllm``: ignore the model's file; weft's (and vLLM's) own defaults;
- a folder: the ``generation_config.json`` in that folder.

Two things come out of it. Sampling defaults (temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens as max_tokens) apply to a
request that does not set them. EOS ids beyond the model's own become
stop tokens of every request that does not ``ignore_eos`` (Llama 3's
``<|eom_id|>``, Qwen's ``<|endoftext|>``): generation ends at them, the id
in ``stop_reason``, as vLLM's ``update_from_generation_config`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from protocol import ModelConfig, SamplingParams

_TokenId = Annotated[int, msgspec.Meta(ge=0)]
# generation_config.json key -> SamplingParams field.
SAMPLING_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(mode: str, model_dir: Path) -> dict:
    """The generation config ``mode`` selects (see the module docstring); {} for ``vllm``."""
    if mode == "vllm":
        return {}
    folder = model_dir if mode == "auto" else Path(mode)
    path = folder / "generation_config.json"
    if path.exists():
        return _load(path)
    if mode != "auto":
        raise ValueError(
            f"generation_config: {path} does not exist (expected 'auto', 'vllm' or a folder with "
            "a generation_config.json)."
        )
    config_path = model_dir / "config.json"
    config = _load(config_path) if config_path.exists() else {}
    return {k: config[k] for k in ("eos_token_id", *SAMPLING_FIELDS) if config.get(k) is not None}


def _load(path: Path) -> dict:
    try:
        return msgspec.json.decode(path.read_bytes(), type=dict)
    except (OSError, msgspec.DecodeError) as e:  # ValidationError (not an object) is a DecodeError
        raise ValueError(f"generation_config: cannot read {path} as a JSON object: {e}") from e


def sampling_defaults(generation_config: dict) -> dict[str, float | int]:
    """SamplingParams field -> the model's default, for the fields the config sets."""
    defaults = {}
    for key, field in SAMPLING_FIELDS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        kind = int if field in ("top_k", "max_tokens") else float
        try:
            defaults[field] = msgspec.convert(value, kind)
        except msgspec.ValidationError as e:
            raise ValueError(f"generation_config: {key} must be a number, got {value!r}.") from e
    return defaults


def extra_eos_token_ids(generation_config: dict, model_eos_token_id: int | None) -> list[int]:
    """The config's EOS ids other than the model's own, in the file's order."""
    eos = generation_config.get("eos_token_id")
    try:
        ids = msgspec.convert([] if eos is None else eos, int | list[_TokenId])
    except msgspec.ValidationError as e:
        raise ValueError(
            f"generation_config: eos_token_id must be a token id or a list of them, got {eos!r}."
        ) from e
    ids = [ids] if isinstance(ids, int) else ids
    return list(dict.fromkeys(i for i in ids if i != model_eos_token_id))


def with_extra_eos(params: SamplingParams, extra_eos: list[int]) -> SamplingParams:
    """``params`` stopping at the extra EOS ids too (not when it ignores EOS)."""
    if not extra_eos or params.ignore_eos:
        return params
    stop = list(params.stop_token_ids or [])
    merged = stop + [i for i in extra_eos if i not in stop]
    return msgspec.structs.replace(params, stop_token_ids=merged)


def model_default(model: ModelConfig, field: str, fallback):
    """The model's default for a SamplingParams field, else ``fallback``."""
    return model.generation_defaults.get(field, fallback)
