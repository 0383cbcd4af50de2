"""The workers: the model, its paged KV cache and the sampler, on one device each.

With one device the worker runs inside the engine-core process
(``UniProcExecutor``); with tensor parallelism each rank is a process of its
own (``worker_proc.py``, spawned by ``MultiprocExecutor``) and the ranks
share each layer's work over torch.distributed. Each step turns a
``SchedulerOutput`` into a ``ModelRunnerOutput``: inputs, forward, logits,
sampling. This is where torch, the kernels and the weights live.
"""
