"""benchmarks/hf_folder.py: a GGUF file written as a Hugging Face folder
(for the vLLM peer) holds the same model: transformers gives bit-identical
logits from the folder and from the file, and the folder's tokenizer gives
shoal's ids."""

from __future__ import annotations

import os

import gguf
import pytest
import torch
from tiny_gguf import write_llama_gguf

from shoal.benchmarks.hf_folder import DONE, folder_for, hf_folder

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_file(tiny_model, tmp_path_factory) -> str:
    # Quantized matrices, so the folder must hold their dequantized values, not the originals.
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return write_llama_gguf(tiny_model, path, {"attn_q": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0})


def test_folder_gives_the_files_logits_and_ids(tiny_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shoal.workers.model_executor.loader.model_loader import load_model_files

    folder = hf_folder(tiny_file, root=str(tmp_path))
    assert folder == folder_for(tiny_file, str(tmp_path)) and os.path.exists(os.path.join(folder, DONE))
    assert "quantization_config" not in open(os.path.join(folder, "config.json")).read()
    d, f = os.path.dirname(tiny_file), os.path.basename(tiny_file)
    ids = torch.tensor([[5, 17, 300, 42, 7, 99, 250, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits
    assert torch.equal(got, want)
    text = "The quick brown fox, 12 13 and def add(a, b)"
    assert AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False) == load_model_files(
        tiny_file
    ).tokenizer.encode(text, add_special_tokens=False)


def test_folder_is_written_once_and_a_folder_is_kept(tiny_file, tmp_path, tiny_model):
    folder = hf_folder(tiny_file, root=str(tmp_path))
    stamp = os.stat(os.path.join(folder, "config.json")).st_mtime_ns
    assert hf_folder(tiny_file, root=str(tmp_path)) == folder
    assert os.stat(os.path.join(folder, "config.json")).st_mtime_ns == stamp  # not rewritten
    assert hf_folder(tiny_model, root=str(tmp_path)) == tiny_model  # already a folder: used as it is
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(folder)]  # no partial folder left beside it
