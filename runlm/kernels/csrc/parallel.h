// One parallel_for for the kernels' shared code (the *_impl.h headers): at::parallel_for when they are
// built into a torch extension (torch owns the thread pool and its size), runlm's own spinning workers
// (Pool, below) when they are built into runlm's torch-free library (csrc/native_abi.cpp).
//
// Both split [begin, end) the same way: at most `threads` contiguous chunks of at least `grain`
// items each, one per thread (fewer items than grain, one thread, or a call from inside a parallel
// call: the calling thread does it all). The kernels' results never depend on how the range is cut;
// the same cut only keeps the two builds' work per thread alike.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#ifdef TORCH_EXTENSION_NAME
#include <ATen/Parallel.h>
#else
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>
#endif

namespace runlm {

#ifdef TORCH_EXTENSION_NAME

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

inline int64_t max_threads() { return at::get_num_threads(); }

#else

// The library's thread count: one process-wide value (omp_set_num_threads only sets the calling
// thread's, and the runner may call from any thread). 0 until set: OpenMP's default then.
inline std::atomic<int> g_threads{0};

inline int threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_max_threads();
}

// The library's own workers, instead of an OpenMP region per call: a decode step is ~6 parallel calls a
// layer, microseconds apart, and OpenMP's workers under OMP_WAIT_POLICY=PASSIVE (or after their spin
// count) sleep between them, so every call paid a futex wake-up per thread (1.5B Q4_K_M, 2 threads: 18.4
// tok/s PASSIVE, 24.6 ACTIVE). These workers spin for kSpinNs after each call, where the next call of the
// step finds them, then sleep on a condition variable until the next step (the caller wakes them).
// The caller is worker 0. One call at a time: a call from another thread meanwhile, or from inside a
// call, runs on its own thread (results never depend on the split).
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may still wait on it at exit
    return *pool;
  }

  // f(b, e) for `tasks` contiguous chunks of [begin, end); false (nothing run) when the pool is busy.
  template <class F>
  bool run(int64_t begin, int64_t end, int tasks, const F& f) {
    if (in_call_ || !busy_.try_lock()) return false;
    std::lock_guard<std::mutex> hold(busy_, std::adopt_lock);
    grow(tasks - 1);
    const int64_t chunk = (end - begin + tasks - 1) / tasks;
    job_ = Job{&call<F>, &f, begin, end, chunk};
    pending_.store(tasks - 1, std::memory_order_relaxed);
    // the task count rides in the generation word, so that workers without a chunk never read job_
    const uint64_t g = generation_.load(std::memory_order_relaxed);  // (only a call holding busy_ writes it)
    generation_.store(((g & ~kTaskMask) + kGenerationStep) | static_cast<uint64_t>(tasks), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    in_call_ = true;
    f(begin, std::min(end, begin + chunk));
    in_call_ = false;
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
    return true;
  }

 private:
  static constexpr uint64_t kTaskMask = 0xFFFF, kGenerationStep = 0x10000;
  static constexpr int64_t kSpinNs = 200000;
  struct Job {
    void (*fn)(const void*, int64_t, int64_t);
    const void* f;
    int64_t begin, end, chunk;
  };
  template <class F>
  static void call(const void* f, int64_t b, int64_t e) {
    (*static_cast<const F*>(f))(b, e);
  }

  Pool() {
    pthread_atfork(nullptr, nullptr, [] {  // a forked child has none of the parent's workers
      Pool& p = get();
      new (&p.busy_) std::mutex();
      new (&p.sleep_) std::mutex();
      new (&p.wake_) std::condition_variable();
      p.workers_ = 0;
      p.sleepers_.store(0);
      p.in_call_ = false;
    });
  }

  void grow(int n) {
    const uint64_t g = generation_.load(std::memory_order_relaxed);  // the generation before the new call's
    for (; workers_ < n; ++workers_) std::thread([this, id = workers_ + 1, g] { work(id, g); }).detach();
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Waits for a generation other than `seen`: spins kSpinNs, then sleeps.
  uint64_t next(uint64_t seen) {
    const uint64_t seen_gen = seen & ~kTaskMask;
    const int64_t until = now_ns() + kSpinNs;
    for (int i = 0;; ++i) {
      const uint64_t g = generation_.load(std::memory_order_acquire);
      if ((g & ~kTaskMask) != seen_gen) return g;
      _mm_pause();
      if ((i & 255) == 255 && now_ns() > until) break;
    }
    std::unique_lock<std::mutex> lock(sleep_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t g;
    wake_.wait(lock, [&] { return ((g = generation_.load(std::memory_order_seq_cst)) & ~kTaskMask) != seen_gen; });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return g;
  }

  void work(int id, uint64_t seen) {
    in_call_ = true;  // (a kernel's own parallel_for inside a chunk runs on this thread)
    for (;;) {
      seen = next(seen);
      if (id >= static_cast<int>(seen & kTaskMask)) continue;
      const Job job = job_;
      const int64_t b = job.begin + id * job.chunk;
      if (b < job.end) job.fn(job.f, b, std::min(job.end, b + job.chunk));
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  Job job_{};
  int workers_ = 0;
  static inline thread_local bool in_call_ = false;
};

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  int64_t tasks = threads();
  if (n < grain || tasks <= 1) {
    f(begin, end);
    return;
  }
  if (grain > 0) tasks = std::min(tasks, (n + grain - 1) / grain);
  if (tasks <= 1 || !Pool::get().run(begin, end, static_cast<int>(std::min<int64_t>(tasks, 1024)), f)) f(begin, end);
}

inline int64_t max_threads() { return threads(); }

#endif

// Pieces per thread that parallel_pieces cuts a range into.
constexpr int64_t kPiecesPerThread = 4;

// f(b, e) over [begin, end) like parallel_for, but in kPiecesPerThread pieces a thread, each taken from a shared
// counter by whichever thread is free: a thread slowed down (a busier core, a vCPU the host takes away for a
// while) takes fewer pieces instead of holding every other thread at the end of the call. On a 2-core AMD EPYC VM
// the decoder's second thread took ~13% longer than the first over equal halves of every matrix (perf). As with
// parallel_for, at least `grain` items a thread, and f's results never depend on which thread ran a piece.
template <class F>
inline void parallel_pieces(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t tasks = std::min(max_threads(), grain > 0 ? (n + grain - 1) / grain : n);
  if (tasks <= 1) {
    f(begin, end);
    return;
  }
  const int64_t pieces = std::min(n, tasks * kPiecesPerThread), size = (n + pieces - 1) / pieces;
  std::atomic<int64_t> next{0};
  parallel_for(0, tasks, 1, [&](int64_t, int64_t) {  // (every call takes pieces until none is left)
    for (int64_t b; (b = begin + size * next.fetch_add(1, std::memory_order_relaxed)) < end;)
      f(b, std::min(end, b + size));
  });
}

}  // namespace runlm
