"""Disaggregated prefill/decode: KV connectors (scheduler and worker halves),
the kv_transfer service (``weft kv-transfer``) and the P/D proxy
(``weft pd-proxy``). Import-light: torch loads only in worker-side modules
(``kv_blocks``, ``transfer_thread``, ``worker_step``)."""
