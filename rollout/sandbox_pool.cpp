// SandboxPool: worker threads that run calls at once, each keeping its next sandbox started (a spare)
// so a call skips the interpreter's start-up. Launching and supervising each sandbox is
// sandbox_spawn.cpp's and sandbox_supervise.cpp's.
#include "rollout/sandbox_internal.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace rlt::sandbox {

namespace {

// Prestarted interpreters (SandboxOptions::prestart): a pool worker launches its next sandbox before the
// call arrives, so the interpreter's start-up (tens of milliseconds with site-packages) overlaps the wait;
// the call writes its script into the waiting interpreter's stdin and is supervised as any call, its wall
// clock and timeout counted from there.
struct Spare {
  std::unique_ptr<Launched> launched;
  Interpreter in;  // what it was launched with
  int level = 0;
};

// Still waiting for its script: no report of C's end or of a failure, and B's status pipe still open.
bool spare_alive(Launched& l) {
  for (;;) {
    if (l.f.status_r.fd < 0 || l.w.done || l.w.failed) return false;
    pollfd p{l.f.status_r.fd, POLLIN, 0};
    if (poll(&p, 1, 0) != 1) return true;
    if (read_reports(l.f.status_r, l.w)) return false;  // EOF: B is gone
  }
}

// Writes the whole script and ends the interpreter's stdin. False when the interpreter stopped reading
// (it died, or its socket stayed full for timeout_s).
bool deliver(Launched& l, const std::string& code, double timeout_s) {
  Fd& fd = l.f.code_p;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_s);
  tv.tv_usec = static_cast<suseconds_t>((timeout_s - std::floor(timeout_s)) * 1e6);
  setsockopt(fd.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  for (size_t done = 0; done < code.size();) {
    const ssize_t n = send(fd.fd, code.data() + done, code.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  fd.reset();  // end of file for the interpreter
  return true;
}

// A spare, or none when launching one failed (the call then starts cold and reports the error itself).
Spare launch_spare(const SandboxOptions& o) {
  Spare s;
  try {
    s.in = interpreter_for(o);
    s.level = first_level(o);
    s.launched = launch(nullptr, o, s.in, kLevels[s.level]);
  } catch (const std::exception&) {
    s.launched.reset();
  }
  return s;
}

// Ends an unused spare: its interpreter reads an empty script and exits, and everything is torn down as
// after a call. A refused level is noted for the calls after it.
void discard_spare(Spare& s, const SandboxOptions& o) {
  if (!s.launched) return;
  s.launched->f.code_p.reset();
  SandboxOptions brief = o;
  brief.timeout_s = std::min(o.timeout_s, 5.0);
  SandboxResult ignored;
  try {
    if (!finish(*s.launched, brief, s.in, Clock::now(), ignored)) level_refused(s.level);
  } catch (const std::exception&) {
  }
  s.launched.reset();
}

// The call in the spare when it still waits for its script; in a fresh sandbox otherwise. The spare is
// used up either way (the worker launches the next), also when the call throws.
SandboxResult run_in_spare(Spare& s, const std::string& code, const SandboxOptions& o) {
  Spare spare = std::move(s);
  if (spare.launched && spare_alive(*spare.launched)) {
    const auto t0 = Clock::now();
    if (deliver(*spare.launched, code, o.timeout_s)) {
      SandboxResult r;
      if (finish(*spare.launched, o, spare.in, t0, r)) return r;
      level_refused(spare.level);
      return run_levels(code, o, spare.in);
    }
  }
  discard_spare(spare, o);
  return run_levels(code, o, interpreter_for(o));
}

}  // namespace

}  // namespace rlt::sandbox

namespace rlt {

struct SandboxPool::Impl {
  SandboxOptions options;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::string, std::promise<SandboxResult>>> queue;
  bool stopping = false;
  std::vector<std::thread> threads;

  void work() {
    sandbox::Spare spare;  // with options.prestart: this worker's next sandbox, its interpreter waiting for a script
    for (;;) {
      std::pair<std::string, std::promise<SandboxResult>> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        if (options.prestart && !spare.launched && !stopping) {
          lock.unlock();
          spare = sandbox::launch_spare(options);
          lock.lock();
        }
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) break;
        job = std::move(queue.front());
        queue.pop_front();
      }
      try {
        job.second.set_value(options.prestart ? sandbox::run_in_spare(spare, job.first, options)
                                              : run_python(job.first, options));
      } catch (...) {
        job.second.set_exception(std::current_exception());
      }
    }
    sandbox::discard_spare(spare, options);
  }
};

SandboxPool::SandboxPool(SandboxOptions o) : impl_(std::make_unique<Impl>()) {
  sandbox::validate(o);
  impl_->options = std::move(o);
  for (int64_t i = 0; i < impl_->options.workers; ++i) impl_->threads.emplace_back([this] { impl_->work(); });
}

SandboxPool::~SandboxPool() {
  std::deque<std::pair<std::string, std::promise<SandboxResult>>> cancelled;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
    cancelled.swap(impl_->queue);
  }
  impl_->cv.notify_all();
  for (auto& job : cancelled) {
    job.second.set_exception(std::make_exception_ptr(SandboxError("SandboxPool destroyed before the call ran")));
  }
  for (auto& t : impl_->threads) t.join();
}

std::future<SandboxResult> SandboxPool::submit(std::string code) {
  std::promise<SandboxResult> promise;
  std::future<SandboxResult> future = promise.get_future();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->stopping) throw SandboxError("SandboxPool::submit after destruction began");
    impl_->queue.emplace_back(std::move(code), std::move(promise));
  }
  impl_->cv.notify_one();
  return future;
}

}  // namespace rlt
