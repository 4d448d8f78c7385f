// The seccomp filter of a call: which syscalls fail, and how, built with libseccomp in the caller and
// exported as BPF once per variant. Installing it in C is rlt-sandbox-init's; the rest of the
// confinement (namespaces, Landlock, rlimits) is elsewhere.
#include "rollout/sandbox_internal.h"

#include <seccomp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <mutex>

namespace rlt::sandbox {

namespace {

// Denied outright (EPERM): nothing that inspects or changes other processes, the kernel, or the mount table.
// clang-format off
constexpr const char* kDeniedSyscalls[] = {
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns", "swapon", "swapoff", "reboot", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "name_to_handle_at",
    "open_by_handle_at", "fanotify_init", "quotactl"};
// clang-format on

// Empty when libseccomp or a required rule failed (the call then runs without seccomp).
std::vector<sock_filter> build_seccomp(const SeccompVariant& v) {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (ctx == nullptr) return {};
  bool required_ok = true;
  // A 32-bit argument (int pid, int domain) is compared on its low half only: the kernel truncates the
  // register, so a caller could otherwise set the high bits to slip past an equality test.
  auto low32 = [](unsigned arg, uint32_t value) {
    return scmp_arg_cmp{arg, SCMP_CMP_MASKED_EQ, 0xffffffffull, static_cast<scmp_datum_t>(value)};
  };
  auto deny = [&](const char* name, int err, std::vector<scmp_arg_cmp> args = {}) {
    const int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR) return false;  // not a syscall on this architecture / libseccomp version
    return seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO(err), nr, static_cast<unsigned>(args.size()),
                                  args.empty() ? nullptr : args.data()) == 0;
  };
  // No network even where the namespace could not be made: IPv4, IPv6 and raw packet sockets.
  for (int domain : {AF_INET, AF_INET6, AF_PACKET}) required_ok &= deny("socket", EACCES, {low32(0, domain)});
  for (const char* name : kDeniedSyscalls) deny(name, EPERM);
  // New namespaces through clone (clone3 passes its flags in memory, out of a filter's reach: ENOSYS
  // makes glibc fall back to clone).
  deny("clone3", ENOSYS);
  for (uint64_t flag :
       {CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP}) {
    deny("clone", EPERM, {scmp_arg_cmp{0, SCMP_CMP_MASKED_EQ, flag, flag}});
  }
  if (v.owns_host_files) {
    // C owns every file the caller owns: Landlock stops opening them for writing, but not changing their
    // mode, owner, times or extended attributes, which only needs ownership.
    for (const char* name : {"chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
                             "utime", "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr",
                             "removexattr", "lremovexattr", "fremovexattr"}) {
      deny(name, EPERM);
    }
  }
  if (!v.landlock_truncate) deny("truncate", EPERM);
  if (!v.pidns) {
    // Without a pid namespace the caller is visible: no signal to it, to its process group, or to every
    // process at once (kill(-1)), and no thread-directed signals at all.
    const uint32_t self = static_cast<uint32_t>(getpid()), group = static_cast<uint32_t>(-getpgrp());
    for (uint32_t pid : {self, group, static_cast<uint32_t>(-1)}) required_ok &= deny("kill", EPERM, {low32(0, pid)});
    required_ok &= deny("tgkill", EPERM, {low32(0, self)});
    required_ok &= deny("tkill", EPERM);
    deny("rt_sigqueueinfo", EPERM, {low32(0, self)});
    deny("rt_tgsigqueueinfo", EPERM, {low32(0, self)});
    deny("pidfd_open", EPERM, {low32(0, self)});
  }
  std::vector<sock_filter> program;
  const int fd = memfd_create("rlt-seccomp", MFD_CLOEXEC);
  if (required_ok && fd >= 0 && seccomp_export_bpf(ctx, fd) == 0) {
    const off_t size = lseek(fd, 0, SEEK_END);
    if (size > 0 && size % sizeof(sock_filter) == 0 && lseek(fd, 0, SEEK_SET) == 0) {
      program.resize(size / sizeof(sock_filter));
      if (pread(fd, program.data(), size, 0) != size) program.clear();
    }
  }
  if (fd >= 0) close(fd);
  seccomp_release(ctx);
  return program;
}

}  // namespace

const std::vector<sock_filter>& seccomp_program(const SeccompVariant& v) {
  static std::mutex mu;
  static std::map<SeccompVariant, std::vector<sock_filter>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(v);
  if (it == cache.end()) it = cache.emplace(v, build_seccomp(v)).first;
  return it->second;
}

}  // namespace rlt::sandbox
