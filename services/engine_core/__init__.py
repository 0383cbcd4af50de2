"""An engine core: one data-parallel rank's scheduler, KV cache and executor.

Runs in its own process (``proc.py``, started by ``weft serve`` for local
ranks or by ``engine-core --headless``, ``cli.py``, on other nodes), or inside
the offline ``LLM``'s process. Each step schedules tokens under one budget,
has the executor run them and turns the sampled tokens into outputs for the
API. Torch is loaded only by the executor's workers (``services/worker``).
"""
