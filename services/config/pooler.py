"""``--pooler``: how /v1/embeddings turns a prompt's hidden states into one vector.

``auto`` reads the checkpoint where it says: a sentence-transformers model
keeps a ``modules.json`` beside its Hugging Face files, whose Pooling module
points at a folder (``1_Pooling``) with a ``config.json`` of
``pooling_mode_*`` flags. Without one, a decoder model pools its last token
(the one that has attended to every other: Qwen3-Embedding, e5-mistral).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

POOLERS = ("auto", "last", "mean")
_POOLING_MODULE = "sentence_transformers.models.Pooling"
# sentence-transformers' flags -> weft's pooler; the others (cls, max, weighted mean) are not served.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def resolve_pooler(value: str, hf_dir: Path) -> str:
    """``last`` or ``mean``; the choice and where it came from are logged."""
    if value not in POOLERS:
        raise ValueError(f"pooler must be one of {', '.join(POOLERS)}; got {value!r}.")
    if value != "auto":
        logger.info("Embeddings pooler: %s (--pooler)", value)
        return value
    found = _checkpoint_pooler(hf_dir)
    if found is None:
        logger.info(
            "Embeddings pooler: last (auto: no sentence-transformers pooling config, a decoder model)"
        )
        return "last"
    logger.info("Embeddings pooler: %s (auto: %s)", found[0], found[1])
    return found[0]


def _checkpoint_pooler(hf_dir: Path) -> tuple[str, Path] | None:
    """(pooler, the file that says so) from a sentence-transformers checkpoint; None if it is not one."""
    modules_file = hf_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must hold a list of modules.")
    paths = [m.get("path") for m in modules if isinstance(m, dict) and m.get("type") == _POOLING_MODULE]
    if not paths or not isinstance(paths[0], str):
        return None
    config_file = hf_dir / paths[0] / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object.")
    chosen = [pooler for flag, pooler in _MODES.items() if config.get(flag) is True]
    others = sorted(
        k for k, v in config.items() if k.startswith("pooling_mode_") and v is True and k not in _MODES
    )
    if len(chosen) != 1 or others:
        raise ValueError(
            f"{config_file} asks for pooling {sorted(k for k, v in config.items() if v is True)}; "
            f"weft pools by exactly one of {sorted(_MODES)}: pass --pooler last or --pooler mean."
        )
    return chosen[0], config_file


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read {path}: {e}") from e
