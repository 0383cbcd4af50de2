"""``weft bench compare``: weft's offline engine against its peers and its own limit, one run.

Peers, on the same workload, model, dtype and CPU threads:
- Hugging Face ``generate`` with static batching at each ``--hf-batch-sizes``
  (``hf_baseline``: only the requested tokens count);
- transformers' continuous batching (``model.generate_batch``'s manager), where
  the installed version has it.

The limit: while weft runs, every ``SchedulerOutput`` the engine executes is
recorded with what the worker sampled. Afterwards the same batches are
replayed through the model alone (input preparation and sampling untimed;
the sampled tokens are fed back from the recording so every step sees exactly
the inputs it had), and the time of ``engine.step`` is set against the time
of that forward. The forward includes the LM head on the rows that sample, as
any engine must compute those logits; what is left is scheduling, input
preparation, sampling, output processing and detokenization.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from benchmarks.bench.throughput import BenchResult, timed_generate, weft_result
from benchmarks.bench.workload import Workload

# transformers' continuous batching answers nothing until its first batch is
# through; on two shared cores that can take minutes.
_RESULT_TIMEOUT_S = 600


@dataclass
class StepRecorder:
    """Wraps one engine's ``step`` and executor's ``execute_model`` with timers."""

    step_s: list[float] = field(default_factory=list)
    step_cpu_s: list[float] = field(default_factory=list)  # process CPU time: steadier under others' load
    execute_s: list[float] = field(default_factory=list)
    executed: list[tuple[Any, Any]] = field(default_factory=list)  # (SchedulerOutput, ModelRunnerOutput)

    def attach(self, engine: Any) -> None:
        step, execute = engine.step, engine.executor.execute_model

        def timed_step() -> Any:
            start, cpu_start = time.perf_counter(), time.process_time()
            out = step()
            self.step_s.append(time.perf_counter() - start)
            self.step_cpu_s.append(time.process_time() - cpu_start)
            return out

        def timed_execute(scheduler_output: Any) -> Any:
            start = time.perf_counter()
            out = execute(scheduler_output)
            self.execute_s.append(time.perf_counter() - start)
            if scheduler_output.total_num_scheduled_tokens:
                self.executed.append((scheduler_output, out))
            return out

        engine.step = timed_step  # this engine only: it is ours, made for this run
        engine.executor.execute_model = timed_execute


def run_weft_recorded(
    workload: Workload, use_tqdm: bool, **engine_args: Any
) -> tuple[BenchResult, dict[str, Any]]:
    """The throughput run with its steps recorded, then the forward-only replay."""
    from services import LLM

    llm = LLM(**engine_args)
    recorder = StepRecorder()
    recorder.attach(llm.engine)
    forward: list[tuple[float, float]] = []

    def replay() -> None:
        forward.append(replay_forward(llm.engine.executor.worker.model_runner, recorder.executed))

    outputs, elapsed, cpu = timed_generate(llm, workload, use_tqdm, after=replay)
    [(forward_s, forward_cpu_s)] = forward
    config = llm.config
    details = {
        "dtype": config.model.dtype,
        "device": config.device.device,
        "torch_threads": config.device.num_threads,
    }
    result = weft_result(workload, outputs, elapsed, cpu, details)
    # All steps count: one that runs no forward is overhead too.
    step_s = sum(recorder.step_s)
    efficiency = {
        "steps": len(recorder.step_s),
        "forward_steps": len(recorder.executed),
        "step_s": step_s,
        "execute_model_s": sum(recorder.execute_s),
        "forward_s": forward_s,
        "step_over_forward": step_s / forward_s,
        "step_cpu_s": sum(recorder.step_cpu_s),
        "forward_cpu_s": forward_cpu_s,
        "step_over_forward_cpu": sum(recorder.step_cpu_s) / forward_cpu_s,
        "execute_over_forward": sum(recorder.execute_s) / forward_s,
    }
    return result, efficiency


def replay_forward(runner: Any, executed: list[tuple[Any, Any]]) -> tuple[float, float]:
    """Wall and CPU seconds the model's forward (with the LM head on sampling
    rows) takes over the recorded batches, with the recorded tokens fed back untimed."""
    import torch

    from services.worker.forward_context import set_forward_context
    from services.worker.step_inputs import prepare_step

    batch = runner.input_batch
    for req_id in list(batch.requests):  # finished requests the engine never told the worker about
        batch.remove_request(req_id)
    total = total_cpu = 0.0
    with torch.inference_mode():
        for scheduler_output, output in executed:
            batch.update(scheduler_output)
            req_ids = list(scheduler_output.num_scheduled_tokens)
            step = prepare_step(
                batch,
                req_ids,
                scheduler_output.num_scheduled_tokens,
                runner.device,
                runner.max_decode_group_tokens,
                attention_backend=runner.attention_backend,
            )
            start, cpu_start = time.perf_counter(), time.process_time()
            with set_forward_context(
                step.attn_metadata,
                runner.kv_caches,
                runner.attention_backend,
                step.group_metadata,
                kv_scales=runner.kv_scales,
            ):
                hidden = runner.model(step.input_ids, step.positions)  # [T, H]
            if len(step.sample_token_index):
                runner.model.compute_logits(hidden[torch.from_numpy(step.sample_token_index)])  # [N, V]
            total += time.perf_counter() - start
            total_cpu += time.process_time() - cpu_start
            for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
                for token in tokens:
                    batch.append_token(req_id, token)
    return total, total_cpu


def run_hf_continuous(workload: Workload, hf_model: Any) -> BenchResult | str:
    """transformers' continuous batching, or why it could not run."""
    if not hasattr(hf_model, "init_continuous_batching"):
        return "this transformers has no continuous batching (model.init_continuous_batching)"
    try:
        manager = hf_model.init_continuous_batching()
        manager.start()
        try:
            _warm_up_continuous(manager, workload.requests[0].prompt_token_ids)
            start, cpu_start = time.perf_counter(), time.process_time()
            # eos -1 is never sampled: ignore_eos, so lengths are exact.
            ids = [
                manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
                for r in workload.requests
            ]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=_RESULT_TIMEOUT_S)
                if result is None:
                    raise RuntimeError(f"no result within {_RESULT_TIMEOUT_S} s")
                if result.is_finished():
                    results[result.request_id] = result
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        finally:
            manager.stop(block=True, timeout=30)
    except Exception as e:  # noqa: BLE001 - an optional peer: report, do not fail the comparison
        return f"continuous batching failed: {type(e).__name__}: {e}"
    requested = {i: r.max_tokens for i, r in zip(ids, workload.requests)}
    return BenchResult(
        backend="hf-continuous",
        num_requests=len(results),
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=sum(min(len(r.generated_tokens), requested[i]) for i, r in results.items()),
        elapsed_s=elapsed,
        cpu_s=cpu,
        details={"dtype": str(hf_model.dtype).removeprefix("torch.")},
    )


def _warm_up_continuous(manager: Any, prompt: list[int]) -> None:
    """One short untimed request: the manager sizes its cache on the first batch."""
    request_id = manager.add_request(prompt, max_new_tokens=2, eos_token_id=-1)
    while True:
        result = manager.get_result(request_id=request_id, timeout=_RESULT_TIMEOUT_S)
        if result is None:
            raise RuntimeError(f"no warm-up result within {_RESULT_TIMEOUT_S} s")
        if result.is_finished():
            return


def spread_subset(workload: Workload, count: int | None) -> Workload:
    """``count`` requests spread evenly over the workload (all of them if None).

    HF at batch size 1 has no padding, so its tokens/s is a per-request rate
    and a spread sample of the requests estimates it; the whole of
    offline-64 one at a time takes most of an hour on two cores.
    """
    if count is None or count >= len(workload.requests):
        return workload
    if count < 1:
        raise ValueError(f"the batch-1 subset needs at least one request, got {count}.")
    step = len(workload.requests) / count
    picked = [workload.requests[int(i * step)] for i in range(count)]
    return msgspec.structs.replace(
        workload, requests=picked, total_prompt_tokens=None, total_output_tokens=None
    )


def run_compare(
    workload: Workload,
    model: str | None,
    batch_sizes: list[int],
    continuous: bool,
    use_tqdm: bool,
    bs1_requests: int | None = None,
    **engine_args: Any,
) -> dict[str, Any]:
    import torch

    from benchmarks.bench.hf_baseline import load_hf_model, run_hf_baseline

    weft, efficiency = run_weft_recorded(workload, use_tqdm, model=model, **engine_args)
    gc.collect()
    torch.set_num_threads(weft.details["torch_threads"])
    hf_model = load_hf_model(model, weft.details["dtype"], weft.details["device"])
    _progress(use_tqdm, f"weft: {weft.output_tokens_per_s:.1f} output tok/s")
    peers: list[BenchResult] = []
    for size in batch_sizes:  # one at a time, each reported as it ends: the small batches take long
        peers.append(
            run_hf_baseline(spread_subset(workload, bs1_requests) if size == 1 else workload, hf_model, size)
        )
        _progress(use_tqdm, f"hf static batch {size}: {peers[-1].output_tokens_per_s:.1f} output tok/s")
    notes = []
    if continuous:
        cb = run_hf_continuous(workload, hf_model)
        if isinstance(cb, str):
            notes.append(cb)
        else:
            peers.append(cb)
    rows = [
        {
            **r.to_dict(),
            "label": _label(r),
            "weft_over_peer": weft.output_tokens_per_s / r.output_tokens_per_s,
            "weft_over_peer_cpu": weft.output_tokens_per_cpu_s / r.output_tokens_per_cpu_s,
        }
        for r in peers
    ]
    return {
        "workload": workload.name,
        "dtype": weft.details["dtype"],
        "torch_threads": weft.details["torch_threads"],
        "weft": weft.to_dict(),
        "peers": rows,
        "efficiency": efficiency,
        "notes": notes,
    }


def _progress(enabled: bool, line: str) -> None:
    if enabled:
        print(line, flush=True)


def _label(result: BenchResult) -> str:
    if result.backend == "hf":
        return f"hf static (batch {result.details['batch_size']}, {result.num_requests} req)"
    return "hf continuous batching"


def format_compare(report: dict[str, Any]) -> str:
    weft = report["weft"]
    lines = [
        f"workload {report['workload']}: dtype {report['dtype']}, {report['torch_threads']} torch threads",
        f"{'backend':<32}{'time (s)':>10}{'output tok/s':>14}{'weft/peer':>11}"
        f"{'tok/CPU-s':>11}{'weft/peer':>11}",
        f"{'weft (offline LLM)':<32}{weft['elapsed_s']:>10.2f}{weft['output_tokens_per_s']:>14.1f}{'':>11}"
        f"{weft['output_tokens_per_cpu_s']:>11.1f}{'':>11}",
    ]
    for row in report["peers"]:
        lines.append(
            f"{row['label']:<32}{row['elapsed_s']:>10.2f}{row['output_tokens_per_s']:>14.1f}"
            f"{row['weft_over_peer']:>10.2f}x{row['output_tokens_per_cpu_s']:>11.1f}"
            f"{row['weft_over_peer_cpu']:>10.2f}x"
        )
    e = report["efficiency"]
    lines.append(
        f"engine efficiency over {e['steps']} steps: step {e['step_s']:.2f} s, execute_model "
        f"{e['execute_model_s']:.2f} s, pure forward {e['forward_s']:.2f} s -> step/forward "
        f"{e['step_over_forward']:.3f}, execute/forward {e['execute_over_forward']:.3f}; "
        f"in CPU time step {e['step_cpu_s']:.2f} s / forward {e['forward_cpu_s']:.2f} s = "
        f"{e['step_over_forward_cpu']:.3f}"
    )
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)
