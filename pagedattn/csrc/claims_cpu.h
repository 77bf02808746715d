// Work split across the intra-op threads by claims: each thread takes the next few items from a
// shared counter until none is left, so a thread that runs slower (a busy core, a VM's vCPU
// whose host is loaded) simply takes fewer items and the threads finish together. An equal split
// made up front waits for the slowest thread.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagedattn_claims {

class Claims {
 public:
  // n items, claimed up to max_claim at a time (fewer where n is small: about 4 claims per
  // thread at least, so that the last ones are short). Items below `first` are not handed out
  // (the caller has given them to threads already).
  Claims(int64_t n, int64_t max_claim, int64_t first = 0)
      : n_(n),
        threads_(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n))),
        claim_(std::clamp<int64_t>(n / (4 * threads_), 1, std::max<int64_t>(1, max_claim))),
        next_(first) {}

  // The calling thread's next items [begin, end); false once all are taken.
  bool next(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(claim_, std::memory_order_relaxed);
    if (begin >= n_) return false;
    end = std::min(begin + claim_, n_);
    return true;
  }

  // fn(*this) once on each thread that takes part (at most one per item).
  template <typename Fn>
  void run(const Fn& fn) {
    run_slots([&](Claims& claims, int64_t, int64_t) { fn(claims); });
  }

  // fn(*this, begin, end) once on each thread that takes part, with the thread slots [begin,
  // end) in [0, threads()) that it stands for: one slot, its intra-op thread number, when the
  // threads run in parallel; all of them when at::parallel_for runs inline.
  template <typename Fn>
  void run_slots(const Fn& fn) {
    if (n_ <= 0) return;
    at::parallel_for(0, threads_, 1, [&](int64_t begin, int64_t end) { fn(*this, begin, end); });
  }

  int64_t threads() const { return threads_; }

 private:
  const int64_t n_, threads_, claim_;
  std::atomic<int64_t> next_;
};

}  // namespace pagedattn_claims
