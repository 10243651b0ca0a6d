#!/usr/bin/env bash
# Build llama.cpp for the CPU (Release, -march=native) as a peer to measure kvserve against:
# llama-server, llama-bench, llama-cli, llama-perplexity and llama-quantize in $PEERS/llama.cpp-src/build/bin.
#   bash benchmarks/peers/install-llamacpp.sh     # PEERS defaults to ~/peers; ~17 min on 2 cores
#
# The source is the llama.cpp tree vendored (unmodified) in the PyPI sdist llama-cpp-python==0.3.36, which pins
# ggml-org/llama.cpp@0c1e57098 (build b11312, 2026-10-01). LLAMA_GIT_DIR=/path/to/bare/repo takes that commit
# from a git repository instead. Other settings: SRC, BUILD, JOBS (2), DL (where the sdist is downloaded),
# ONLY_SOURCE=1 (lay out the source and stop).
set -euo pipefail
PEERS=${PEERS:-$HOME/peers}
SRC=${SRC:-$PEERS/llama.cpp-src}
BUILD=${BUILD:-$SRC/build}
JOBS=${JOBS:-2}
DL=${DL:-$PEERS/dl}

LLAMA_COMMIT=${LLAMA_COMMIT:-0c1e57098bba43ac29e6e3b677cdceebdd22334f}
if [[ -n "${LLAMA_GIT_DIR:-}" && -z "${LLAMA_BUILD_NUMBER:-}" ]]; then
    LLAMA_BUILD_NUMBER=$(git --git-dir="$LLAMA_GIT_DIR" rev-list --count "$LLAMA_COMMIT")
fi
LLAMA_BUILD_NUMBER=${LLAMA_BUILD_NUMBER:-11312}   # upstream tag b11312 == rev-list --count
SDIST_SPEC=llama-cpp-python==0.3.36
SDIST_NAME=llama_cpp_python-0.3.36

TARGETS=(llama-server llama-bench llama-cli llama-perplexity llama-quantize)

# 1. the source tree
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    mkdir -p "$SRC"
    if [[ -n "${LLAMA_GIT_DIR:-}" ]]; then
        echo ">> exporting $LLAMA_COMMIT from $LLAMA_GIT_DIR"
        # fetched snapshots may lack their largest blobs (the vocab test GGUFs under models/),
        # which makes a plain `git archive` fail: leave them out
        git --git-dir="$LLAMA_GIT_DIR" archive --format=tar "$LLAMA_COMMIT" -- . ':(exclude)models/*.gguf' \
            | tar -x -C "$SRC"
    else
        mkdir -p "$DL"
        if [[ ! -f "$DL/$SDIST_NAME.tar.gz" ]]; then
            echo ">> pip download $SDIST_SPEC (sdist only, no dependencies)"
            python3 -m pip download "$SDIST_SPEC" --no-deps --no-binary :all: -d "$DL"
        fi
        echo ">> extracting vendor/llama.cpp from $DL/$SDIST_NAME.tar.gz"
        tar -xzf "$DL/$SDIST_NAME.tar.gz" -C "$SRC" --strip-components=3 \
            --exclude="$SDIST_NAME/vendor/llama.cpp/.git" \
            "$SDIST_NAME/vendor/llama.cpp"
        # the sdist's changelog names the pinned upstream commit
        tar -xOzf "$DL/$SDIST_NAME.tar.gz" "$SDIST_NAME/CHANGELOG.md" | grep -m1 "ggml-org/llama.cpp@" || true
    fi
    echo "$LLAMA_COMMIT (b$LLAMA_BUILD_NUMBER)" > "$SRC/.source-commit"
fi
if [[ -n "${ONLY_SOURCE:-}" ]]; then
    echo ">> source laid out in $SRC"
    exit 0
fi

# 2. configure
# - GGML_NATIVE=ON: -march=native (AVX-512, VNNI, BF16 where the CPU has them)
# - no tests, app or web UI; the UI assets are neither built with npm nor downloaded
#   (LLAMA_USE_PREBUILT_UI=OFF): the server runs with an empty UI table, its API intact
# - no OpenSSL (no HTTPS model downloads; loopback only)
# - LLAMA_BUILD_COMMIT/NUMBER given explicitly since the tree has no .git
cmake -S "$SRC" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DGGML_CPU=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_COMMIT="${LLAMA_COMMIT:0:9}" \
    -DLLAMA_BUILD_NUMBER="$LLAMA_BUILD_NUMBER"

# 3. build
cmake --build "$BUILD" --config Release -j"$JOBS" --target "${TARGETS[@]}"

ls -la "$BUILD/bin"
"$BUILD/bin/llama-cli" --version 2>&1 | tail -n 3 || true
