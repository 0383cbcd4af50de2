"""Start-up and stop messages between the API's engine client and an engine core.

1. The engine connects a DEALER (identity: its rank) to the API's handshake
   ROUTER and sends ``EngineHello``.
2. The API answers ``EngineHandshakeReply``: the whole config, with this
   rank's ``parallel.data_parallel_rank`` set, and the data addresses.
3. The engine builds its EngineCore (slow), connects its input DEALER and
   sends ``EngineReady`` on it first, so the API's input ROUTER learns the
   peer before routing any request to it.
4. An engine that stops sends ``EngineGoodbye`` on the same input DEALER; the
   API answers with a SHUTDOWN frame, which is the engine's cue that the
   goodbye arrived (``ipc://`` can lose a process's last messages otherwise).
5. An engine told to stop gracefully (SIGTERM) first sends ``EngineDraining``:
   the API routes it nothing more and answers with a DRAIN frame; the engine
   finishes what it holds (up to its shutdown timeout), then says goodbye.

A restarted engine core says hello again with the same rank and rejoins.

All are ``array_like``: field ORDER is the wire contract. Append new fields
at the end, with defaults.
"""

from __future__ import annotations

import msgspec

from protocol.config import EngineConfig


class EngineHello(msgspec.Struct, array_like=True, frozen=True):
    rank: int
    local: bool  # started by the API's own launcher on its node
    headless: bool  # started by `engine-core --headless` (usually another node)


class EngineHandshakeReply(msgspec.Struct, array_like=True, frozen=True):
    config: EngineConfig
    input_address: str  # the API's input ROUTER: requests in, status out
    output_address: str  # the API's output PULL: EngineCoreOutputs


class EngineReady(msgspec.Struct, array_like=True, frozen=True, tag="ready"):
    rank: int
    num_blocks: int  # KV blocks, the null block included
    max_model_len: int


class EngineGoodbye(msgspec.Struct, array_like=True, frozen=True, tag="goodbye"):
    rank: int
    reason: str = ""


class EngineDraining(msgspec.Struct, array_like=True, frozen=True, tag="draining"):
    rank: int
    timeout_s: float  # how long it keeps serving what it holds


# What an engine sends the API on its input DEALER.
EngineStatus = EngineReady | EngineGoodbye | EngineDraining
