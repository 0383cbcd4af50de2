"""User input to the frozen ``EngineConfig``, in one place.

``cli_args`` declares the engine flags, ``engine_args`` turns flags or
keyword arguments into an ``EngineConfig`` (every ``"auto"`` resolved,
every value checked), and the modules beside them parse the parts that
arrive as JSON or need their own rules: ``speculative_args``,
``parallel_args``, ``kv_transfer_args`` and ``json_arg``.
"""
