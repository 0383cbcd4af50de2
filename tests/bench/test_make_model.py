"""`weft bench make-model`: random-weight GGUFs in real models' shapes, read by the gguf
package, transformers and weft alike; and the HF checkpoint `weft bench peers` makes of one for vLLM.

Small shapes (and one real shape cut to a single layer) keep it quick; the greedy
comparison with transformers starts an engine per file and is slow.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader

from benchmarks.bench import make_model, peer_envs
from benchmarks.bench.cli import main
from protocol import SamplingParams
from services.gguf_plain import PlainArrayReader
from services.model_files import DEFAULT_GGUF, models_dir, resolve
from services.worker.gguf_reader import TensorsReader
from tests.utils import GreedyOracle, gguf_parsed_once

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 16


def _write(out: Path, shape: str, qtype: str = "Q8_0", *extra: str) -> Path:
    assert main(["make-model", "--shape", shape, "--qtype", qtype, "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module", autouse=True)
def each_file_parsed_once():
    """transformers parses a file (its 49k tokenizer strings) to prepare its HF folder, to load it,
    and to write the vLLM checkpoint of it: one parse a file, over the module."""
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    """Each tiny shape, written once (Q8_0: the closest of the four to its fp32 values)."""
    folder = tmp_path_factory.mktemp("make-model")
    return {
        shape: _write(folder / f"{shape}.gguf", shape) for shape in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
    }


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


@functools.cache  # once per file
def _load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", make_model.QTYPES)
def test_the_file_has_the_shape_the_types_and_the_default_tokenizer(tmp_path: Path, qtype: str) -> None:
    path = _write(tmp_path / "m.gguf", "tiny-llama", qtype, "--num-layers", "1", "--seed", "3")
    reader = TensorsReader(path)  # the tokenizer's arrays are compared once, below
    shape = make_model.SHAPES["tiny-llama"]
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == 1
    assert _field(reader, "llama.embedding_length") == shape.hidden
    assert _field(reader, "llama.attention.head_count_kv") == shape.kv_heads
    assert _field(reader, "llama.vocab_size") == 49152
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == make_model.K_MIXES.get(qtype, qtype)
    assert list(tensors["blk.0.attn_k.weight"].shape) == [shape.hidden, shape.kv_heads * shape.head_dim]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [shape.intermediate, shape.hidden]
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert "output.weight" in tensors and "blk.1.attn_q.weight" not in tensors  # untied, one layer
    assert not path.with_name("m.gguf.partial").exists()


def test_the_tokenizer_is_the_default_models(tiny_files: dict[str, Path]) -> None:
    # Every field parsed, as the stock reader parses it (tests/worker/test_gguf_reader.py).
    reader = PlainArrayReader(tiny_files["tiny-qwen3"])
    default = PlainArrayReader(models_dir() / DEFAULT_GGUF)
    copied = [k for k in default.fields if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.merges" in copied and "tokenizer.chat_template" in copied
    assert all(_field(reader, k) == _field(default, k) for k in copied)


def test_transformers_loads_each_tiny_shape_with_finite_varied_logits(tiny_files: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve(None).hf_dir)  # every file's tokenizer
    prompts = [torch.tensor([tokenizer(prompt)["input_ids"]]) for prompt in PROMPTS]
    for name, path in tiny_files.items():
        shape = make_model.SHAPES[name]
        model = _load_hf(path)
        config = model.config
        assert (config.model_type, config.hidden_size, config.num_hidden_layers) == (
            shape.architecture,
            shape.hidden,
            shape.layers,
        )
        assert (config.intermediate_size, config.num_attention_heads, config.num_key_value_heads) == (
            shape.intermediate,
            shape.heads,
            shape.kv_heads,
        )
        assert config.tie_word_embeddings == shape.tied and config.vocab_size == 49152
        attention = model.model.layers[0].self_attn
        assert attention.q_proj.weight.shape == (shape.heads * shape.head_dim, shape.hidden)
        assert (attention.q_proj.bias is not None) == shape.qkv_bias
        assert hasattr(attention, "q_norm") == shape.qk_norm
        last = []
        for ids in prompts:
            with torch.inference_mode():
                logits = model(ids).logits[0, -1]
            assert torch.isfinite(logits).all(), name
            assert 0.3 < float(logits.std()) < 10, name  # neither flat nor blown up
            last.append(int(logits.argmax()))
        assert len(set(last)) > 1, f"{name}: every prompt gives the same next token"


def test_a_real_shape_cut_to_one_layer(tmp_path: Path) -> None:
    """qwen3-4b: 128-wide heads over a 2,560 hidden size, per-head Q/K norms, tied embeddings."""
    path = _write(tmp_path / "q.gguf", "qwen3-4b", "Q4_0", "--num-layers", "1")
    shape = make_model.SHAPES["qwen3-4b"]
    reader = TensorsReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors["blk.0.attn_q.weight"].shape) == [2560, 32 * 128]
    assert list(tensors["blk.0.attn_k_norm.weight"].shape) == [128]
    assert list(tensors["token_embd.weight"].shape) == [2560, 49152] and "output.weight" not in tensors
    assert _field(reader, "qwen3.attention.key_length") == 128
    assert _field(reader, "qwen3.rope.freq_base") == shape.rope_theta
    assert _field(reader, "qwen3.context_length") == shape.context_length
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert (config.hidden_size, config.head_dim, config.num_hidden_layers) == (2560, 128, 1)
    assert (config.intermediate_size, config.num_key_value_heads) == (9728, 8)


def test_the_seed_decides_the_weights_and_layers_do_not_depend_on_each_other(tmp_path: Path) -> None:
    def weights(path: Path) -> dict[str, np.ndarray]:
        return {t.name: np.array(t.data) for t in TensorsReader(path).tensors}

    one = weights(_write(tmp_path / "a.gguf", "tiny-qwen2", "Q4_1", "--num-layers", "1"))
    two = weights(_write(tmp_path / "b.gguf", "tiny-qwen2", "Q4_1"))
    other = weights(_write(tmp_path / "c.gguf", "tiny-qwen2", "Q4_1", "--num-layers", "1", "--seed", "1"))
    assert all(np.array_equal(one[name], two[name]) for name in one)
    assert not any(np.array_equal(one[name], other[name]) for name in one)


@pytest.mark.parametrize("qtype, base", [("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K")])
def test_a_k_quant_mix_gives_q6_k_where_llama_cpp_does(tmp_path: Path, qtype: str, base: str) -> None:
    """Eight layers: Q6_K attn_v and ffn_down in layers 0 and 7 (the first and last eighth) and 3 and 6
    (every third between); the output head Q6_K, or the token embedding when the model ties them."""
    more_bits = {0, 3, 6, 7}
    for shape, tied in (("tiny-llama", False), ("tiny-qwen2", True)):
        path = _write(tmp_path / f"{shape}.gguf", shape, qtype, "--num-layers", "8")
        types = {t.name: t.tensor_type.name for t in TensorsReader(path).tensors}
        assert _field(TensorsReader(path), "general.file_type") == int(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
        for layer in range(8):
            wide = "Q6_K" if layer in more_bits else base
            assert types[f"blk.{layer}.attn_v.weight"] == types[f"blk.{layer}.ffn_down.weight"] == wide
            assert {types[f"blk.{layer}.{part}.weight"] for part in ("attn_q", "attn_k", "ffn_up")} == {base}
        assert types["token_embd.weight"] == ("Q6_K" if tied else base)
        assert types.get("output.weight", "Q6_K") == "Q6_K" and ("output.weight" in types) != tied
        assert types["blk.0.attn_norm.weight"] == "F32"


@pytest.mark.parametrize(
    "argv, why",
    [
        (
            ["--shape", "llama-9b", "--qtype", "Q4_0"],
            "invalid choice: 'llama-9b' (choose from 'llama-3.2-1b'",
        ),
        (
            ["--shape", "tiny-llama", "--qtype", "Q3_K_M"],
            "invalid choice: 'Q3_K_M' (choose from 'Q4_0', 'Q4_1'",
        ),
        (
            ["--shape", "tiny-llama", "--qtype", "Q4_0", "--num-layers", "0"],
            "--num-layers must be at least 1",
        ),
        (["--shape", "tiny-llama", "--qtype", "Q4_0", "--seed", "-1"], "--seed must be in"),
    ],
)
def test_bad_input_is_refused(
    tmp_path: Path, argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["make-model", *argv, "--out", str(tmp_path / "m.gguf")])
    assert exit_info.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


def test_an_existing_file_needs_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["make-model", "--shape", "tiny-llama", "--qtype", "Q8_0", "--out", str(out)])
    assert exit_info.value.code == 2 and "exists: pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"mine"
    _write(out, "tiny-llama", "Q8_0", "--num-layers", "1", "--force")
    assert TensorsReader(out).fields["llama.block_count"].contents() == 1


def test_help_names_the_shapes_and_the_k_quant_mixes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["make-model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "llama-3.1-8b: llama, hidden 4096, 32 layers, MLP 14336, 32/8 heads of 128, untied" in text
    assert "rope scaling is left out" in text and "Q4_K_M and Q5_K_M are llama.cpp's mixes" in text
    assert "(default 0)" in text


def test_the_vllm_checkpoint_is_the_same_model(
    tiny_files: dict[str, Path], tmp_path: Path, monkeypatch
) -> None:
    """`weft bench peers` gives vLLM an HF checkpoint written from the GGUF: transformers computes the
    same logits from it as from the GGUF, sharded or not, and bf16 where asked."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(peer_envs, "PEERS_DIR", tmp_path)
    # The checkpoint's config and tokenizer come from the GGUF as transformers reads it (once a file:
    # each_file_parsed_once).
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    for name in ("tiny-llama", "tiny-qwen3"):
        path = tiny_files[name]
        sharded = peer_envs.hf_checkpoint(path, "float32", shard_bytes=2**24, log=lambda _: None)
        assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
        assert (sharded / "model.safetensors.index.json").exists() and (sharded / "tokenizer.json").exists()
        model = AutoModelForCausalLM.from_pretrained(sharded).eval()
        with torch.inference_mode():
            assert torch.equal(model(ids).logits, _load_hf(path)(ids).logits), name
    # The cast and the single file do not depend on the architecture: one shape's.
    bf16 = peer_envs.hf_checkpoint(tiny_files["tiny-llama"], "bfloat16", log=lambda _: None)
    assert [p.name for p in bf16.glob("*.safetensors")] == ["model.safetensors"]
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16
    logged: list[str] = []
    again = peer_envs.hf_checkpoint(tiny_files["tiny-llama"], "bfloat16", log=logged.append)
    assert again == tmp_path / "checkpoints" / "tiny-llama-bfloat16" and not logged  # reused


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_weft_greedy_matches_transformers(tiny_files: dict[str, Path], shape: str) -> None:
    """weft (dequantized, fp32) and transformers read the file as the same model: the same greedy tokens."""
    from transformers import AutoTokenizer

    from services import LLM

    path = tiny_files[shape]
    tokenizer = AutoTokenizer.from_pretrained(resolve(str(path)).hf_dir)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    oracle = GreedyOracle(_load_hf(path), eos=-1)  # random weights: run to the length limit
    llm = LLM(model=str(path), dtype="float32", quantization="none", max_model_len=256)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        oracle.check(prompt, list(output.outputs[0].token_ids), NEW_TOKENS, f"{shape}: {prompt}")
