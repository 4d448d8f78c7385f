// Watching one launched call to its end: the wall clock and its kills, stdout and stderr up to the cap,
// B's reports, the result and what isolated it, and the move down the levels when the kernel refuses
// one; run_python on top. Starting the call is sandbox_spawn.cpp's.
#include "rollout/sandbox_internal.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <mutex>

namespace rlt::sandbox {

namespace {

// Cuts a trailing incomplete UTF-8 sequence (the cap may split a character).
void trim_partial_utf8(std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    const size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    if (len > back) s.resize(n - back);
    return;
  }
}

// `s` with every byte that is not part of a valid UTF-8 sequence replaced by U+FFFD.
std::string valid_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      len = 1;
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      ok = (d & 0xC0) == 0x80;
      cp = (cp << 6) | (d & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are invalid too.
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    ok = ok && cp >= kMin[len] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += 1;
    }
  }
  return out;
}

void kill_sandbox(pid_t b, bool pidns, const Watch& w) {
  if (pidns) {
    kill(b, SIGKILL);  // init gone: the kernel kills the rest of the namespace
  } else if (w.c_pid > 0 && !w.done) {
    kill(-w.c_pid, SIGKILL);  // C's group; B reaps it, kills the daemons that left it, and reports
  } else {
    kill(b, SIGKILL);
  }
}

// One read of C's stdout or stderr into `text`, kept up to the cap and drained past it; EOF closes `fd`.
void read_stream(Fd& fd, std::string& text, size_t cap, bool& truncated) {
  char buf[65536];
  const ssize_t got = read(fd.fd, buf, sizeof buf);
  if (got < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (got <= 0) {
    fd.reset();
    return;
  }
  const size_t keep = std::min(static_cast<size_t>(got), cap - std::min(cap, text.size()));
  text.append(buf, keep);
  if (keep < static_cast<size_t>(got)) truncated = true;
}

// Read stdout/stderr (kept up to the cap, drained past it) and B's reports until B is gone, killing the
// sandbox at the deadline (and B itself 2 s later). Returns with B reaped, or with nothing left to read.
void supervise(Watch& w, ChildGuard& b, bool pidns, const SandboxOptions& o, Clock::time_point t0, CallFiles& f) {
  const size_t cap = static_cast<size_t>(o.max_output_bytes);
  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.timeout_s));
  auto hard_deadline = Clock::time_point::max(), drain_deadline = Clock::time_point::max();
  struct Stream {
    Fd* fd;
    std::string* text;
  } streams[2] = {{&f.out_r, &w.out}, {&f.err_r, &w.err}};
  for (;;) {
    const auto now = Clock::now();
    if (!w.timed_out && !b.reaped && now >= deadline) {
      w.timed_out = true;
      kill_sandbox(b.pid, pidns, w);
      hard_deadline = now + std::chrono::seconds(2);
    }
    if (w.timed_out && !w.hard_killed && !b.reaped && now >= hard_deadline) {
      w.hard_killed = true;
      kill(b.pid, SIGKILL);
      if (w.c_pid > 0 && !pidns && !w.done) kill(-w.c_pid, SIGKILL);
    }
    if (b.reaped && (now >= drain_deadline || (f.out_r.fd < 0 && f.err_r.fd < 0))) break;
    auto next = b.reaped ? drain_deadline : w.timed_out ? hard_deadline : deadline;
    const long wait_ms =
        std::max<long>(0, std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1);
    pollfd pfds[3];
    int which[3];  // 0, 1: streams[i]; 2: status
    int n = 0;
    for (int i = 0; i < 2; ++i) {
      if (streams[i].fd->fd >= 0) pfds[n] = {streams[i].fd->fd, POLLIN, 0}, which[n++] = i;
    }
    if (f.status_r.fd >= 0) pfds[n] = {f.status_r.fd, POLLIN, 0}, which[n++] = 2;
    if (n == 0) break;
    if (poll(pfds, n, static_cast<int>(std::min<long>(wait_ms, INT_MAX))) < 0) {
      if (errno == EINTR) continue;
      throw SandboxError("poll: " + errno_text(errno));
    }
    for (int i = 0; i < n; ++i) {
      if (pfds[i].revents == 0) continue;
      if (which[i] < 2) {
        read_stream(*streams[which[i]].fd, *streams[which[i]].text, cap, w.truncated);
      } else if (read_reports(f.status_r, w)) {
        while (waitpid(b.pid, &w.b_status, 0) < 0 && errno == EINTR) {
        }
        b.reaped = true;
        // In a pid namespace every writer is dead once init is reaped; without one, a process that slipped
        // out may still hold the pipes: give them a moment, then stop reading.
        drain_deadline = Clock::now() + std::chrono::milliseconds(pidns ? 1000 : 250);
      }
    }
  }
}

// The result of a call that ran, from what P saw; `wall` runs from the clone to the end of supervise.
SandboxResult make_result(Watch& w, const SandboxOptions& o, Clock::duration wall) {
  const size_t cap = static_cast<size_t>(o.max_output_bytes);
  auto code_of = [](int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : 1; };
  SandboxResult result;
  result.stdout_text = std::move(w.out);
  result.stderr_text = std::move(w.err);
  if (result.stdout_text.size() >= cap) trim_partial_utf8(result.stdout_text);
  if (result.stderr_text.size() >= cap) trim_partial_utf8(result.stderr_text);
  result.truncated = w.truncated;
  result.timed_out = w.timed_out;
  // Without B's report (B killed by code that could reach it in a fallback level): B's own status.
  result.exit_code = w.timed_out ? 128 + SIGKILL : w.done ? code_of(w.c_status) : code_of(w.b_status);
  result.wall_ms = std::chrono::duration<double, std::milli>(wall).count();
  return result;
}

// What confined the call, as "+"-joined tokens (SandboxResult::isolation).
std::string isolation_of(const Level& level, const SandboxPlan& plan, bool in_cgroups, const CallFiles& f) {
  std::string iso;
  auto add = [&iso](const char* token) { iso += iso.empty() ? token : std::string("+") + token; };
  const int ns = level.ns_flags;
  if (ns & CLONE_NEWUSER) add("userns");
  if (ns & CLONE_NEWPID) add("pidns");
  if (ns & CLONE_NEWNET) add("netns");
  if (ns & CLONE_NEWIPC) add("ipcns");
  if (plan.jail) add("mountns"), add("disk-quota");
  if (plan.drop_uid) add("setuid");
  if (in_cgroups && f.cgroups.pids) add("pids-cgroup");
  if (in_cgroups && f.cgroups.memory) add("memory-cgroup");
  if (plan.set_nproc) add("nproc");
  if (plan.landlock_abi > 0) add("landlock");
  if (plan.landlock_abi > 0 && plan.landlock_read) add("landlock-read");
  if (!plan.seccomp.empty()) add("seccomp");
  return iso;
}

// Said once per process where neither a mount namespace nor Landlock confines what the code reads.
void warn_if_reads_unconfined(const SandboxPlan& plan) {
  static std::once_flag once;
  if (plan.jail || (plan.landlock_abi > 0 && plan.landlock_read)) return;
  std::call_once(once, [] {
    std::fprintf(stderr,
                 "rlt sandbox: this host allows neither a mount namespace nor Landlock, so tool code can read every "
                 "file the trainer's user can (isolation lacks mountns and landlock-read)\n");
  });
}

// One attempt at `level`, the code in a memfd from the start.
bool run_at_level(const std::string& code, const SandboxOptions& o, const Interpreter& in, const Level& level,
                  SandboxResult& result) {
  const auto t0 = Clock::now();
  std::unique_ptr<Launched> l = launch(&code, o, in, level);
  return finish(*l, o, in, t0, result);
}

}  // namespace

// One read of the status pipe. Returns true at its end, with `status_r` closed.
bool read_reports(Fd& status_r, Watch& w) {
  char buf[65536];
  const ssize_t got = read(status_r.fd, buf, sizeof buf);
  if (got < 0 && (errno == EINTR || errno == EAGAIN)) return false;
  // Status: fixed-size records, then EOF once B (and C, before its execve) are gone.
  if (got > 0) {
    w.status_bytes.append(buf, got);
    while (w.status_bytes.size() >= sizeof(Report)) {
      Report r;
      std::memcpy(&r, w.status_bytes.data(), sizeof r);
      w.status_bytes.erase(0, sizeof r);
      if (r.kind == kStarted) w.c_pid = r.a;
      if (r.kind == kDone) w.done = true, w.c_status = r.a;
      if (r.kind == kFailed && !w.failed) w.failed = true, w.fail_stage = r.a, w.fail_errno = r.b;
    }
    return false;
  }
  status_r.reset();
  return true;
}

// Supervises a launched call to its end, its wall clock (and its timeout) counted from t0. Returns false
// (and leaves `result` alone) when the kernel refused the level's namespaces or its read-only root, so the
// caller can try the next one.
bool finish(Launched& l, const SandboxOptions& o, const Interpreter& in, Clock::time_point t0, SandboxResult& result) {
  Watch& w = l.w;
  supervise(w, l.b, l.pidns(), o, t0, l.f);
  const auto t1 = Clock::now();
  if (!l.b.reaped) {
    kill(l.b.pid, SIGKILL);
    while (waitpid(l.b.pid, &w.b_status, 0) < 0 && errno == EINTR) {
    }
    l.b.reaped = true;
  }
  if (w.failed && !w.timed_out) {
    // No code ran: the kernel refused this level's namespaces, their maps or the jail. Only a refusal
    // moves to the next level for good; running out of processes or memory is an error of this call.
    const int e = w.fail_errno;
    const bool refused = e == EPERM || e == EACCES || e == EINVAL || e == ENOSPC || e == EUSERS || e == ENOSYS;
    if (refused && (w.fail_stage == kStageNamespaces || w.fail_stage == kStageMaps || w.fail_stage == kStageJail)) {
      return false;
    }
    throw SandboxError(std::string("sandbox setup failed while ") + stage_name(w.fail_stage) + " (" +
                       (w.fail_stage <= kStageInit ? init_path() : in.exe) + "): " + errno_text(w.fail_errno));
  }
  result = make_result(w, o, t1 - t0);
  result.isolation = isolation_of(l.level, l.plan, l.in_cgroups, l.f);
  warn_if_reads_unconfined(l.plan);
  return true;
}

SandboxResult run_levels(const std::string& code, const SandboxOptions& o, const Interpreter& in) {
  for (;;) {
    const int level = first_level(o);
    SandboxResult r;
    if (run_at_level(code, o, in, kLevels[level], r)) return r;
    level_refused(level);
  }
}

void validate(const SandboxOptions& options) {
  SandboxOptions copy = options;  // visit() is non-const by the fields.h convention
  std::string errors;
  rlt::validate(copy, [&](const std::string& key, const std::string& why) { errors += " " + key + ": " + why + ";"; });
  if (!errors.empty()) throw SandboxError("bad sandbox options:" + errors);
}

}  // namespace rlt::sandbox

namespace rlt {

nlohmann::json SandboxResult::to_json() const {
  return {{"stdout", sandbox::valid_utf8(stdout_text)},
          {"stderr", sandbox::valid_utf8(stderr_text)},
          {"exit_code", exit_code},
          {"timed_out", timed_out},
          {"truncated", truncated},
          {"wall_ms", wall_ms},
          {"isolation", isolation}};
}

SandboxResult run_python(const std::string& code, const SandboxOptions& options) {
  sandbox::validate(options);
  const sandbox::Interpreter in = sandbox::interpreter_for(options);
  return sandbox::run_levels(code, options, in);
}

}  // namespace rlt
