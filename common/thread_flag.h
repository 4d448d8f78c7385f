// A thread's switch set for a scope: ThreadFlagScope sets a thread_local flag for its lifetime, then
// restores the value before it, so scopes nest. The switches the engine turns on while it captures a step
// (common/cuda/launch.h's dependent launch, model/tuned_gemm.h's tuned GEMMs) are such flags.
#pragma once

namespace rlt {

class ThreadFlagScope {
 public:
  ThreadFlagScope(bool& flag, bool on) : flag_(flag), before_(flag) { flag_ = on; }
  ~ThreadFlagScope() { flag_ = before_; }
  ThreadFlagScope(const ThreadFlagScope&) = delete;
  ThreadFlagScope& operator=(const ThreadFlagScope&) = delete;

 private:
  bool& flag_;
  bool before_;
};

}  // namespace rlt
