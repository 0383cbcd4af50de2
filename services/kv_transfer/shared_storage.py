"""SharedStorageConnector: KV blocks as safetensors files in a shared folder.

One file per block, ``<path>/<key hex>.safetensors``, holding the block's
tensor ``kv`` ([layers, 2, kv_heads, block_size, head_dim], in the cache's
dtype) and its producer's CRC-32 in the metadata. A file is written under a
temporary name and renamed, so a reader sees a whole block or none. Any
engine that mounts the folder can load what another saved: a consumer finds
blocks by their keys even without ``kv_transfer_params`` (the folder is
cheap to probe).
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from protocol.kv_transfer import KVBlock
from services.kv_transfer.block_connector import BlockConnector
from services.kv_transfer.block_store import BlockStore
from services.kv_transfer.config import SharedStorageOptions

_POLL_S = 0.01  # how often a load re-checks for files a producer is still writing


class FileBlockStore(BlockStore):
    discoverable = True

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def file_of(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}.safetensors"

    def num_present(self, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            if not self.file_of(key).exists():
                return i
        return len(keys)

    def put(self, blocks: list[KVBlock]) -> None:
        import torch
        from safetensors.torch import save_file

        from services.kv_transfer.kv_blocks import torch_dtype

        for block in blocks:
            raw = torch.frombuffer(bytearray(block.data), dtype=torch.uint8)
            tensor = raw.view(torch_dtype(block.dtype)).view(block.shape)
            final = self.file_of(block.key)
            temp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
            save_file({"kv": tensor}, str(temp), metadata={"checksum": str(block.checksum)})
            os.replace(temp, final)

    def get(self, keys: list[bytes], wait_s: float) -> dict[bytes, KVBlock]:
        deadline = time.monotonic() + wait_s
        found: dict[bytes, KVBlock] = {}
        while True:
            for key in keys:
                if key not in found and (block := self._read(key)) is not None:
                    found[key] = block
            if len(found) == len(keys) or time.monotonic() >= deadline:
                return found
            time.sleep(_POLL_S)  # files appear as the producer writes them

    def _read(self, key: bytes) -> KVBlock | None:
        import torch
        from safetensors import SafetensorError, safe_open

        path = self.file_of(key)
        try:
            with safe_open(str(path), framework="pt") as f:
                tensor = f.get_tensor("kv")
                recorded = int((f.metadata() or {}).get("checksum", "-1"))
        except FileNotFoundError:
            return None
        except (SafetensorError, OSError, ValueError):
            # A damaged file is a block that is not there: the consumer computes it.
            return None
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        return KVBlock(key=key, dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape),
                       checksum=recorded, data=data)


class SharedStorageConnector(BlockConnector):
    def _make_store(self) -> FileBlockStore:
        options = self.options
        assert isinstance(options, SharedStorageOptions)
        return FileBlockStore(options.shared_storage_path)
