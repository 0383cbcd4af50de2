"""Who may set ``kv_transfer_params``: the P/D proxy, and no one else.

The parameters steer an engine's KV transfers (``do_remote_prefill`` parks a
request while the consumer fetches blocks; ``do_remote_decode`` makes a
producer push a prompt's KV), so a P/D server accepts them only in a
request that carries the deployment's shared secret in the
``X-Weft-KV-Transfer-Key`` header: ``weft pd-proxy`` adds it to both legs,
and clients never see it. The secret comes from ``--kv-transfer-secret-file``
(not from the command line, where ``ps`` would show it) or the
``WEFT_KV_TRANSFER_SECRET`` environment variable. A P/D server without one
refuses every client-set ``kv_transfer_params`` (403). Torch-free.
"""

from __future__ import annotations

import argparse
import hmac
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from protocol.errors import APIError
from services import env

HEADER = "x-weft-kv-transfer-key"
ENV = "WEFT_KV_TRANSFER_SECRET"
_MAX_SECRET_BYTES = 4096


def add_secret_arg(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--kv-transfer-secret-file",
        default=None,
        metavar="FILE",
        help="Disaggregated prefill/decode: the secret the P/D proxy sends with "
        "kv_transfer_params (default: $WEFT_KV_TRANSFER_SECRET). Without one, a P/D "
        "server refuses kv_transfer_params from clients.",
    )


def load_secret(path: str | os.PathLike | None) -> str | None:
    """The shared secret from ``path`` (a file only its owner may read), else the environment."""
    if path is None:
        return env.get(ENV)
    file = Path(path)
    mode = stat.S_IMODE(file.stat().st_mode)
    if mode & 0o077:
        raise ValueError(
            f"--kv-transfer-secret-file {file} is readable by others (mode {mode:o}); `chmod 600 {file}`."
        )
    secret = file.read_bytes()[: _MAX_SECRET_BYTES + 1].decode().strip()
    if not secret or len(secret) > _MAX_SECRET_BYTES:
        raise ValueError(
            f"--kv-transfer-secret-file {file} must hold a secret of 1 to {_MAX_SECRET_BYTES} bytes."
        )
    return secret


def is_trusted(headers: Mapping[str, str], secret: str | None) -> bool:
    if secret is None:
        return False
    return hmac.compare_digest(headers.get(HEADER, "").encode(), secret.encode())


def require_trusted_caller(headers: Mapping[str, str], secret: str | None) -> None:
    """403 unless the request comes from the P/D proxy."""
    if is_trusted(headers, secret):
        return
    reason = (
        "this server has no --kv-transfer-secret-file"
        if secret is None
        else "the request does not carry the P/D proxy's key"
    )
    raise APIError(
        f"kv_transfer_params are accepted only from the P/D proxy ({reason}).",
        403,
        param="kv_transfer_params",
    )
