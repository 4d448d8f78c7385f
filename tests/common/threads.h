// ATen's intra-op threads pinned for a test's scope: a CPU figure that depends on how many threads split
// an operation (a reduction's last bit, the kernels' per-thread scratch) is measured on one, as ctest runs
// every test (OMP_NUM_THREADS=1), whatever the host's cores.
#pragma once

#include <ATen/Parallel.h>

namespace rlt::testing {

// Sets the calling thread's intra-op thread count to `n` for the object's lifetime, then restores it. With
// OpenMP the count is per calling thread: each thread that computes pins its own.
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int n) : before_(at::get_num_threads()) { at::set_num_threads(n); }
  ~IntraOpThreads() { at::set_num_threads(before_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int before_;
};

}  // namespace rlt::testing
