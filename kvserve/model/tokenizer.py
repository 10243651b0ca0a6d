"""Tokenizers: an HF directory's own, or the one embedded in a GGUF file (converted once, cached on disk)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.memory import return_freed_memory
from kvserve.model.loader import is_gguf, resolve_model_path


def load_tokenizer(path: str | None, tokenizer_path: str | None = None):
    """The HF tokenizer for a model path (HF dir or .gguf; None = bundled default), or an explicit tokenizer path."""
    source = resolve_model_path(tokenizer_path or path)
    if is_gguf(source):
        return release_build_state(load_gguf_tokenizer(source))
    from transformers import AutoTokenizer
    try:
        return release_build_state(AutoTokenizer.from_pretrained(source, **_declared_config(source)))
    except Exception as e:
        raise ModelLoadError(f"cannot load a tokenizer from {source}: {type(e).__name__}: {e}") from e


def _declared_config(source: str) -> dict:
    """{"config": a plain PretrainedConfig carrying the model's type, name and path} where tokenizer_config.json names
    the tokenizer's class, config.json the model's type, and no remote code is involved: all AutoTokenizer then reads
    of the model's config. Else {}.

    Without it AutoTokenizer loads the model's own config class, which imports transformers' modeling stack (torch's
    distributed tensors, sympy: about 700 modules and 60-95 MiB resident) for nothing."""
    try:
        tokenizer_config = json.loads((Path(source) / "tokenizer_config.json").read_text())
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not (isinstance(tokenizer_config, dict) and isinstance(config, dict)) or "auto_map" in tokenizer_config \
            or "auto_map" in config or not tokenizer_config.get("tokenizer_class") or not config.get("model_type"):
        return {}
    from transformers import PretrainedConfig
    declared = PretrainedConfig(name_or_path=source)   # as AutoConfig sets it
    declared.model_type = config["model_type"]
    if "model_name" in config:
        declared.model_name = config["model_name"]
    return {"config": declared}


# what transformers' fast tokenizers of BPE families (Gemma, Llama, GPT-NeoX, ...) keep after building their Rust
# tokenizer from them, read only in __init__: Python copies of the vocabulary and merges (a 262,144-token
# vocabulary's 514,906 merges take about 200 MB as Python strings and tuples)
_BUILD_STATE = ("_vocab", "_merges")


def release_build_state(tok):
    """Drop the Python vocabulary and merges a fast tokenizer kept from its construction (its Rust tokenizer holds
    them), and hand the freed heap back to the system (glibc's malloc_trim)."""
    if getattr(tok, "_tokenizer", None) is None:
        return tok
    for name in _BUILD_STATE:
        value = getattr(tok, name, None)
        if isinstance(value, (dict, list)) and value:
            setattr(tok, name, type(value)())
    return_freed_memory()
    return tok



def load_gguf_tokenizer(path: str):
    """The HF tokenizer (with chat template) embedded in a GGUF file, converted once and cached on disk."""
    from transformers import AutoTokenizer
    cache = _tokenizer_cache_dir(path)
    if (cache / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:  # a damaged cache entry is rebuilt, never fatal
            shutil.rmtree(cache, ignore_errors=True)
    p = Path(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {type(e).__name__}: {e}") from e
    _save_atomically(tok, cache)
    return tok


def _tokenizer_cache_dir(path: str) -> Path:
    """~/.cache/kvserve/tokenizers/<key>; the key changes with the file and the transformers version."""
    import transformers
    st = os.stat(path)
    ident = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return Path.home() / ".cache" / "kvserve" / "tokenizers" / hashlib.sha256(ident.encode()).hexdigest()[:24]


def _save_atomically(tok, cache: Path) -> None:
    """Save into a temp dir and rename it, so a concurrent reader never sees half a tokenizer."""
    # a read-only home only costs the ~4 s conversion on the next start
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-")
    except OSError:
        return
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, cache)
    except OSError:  # includes losing the rename race to another process: its copy is as good
        shutil.rmtree(tmp, ignore_errors=True)
