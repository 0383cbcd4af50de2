"""Which GPUs an engine core's workers use: each data-parallel rank on a node gets its own.

As vLLM: the engine core its launcher started ``local_dp_rank``-th on this node,
with ``tp`` workers, takes devices ``local_dp_rank × tp … local_dp_rank × tp + tp − 1``
of those the node lets it see, and its worker of tensor-parallel rank ``t`` takes
the ``t``-th of them (``cuda:t``, ``services/worker/worker.py``). The engine core
narrows ``CUDA_VISIBLE_DEVICES`` to its share before it imports torch, and its
workers inherit it. A ``CUDA_VISIBLE_DEVICES`` the user set is honoured: the shares
are cut from the devices it lists (indices, UUIDs or MIG names alike). Torch-free.
"""

from __future__ import annotations

import logging

from services import env

logger = logging.getLogger(__name__)
VISIBLE = "CUDA_VISIBLE_DEVICES"


def devices_of_rank(local_dp_rank: int, tp: int, inherited: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of local engine core ``local_dp_rank`` with ``tp`` workers,
    given the one it inherited (``None``: unset, every device of the node visible)."""
    if local_dp_rank < 0 or tp < 1:
        raise ValueError(f"local_dp_rank must be >= 0 and tp >= 1, got {local_dp_rank} and {tp}.")
    first = local_dp_rank * tp
    if inherited is None:
        return ",".join(str(i) for i in range(first, first + tp))
    listed = [d.strip() for d in inherited.split(",") if d.strip()]
    if first + tp > len(listed):
        raise ValueError(
            f"{VISIBLE}={inherited!r} lists {len(listed)} device(s); local data-parallel rank {local_dp_rank} "
            f"with tensor-parallel size {tp} needs devices {first}..{first + tp - 1} of them."
        )
    return ",".join(listed[first : first + tp])


def narrow_visible_devices(local_dp_rank: int | None, tp: int) -> str | None:
    """Give this process (and the workers it starts) its own devices; returns what it set.

    ``None`` (nothing changed) for an engine core started outside a launcher
    (no ``local_dp_rank``) or where the user hid every device (``CUDA_VISIBLE_DEVICES=""``).
    """
    if local_dp_rank is None or env.get_raw(VISIBLE) == "":
        return None
    devices = devices_of_rank(local_dp_rank, tp, env.get(VISIBLE))
    env.put(VISIBLE, devices)
    logger.info("Local data-parallel rank %d: %s=%s", local_dp_rank, VISIBLE, devices)
    return devices
