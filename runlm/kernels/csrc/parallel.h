// One parallel_for for the kernels' shared code (the *_impl.h headers): at::parallel_for when they are
// built into a torch extension (torch owns the thread pool and its size), plain OpenMP when they are
// built into runlm's torch-free library (csrc/native_abi.cpp).
//
// Both split [begin, end) the same way: at most `threads` contiguous chunks of at least `grain`
// items each, one per thread of one parallel region (fewer items than grain, one thread, or a call
// from inside a parallel region: the calling thread does it all). The kernels' results never depend
// on how the range is cut; the same cut only keeps the two builds' work per thread alike.
#pragma once

#include <algorithm>
#include <cstdint>

#ifdef TORCH_EXTENSION_NAME
#include <ATen/Parallel.h>
#else
#include <omp.h>

#include <atomic>
#endif

namespace runlm {

#ifdef TORCH_EXTENSION_NAME

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

#else

// The library's thread count: one process-wide value (omp_set_num_threads only sets the calling
// thread's, and the runner may call from any thread). 0 until set: OpenMP's default then.
inline std::atomic<int> g_threads{0};

inline int threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_max_threads();
}

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  int64_t tasks = threads();
  if (n < grain || tasks <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  if (grain > 0) tasks = std::min(tasks, (n + grain - 1) / grain);
  // one parallel region and its one closing barrier (a worksharing loop would add a second), as ATen's
#pragma omp parallel num_threads(static_cast<int>(tasks))
  {
    const int64_t team = omp_get_num_threads();  // OpenMP may give fewer threads than asked for
    const int64_t chunk = (n + team - 1) / team;
    const int64_t b = begin + omp_get_thread_num() * chunk;
    if (b < end) f(b, std::min(end, b + chunk));
  }
}

#endif

}  // namespace runlm
