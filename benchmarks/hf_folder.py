"""A model as a Hugging Face folder, for peers that read only folders (vLLM).

A folder is used as it is. A GGUF file (the default model is one) is read by
transformers' GGUF loader, dequantized to float32, and written once with its
tokenizer to ~/.cache/shoal/hf/<file stem>-<sha256 prefix>/: a peer then
multiplies the same numbers shoal's float32 path does, and the same text
tokenizes to the same ids.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

DONE = ".shoal-hf-folder"  # written last: a folder without it is a partial one


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "shoal", "hf")


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def folder_for(gguf_path: str, root: str | None = None) -> str:
    """Where the folder of this GGUF file lives: named by the file's content, so a changed file gets a new one."""
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(root or cache_root(), f"{stem}-{_digest(gguf_path)}")


def write_hf_folder(gguf_path: str, target: str) -> str:
    """The GGUF file's model (float32) and tokenizer, written to `target`
    through a temporary sibling renamed at the end, so two writers at once
    each leave a whole folder and a reader never sees a partial one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.")
    try:
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        # Its weights are plain float32 tensors by now; transformers only keeps the GGUF "quantizer" as a
        # marker, and refuses to save a model that has one.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tmp)
        open(os.path.join(tmp, DONE), "w").close()
        try:
            os.rename(tmp, target)
        except OSError:  # another writer finished first: theirs is as good
            if not os.path.exists(os.path.join(target, DONE)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def hf_folder(model: str | None, root: str | None = None) -> str:
    """The model (a --model value: a folder, a .gguf file, a packaged name
    or None for the default) as an HF folder, written on first use."""
    from shoal.workers.model_executor.loader.model_loader import resolve_model

    path = resolve_model(model)
    if os.path.isdir(path):
        return path
    target = folder_for(path, root)
    if os.path.exists(os.path.join(target, DONE)):
        return target
    logger.info("writing %s as a Hugging Face folder (float32) to %s", path, target)
    print(f"writing {path} as a Hugging Face folder (float32) to {target}", flush=True)
    return write_hf_folder(path, target)
