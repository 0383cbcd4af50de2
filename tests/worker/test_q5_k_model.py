"""A model file whose matrices are all Q5_K (the int5 layout), kept packed, against its dequantized run.

The file is ``weft bench make-model``'s tiny Llama (random weights, the default
tokenizer) written as Q5_K. Loaded with the defaults, every matrix (the
embedding too) must stay packed in the int5 layout, with the resident weights
within 1.15x the file's tensor bytes (about 1.02x: Q5_K's 6-bit sc and m a
byte each). Its logits must be the dequantized model's up to the order of fp32
sums under fp32 activations, and its greedy tokens the dequantized model's:
exactly under fp32 activations, and under the default int8 ones up to
divergences at near-ties of the dequantized model's top two tokens, the bound
``tests/worker/test_quantized_model.py`` holds the default model to.
"""

from __future__ import annotations

import pytest
import torch

from services.config.engine_args import EngineArgs
from services.model_files import resolve
from services.worker.gguf_weights import GGUFCheckpoint
from services.worker.model_loader import load_model, weight_bytes
from tests.utils import gguf_parsed_once

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
NEAR_TIE = 0.2  # nats: int8 activations' bound in test_quantized_model.AGREEMENT
PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],
    [28, 9203, 77, 1500, 42, 42, 7, 30000, 19],
    [2, 3, 5, 7, 11, 13, 17],
]


@pytest.fixture(scope="module")
def q5_k_file(tmp_path_factory):
    from benchmarks.bench.make_model import write_model

    path = tmp_path_factory.mktemp("q5k") / "tiny-llama-q5_k.gguf"
    with gguf_parsed_once():
        write_model("tiny-llama", "Q5_K", path, log=lambda *args: None)
        resolve(str(path))
    return path


@pytest.fixture(scope="module")
def models(q5_k_file):
    """The packed model (the defaults) and the dequantized one (``--quantization none``), fp32."""
    torch.set_num_threads(1)
    packed = load_model(EngineArgs(model=str(q5_k_file), dtype="float32").create_engine_config().model)
    none = EngineArgs(model=str(q5_k_file), dtype="float32", quantization="none")
    return packed, load_model(none.create_engine_config().model)


@pytest.fixture
def activations(monkeypatch):
    """Sets the packed layers' activations for the test (a fresh kernel choice, restored after)."""
    from services.worker.layers import quantized_linear

    def choose(setting: str) -> None:
        monkeypatch.setenv("WEFT_QUANT_ACTIVATIONS", setting)
        monkeypatch.setattr(quantized_linear, "_KERNEL", quantized_linear._Kernel())

    return choose


def test_every_matrix_stays_packed_as_int5_at_about_the_files_size(q5_k_file, models):
    packed, _ = models
    quantized = [m for m in packed.modules() if getattr(m, "quant", None) is not None]
    assert len(quantized) == 2 * 4 + 2  # qkv, o, gate_up and down a layer; the embedding and the head
    for module in quantized:
        assert all(p.qhigh is not None and p.source_format == "Q5_K" for p in module.quant.parts)
        assert module.weight is None  # no dense copy
    loaded = weight_bytes(packed)
    assert loaded.total <= 1.15 * GGUFCheckpoint(q5_k_file).tensor_bytes, loaded.describe()


def greedy(model, run_dense, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """NEW_TOKENS greedy tokens, each from a prefill of the whole sequence; and each step's logits."""
    tokens, logits = list(prompt), []
    for _ in range(NEW_TOKENS):
        last = run_dense(model, tokens)[-1]
        logits.append(last)
        tokens.append(int(last.argmax()))
    return tokens[len(prompt) :], logits


def test_fp32_activations_give_the_dequantized_logits_and_tokens(models, run_dense, activations):
    packed, dense = models
    activations("fp32")
    for prompt in PROMPTS:
        expected = run_dense(dense, prompt)
        torch.testing.assert_close(
            run_dense(packed, prompt), expected, rtol=0, atol=1e-4 * float(expected.abs().max())
        )
        assert greedy(packed, run_dense, prompt)[0] == greedy(dense, run_dense, prompt)[0]


def test_int8_activations_diverge_only_at_near_ties(models, run_dense, activations):
    packed, dense = models
    activations("int8")
    for prompt in PROMPTS:
        got = greedy(packed, run_dense, prompt)[0]
        want, logits = greedy(dense, run_dense, prompt)
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if at is None:
            continue
        logprobs = logits[at].log_softmax(-1)
        top2 = logprobs.topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, f"diverged at token {at} of {prompt}"
        assert got[at] in logprobs.topk(2).indices.tolist()
