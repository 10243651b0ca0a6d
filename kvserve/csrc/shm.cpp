// Tensor parallelism on one machine: all-reduce through a shared-memory segment (kvserve/distributed/comm.py), in
// microseconds where a gloo all-reduce over TCP costs about a millisecond on a small machine.
//
//   segment: | header: per rank its arrival counter (own cache line), abort flag | data: [2][ranks][chunk bytes] |
//
// Each chunk of the tensor: a rank copies its values into its slot of buffer (seq & 1), publishes seq, waits until
// every rank has published seq, then sums the slots in rank order (float32, rounded once for bf16): every rank
// gets the same bits. Slots alternate between two buffers: a rank writes buffer (seq & 1) only after every rank
// published seq - 1, which each did after reading its sums of seq - 2, the last use of that buffer.
#include "common.h"
#include <sched.h>
#include <time.h>

extern "C" {

struct alignas(64) ShmCounter { std::atomic<int64_t> seq; char pad[56]; };
constexpr int64_t SHM_MAX_RANKS = 62, SHM_HEADER = 64 * 64;

static double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// base: the segment; *seq: this rank's count of chunks so far (its own memory); dtype 0: float32, 1: bf16.
// Returns 0, 1 when another rank set the abort flag (it died), 2 after timeout_s without every rank arriving.
int kvserve_shm_all_reduce(char* base, int64_t rank, int64_t size, int64_t chunk_bytes, int64_t* seq, void* data,
                           int64_t numel, int64_t dtype, double timeout_s) {
  auto* counters = reinterpret_cast<ShmCounter*>(base);
  auto* abort_flag = reinterpret_cast<std::atomic<int32_t>*>(base + SHM_MAX_RANKS * 64);
  const int64_t elem = dtype == 1 ? 2 : 4, per_chunk = chunk_bytes / elem;
  char* buffers = base + SHM_HEADER;
  for (int64_t off = 0; off < numel; off += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - off);
    const int64_t s = ++*seq;
    char* buf = buffers + (s & 1) * size * chunk_bytes;
    std::memcpy(buf + rank * chunk_bytes, static_cast<char*>(data) + off * elem, n * elem);
    counters[rank].seq.store(s, std::memory_order_release);
    double start = 0;
    for (int64_t r = 0; r < size; ++r) {
      for (int64_t spins = 0; counters[r].seq.load(std::memory_order_acquire) < s; ++spins) {
        if (abort_flag->load(std::memory_order_relaxed)) return 1;
        if (spins < 4096) continue;
        sched_yield();   // the other ranks may share this core
        if ((spins & 255) == 0) {
          if (start == 0) start = now_s();
          else if (now_s() - start > timeout_s) return 2;
        }
      }
    }
    if (dtype == 1) {
      uint16_t* out = static_cast<uint16_t*>(data) + off;
      for (int64_t i = 0; i < n; ++i) {
        float acc = bf16_to_f32(reinterpret_cast<uint16_t*>(buf)[i]);
        for (int64_t r = 1; r < size; ++r) acc += bf16_to_f32(reinterpret_cast<uint16_t*>(buf + r * chunk_bytes)[i]);
        out[i] = f32_to_bf16(acc);
      }
    } else {
      float* out = static_cast<float*>(data) + off;
      for (int64_t i = 0; i < n; ++i) {
        float acc = reinterpret_cast<float*>(buf)[i];
        for (int64_t r = 1; r < size; ++r) acc += reinterpret_cast<float*>(buf + r * chunk_bytes)[i];
        out[i] = acc;
      }
    }
  }
  return 0;
}

void kvserve_shm_abort(char* base) {
  reinterpret_cast<std::atomic<int32_t>*>(base + SHM_MAX_RANKS * 64)->store(1, std::memory_order_relaxed);
}

}
