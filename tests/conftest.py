"""Shared fixtures: the bundled model's path, the fetched Qwen2.5-Coder GGUFs' paths (`make models`), a transformers
reference on the bundled weights, a tiny target and draft model pair with the target's greedy output, and one
`kvserve serve` process for the HTTP tests."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


# the Triton kernels' tests run them on CPU tensors in Triton's interpreter where no GPU is; triton reads this when
# a kernel is defined, so before any test imports kvserve.attention.triton
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import lighten
    lighten()


# the test files that take longest, longest first (pytest --durations=0 summed per file, on an AVX2 CPU):
# make test's two workers take files in the collection's order (the Makefile's --no-loadscope-reorder; xdist would
# put the files with the most tests first), so these start first and no long file starts last while the other
# worker idles. The other files follow in name order
LONGEST_FIRST = ["test_triton_engine.py", "test_engine_equivalence.py", "test_tensor_parallel.py",
                 "test_model_loader.py", "test_data_parallel.py", "test_perplexity.py", "test_triton_attention.py",
                 "test_spec_decode.py", "test_engine_features.py", "test_cli.py", "test_server.py",
                 "test_structured_server.py", "test_structured_outputs.py", "test_quantization.py",
                 "test_kv_transfer.py", "test_gemma.py", "test_fused_layers.py", "test_beam_search.py",
                 "test_spec_draft_model.py", "test_moe.py", "test_pd_proxy.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: each file's own order stays


@pytest.fixture(scope="session")
def gguf_path():
    from kvserve.model import default_model_path
    return default_model_path()


def fetched_model_path(name: str, label: str) -> str:
    """The path of a model `make models` fetched; the test is skipped when it has not been."""
    from kvserve.model.fetch import model_path
    path = model_path(name)
    if path is None:
        pytest.skip(f"{label} GGUF not fetched: run `make models`")
    return str(path)


@pytest.fixture(scope="session")
def qwen_05b_path():
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: a second family and the speculative-decoding draft."""
    return fetched_model_path("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B")


@pytest.fixture(scope="session")
def qwen_15b_path():
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M: a real-size target for the 0.5B draft."""
    return fetched_model_path("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B")


@pytest.fixture(scope="session")
def hf_reference(gguf_path):
    """transformers' own model on the bundled GGUF weights in float32 (transformers_reference.py)."""
    from transformers_reference import load_gguf_reference
    return load_gguf_reference(gguf_path)


@pytest.fixture(scope="session")
def server():
    """A `kvserve serve` process (server_utils.SERVER_FLAGS), shared by every HTTP test module."""
    from server_utils import SERVER_FLAGS, ServerProcess
    srv = ServerProcess(*SERVER_FLAGS)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


@pytest.fixture(scope="session")
def client(server):
    """The official openai client on that server."""
    import openai
    from server_utils import API_KEY
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A random tiny qwen2 target (3 layers, 96 tokens) and a draft model made of its first layer: their paths."""
    from model_utils import save_tiny_model
    from spec_utils import save_first_layer_draft
    root = tmp_path_factory.mktemp("pair")
    save_tiny_model("qwen2", root / "target", num_hidden_layers=3, vocab_size=96)
    save_first_layer_draft(root / "target", root / "draft")
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="session")
def greedy_reference(tiny_pair, gguf_path):
    """tiny_prompts() and the tiny target's greedy output for them (GREEDY_30) without speculation."""
    from spec_utils import GREEDY_30, make_llm, tiny_prompts, tokens
    prompts = tiny_prompts()
    return prompts, tokens(make_llm(model=tiny_pair[0], tokenizer=gguf_path).generate(prompts, GREEDY_30,
                                                                                      use_tqdm=False))
