"""The requests a worker holds between steps, updated from each SchedulerOutput.

Each request owns one row of a few numpy arrays (token ids, block table,
counters), so building a step's flattened inputs is a handful of vectorized
gathers rather than a loop over tokens. Rows are recycled as requests leave;
a request keeps its row for its whole stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import NewRequestData, PoolingParams, SamplingParams, SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]
    pooling_params: PoolingParams | None = None
    # Mean pooling: the sum of the hidden states of the prompt chunks run so far (a tensor).
    pooled_sum: Any = None
    # Its token filters as tensors (sampling_metadata.TokenFilters), built on its first sampled step.
    token_filters: Any = None
    token_filters_built: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, num_kv_groups: int = 1
    ) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs known
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # One block table per KV cache group (``protocol.kv_cache_groups``).
        # Unused entries stay 0: the null block, safe to gather from.
        self.block_tables = [
            np.zeros((max_num_reqs, max_blocks), dtype=np.int32) for _ in range(num_kv_groups)
        ]
        self.group_num_blocks = [np.zeros(max_num_reqs, dtype=np.int64) for _ in range(num_kv_groups)]
        self.requests: dict[str, CachedRequestState] = {}
        # The pooling (embeddings) requests held, so steps without any skip pooling at a glance.
        self.pooling_req_ids: set[str] = set()
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Drop finished and preempted requests, add new ones, apply the diffs of the rest."""
        for req_id in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            self.remove_request(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.add_request(new)
        cached = scheduler_output.scheduled_cached_reqs
        group_ids = cached.new_group_block_ids or [[]] * cached.num_reqs
        for req_id, block_ids, more, computed in zip(
            cached.req_ids, cached.new_block_ids, group_ids, cached.num_computed_tokens
        ):
            row = self.requests[req_id].row
            self.append_block_ids(row, block_ids, more)
            self.num_computed_tokens[row] = computed

    def add_request(self, new: NewRequestData) -> None:
        # A preempted request comes back as new: replace whatever we held.
        self.remove_request(new.req_id)
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        if len(tokens) > self.max_model_len:
            raise ValueError(
                f"Request {new.req_id} has {len(tokens)} tokens, more than max_model_len ({self.max_model_len})."
            )
        row = self._take_row()
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = new.num_computed_tokens
        for table, count in zip(self.block_tables, self.group_num_blocks):
            table[row] = 0
            count[row] = 0
        self.append_block_ids(row, new.block_ids, new.group_block_ids)
        self.requests[new.req_id] = CachedRequestState(
            new.req_id,
            row,
            list(new.prompt_token_ids),
            new.sampling_params,
            list(new.output_token_ids),
            new.pooling_params,
        )
        if new.pooling_params is not None:
            self.pooling_req_ids.add(new.req_id)

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        self.pooling_req_ids.discard(req_id)
        if state is not None:
            self._free_rows.append(state.row)

    @property
    def block_table(self) -> np.ndarray:
        """KV cache group 0's block tables (the only ones when all layers attend alike)."""
        return self.block_tables[0]

    @property
    def num_blocks(self) -> np.ndarray:
        return self.group_num_blocks[0]

    def append_block_ids(self, row: int, block_ids: list[int], group_block_ids: list[list[int]] = ()) -> None:
        """``block_ids`` extend group 0's table, ``group_block_ids[g - 1]`` group g's."""
        if len(group_block_ids) != len(self.block_tables) - 1:
            raise ValueError(
                f"Expected block ids for {len(self.block_tables)} KV cache groups, "
                f"got {1 + len(group_block_ids)}."
            )
        for table, count, ids in zip(self.block_tables, self.group_num_blocks, [block_ids, *group_block_ids]):
            start = int(count[row])
            if start + len(ids) > table.shape[1]:
                raise ValueError(
                    f"Block table of row {row} would exceed {table.shape[1]} blocks (max_model_len)."
                )
            table[row, start : start + len(ids)] = ids
            count[row] = start + len(ids)

    def append_token(self, req_id: str, token_id: int) -> None:
        """Record a token this worker sampled; it is the input of the request's next step."""
        state = self.requests[req_id]
        n = int(self.num_tokens[state.row])
        if n < self.max_model_len:  # the scheduler stops the request at max_model_len
            self.token_ids[state.row, n] = token_id
            self.num_tokens[state.row] = n + 1
        state.output_token_ids.append(token_id)

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow()
        return self._free_rows.pop()

    def _grow(self) -> None:
        """More requests than max_num_seqs at once (should not happen): double the rows."""
        old = self.token_ids.shape[0]
        for name in ("token_ids", "num_tokens", "num_computed_tokens"):
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
        for arrays in (self.block_tables, self.group_num_blocks):
            arrays[:] = [np.concatenate([a, np.zeros_like(a)]) for a in arrays]
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
