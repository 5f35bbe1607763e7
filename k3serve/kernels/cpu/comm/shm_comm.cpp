// Shared-memory all-reduce / all-gather / reduce-scatter / all-to-all for the ranks of one host.
//
// Gloo over loopback TCP costs ~1.6 ms per small all-reduce on this 2-core VM (measured in
// bench/tp_decode.py's notes), 13-24 of them per decode step; ranks on one host can meet in
// shared memory instead, as vLLM's CPU backend does (csrc/cpu/shm.cpp). Segment layout:
//   [world] lines of 64 bytes (arrival counter, pid) | 2 buffers x world slots x slot_bytes.
// Collective number `seq` (1, 2, ...) uses buffer seq & 1. A rank writes its slot, publishes
// arrival = seq, waits for every rank's arrival >= seq, then reads all slots. Before writing
// buffer seq & 1 it waits for arrivals >= seq - 1: a rank arrives at seq - 1 only after it has
// read seq - 2, the last user of that buffer. Sums run in rank order 0..N-1 with an fp32
// accumulator, so every rank gets the same bits. An all-to-all is a publish whose reads take
// only this rank's rows of each slot: every rank knows the whole [src][dst] row-count matrix.
#include <ATen/ATen.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define K3_PAUSE() _mm_pause()
#else
#define K3_PAUSE() ((void)0)
#endif

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kLine = 64;

std::atomic<int64_t>* arrivals(uint8_t* base, int64_t r) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + r * kLine);
}

std::atomic<int64_t>* pid_of(uint8_t* base, int64_t r) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + r * kLine + 8);
}

bool gone(uint8_t* base, int64_t r) {
  const int64_t pid = pid_of(base, r)->load(std::memory_order_relaxed);
  return pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

uint8_t* slot(uint8_t* base, int64_t world, int64_t slot_bytes, int64_t buf, int64_t r) {
  const int64_t data = ((world * kLine + 4095) / 4096) * 4096;
  return base + data + (buf * world + r) * slot_bytes;
}

// Spin (pause), then yield: with more runnable threads than cores the peer needs this core.
void wait_all(uint8_t* base, int64_t world, int64_t target, double timeout_s) {
  const auto began = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < world; ++r) {
    auto* a = arrivals(base, r);
    for (int64_t spins = 0; a->load(std::memory_order_acquire) < target; ++spins) {
      if (spins < 2000) {
        K3_PAUSE();
        continue;
      }
      sched_yield();
      if ((spins & 1023) == 0) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
        TORCH_CHECK(s < timeout_s, "shared-memory collective ", target, " timed out after ", timeout_s,
                    " s waiting for rank ", r);
        TORCH_CHECK(!gone(base, r), "shared-memory collective ", target, ": rank ", r, " (pid ",
                    pid_of(base, r)->load(), ") is gone");
      }
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& seg, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "shm collectives take contiguous CPU tensors");
  TORCH_CHECK(x.numel() * x.element_size() <= slot_bytes, "tensor of ", x.numel() * x.element_size(),
              " B exceeds the shared-memory slot of ", slot_bytes, " B");
  const int64_t need = ((world * kLine + 4095) / 4096) * 4096 + 2 * world * slot_bytes;
  TORCH_CHECK(seg.numel() >= need, "shared-memory segment too small");
}

// out[i] = sum over ranks of slot element first + i, i < n (rank order, fp32 accumulator)
template <typename T>
void sum_slots(uint8_t* base, int64_t world, int64_t slot_bytes, int64_t buf, int64_t first, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.f;
    for (int64_t r = 0; r < world; ++r)
      acc += static_cast<float>(reinterpret_cast<const T*>(slot(base, world, slot_bytes, buf, r))[first + i]);
    out[i] = static_cast<T>(acc);
  }
}

void sum_slots_into(uint8_t* base, int64_t world, int64_t slot_bytes, int64_t buf, int64_t first, at::Tensor out,
                    const char* what) {
  if (out.scalar_type() == at::kFloat) {
    sum_slots(base, world, slot_bytes, buf, first, out.numel(), out.data_ptr<float>());
  } else if (out.scalar_type() == at::kBFloat16) {
    sum_slots(base, world, slot_bytes, buf, first, out.numel(), out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, what, " takes float32 or bfloat16, got ", out.scalar_type());
  }
}

void publish(uint8_t* base, int64_t rank, int64_t world, int64_t seq, int64_t slot_bytes, const at::Tensor& x,
             double timeout_s) {
  wait_all(base, world, seq - 1, timeout_s);  // every rank is done reading this buffer's last use
  std::memcpy(slot(base, world, slot_bytes, seq & 1, rank), x.data_ptr(), x.numel() * x.element_size());
  arrivals(base, rank)->store(seq, std::memory_order_release);
  wait_all(base, world, seq, timeout_s);
}

}  // namespace

void shm_attach(at::Tensor seg, int64_t rank) {
  pid_of(seg.data_ptr<uint8_t>(), rank)->store(static_cast<int64_t>(getpid()), std::memory_order_release);
}

at::Tensor shm_all_reduce(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                          int64_t slot_bytes, double timeout_s) {
  check(x, seg, world, slot_bytes);
  uint8_t* base = seg.data_ptr<uint8_t>();
  publish(base, rank, world, seq, slot_bytes, x, timeout_s);
  sum_slots_into(base, world, slot_bytes, seq & 1, 0, x, "shm_all_reduce");
  return x;
}

at::Tensor shm_all_gather(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                          int64_t slot_bytes, double timeout_s) {
  check(x, seg, world, slot_bytes);
  uint8_t* base = seg.data_ptr<uint8_t>();
  publish(base, rank, world, seq, slot_bytes, x, timeout_s);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.insert(shape.begin(), world);
  at::Tensor out = at::empty(shape, x.options());  // [world, ...x]
  const int64_t nbytes = x.numel() * x.element_size();
  for (int64_t r = 0; r < world; ++r)
    std::memcpy(static_cast<uint8_t*>(out.data_ptr()) + r * nbytes, slot(base, world, slot_bytes, seq & 1, r), nbytes);
  return out;
}

at::Tensor shm_reduce_scatter(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                              int64_t slot_bytes, double timeout_s) {
  check(x, seg, world, slot_bytes);
  TORCH_CHECK(x.dim() >= 1 && x.size(0) % world == 0, "shm_reduce_scatter: dim 0 of ", x.sizes(),
              " is not divisible by the ", world, " ranks");
  uint8_t* base = seg.data_ptr<uint8_t>();
  publish(base, rank, world, seq, slot_bytes, x, timeout_s);
  at::Tensor out = at::empty_like(x.narrow(0, 0, x.size(0) / world));  // [n / world, ...]: this rank's chunk
  sum_slots_into(base, world, slot_bytes, seq & 1, rank * out.numel(), out, "shm_reduce_scatter");
  return out;
}

at::Tensor shm_all_to_all(at::Tensor x, at::Tensor seg, int64_t rank, int64_t world, int64_t seq,
                          int64_t slot_bytes, double timeout_s, std::vector<int64_t> counts) {
  // x [rows, ...]: this rank's rows, grouped by destination rank in order; counts [world * world]:
  // row r * world + d = rows rank r sends to rank d. Returns [rows received, ...] in source order.
  check(x, seg, world, slot_bytes);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == world * world, "shm_all_to_all: ", counts.size(),
              " counts for ", world, " ranks");
  TORCH_CHECK(x.dim() >= 1, "shm_all_to_all takes rows");
  int64_t mine = 0, received = 0;
  for (int64_t d = 0; d < world; ++d) mine += counts[rank * world + d];
  for (int64_t r = 0; r < world; ++r) received += counts[r * world + rank];
  TORCH_CHECK(mine == x.size(0), "shm_all_to_all: ", x.size(0), " rows, but the counts send ", mine);
  int64_t row_bytes = x.element_size();  // every rank's rows have this rank's width (the caller's contract)
  for (int64_t i = 1; i < x.dim(); ++i) row_bytes *= x.size(i);
  uint8_t* base = seg.data_ptr<uint8_t>();
  publish(base, rank, world, seq, slot_bytes, x, timeout_s);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] = received;
  at::Tensor out = at::empty(shape, x.options());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t r = 0; r < world; ++r) {
    int64_t before = 0;  // rows rank r sends to ranks below this one: where this rank's rows start
    for (int64_t d = 0; d < rank; ++d) before += counts[r * world + d];
    const int64_t take = counts[r * world + rank];
    TORCH_CHECK((before + take) * row_bytes <= slot_bytes, "shm_all_to_all: rank ", r, "'s rows exceed the slot");
    std::memcpy(dst, slot(base, world, slot_bytes, seq & 1, r) + before * row_bytes, take * row_bytes);
    dst += take * row_bytes;
  }
  return out;
}
