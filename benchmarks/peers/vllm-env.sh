# Source before running vLLM's CPU build by hand: `source benchmarks/peers/vllm-env.sh`.
# benchmarks/compare.py sets the same variables itself (VLLM_ENV).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}          # GiB of KV cache (its default takes 90% of RAM)
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}  # all cores (its default leaves one idle)
export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}             # its AOT cache does not reload with torch 2.13
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
