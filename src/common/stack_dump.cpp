#include "common/stack_dump.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "common/proc_stat.h"

namespace malleus {

namespace {

constexpr int kMaxFrames = 64;

// What the handler fills in: written only inside the handler, read after `ready` is set.
void* g_frames[kMaxFrames];
std::atomic<int> g_count{0};
std::atomic<bool> g_ready{false};
std::atomic<bool> g_prepared{false};
std::mutex g_one_dump;  // one stack_of at a time: the frames above are the process's only slot

int dump_signal() {
  return SIGRTMIN + 4;
}

void record_frames(int) {
  const int saved_errno = errno;
  g_count.store(::backtrace(g_frames, kMaxFrames), std::memory_order_relaxed);
  g_ready.store(true, std::memory_order_release);
  errno = saved_errno;
}

std::string describe_frame(void* address) {
  char line[512];
  Dl_info info{};
  if (::dladdr(address, &info) == 0 || info.dli_fname == nullptr) {
    std::snprintf(line, sizeof line, "%p", address);
    return line;
  }
  const char* file = info.dli_fname;
  if (const char* slash = std::strrchr(file, '/')) file = slash + 1;
  const auto offset =
      reinterpret_cast<uintptr_t>(address) - reinterpret_cast<uintptr_t>(info.dli_fbase);
  if (info.dli_sname == nullptr) {
    std::snprintf(line, sizeof line, "%s+0x%zx", file, static_cast<size_t>(offset));
    return line;
  }
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(
      abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status), std::free);
  const char* name = status == 0 && demangled ? demangled.get() : info.dli_sname;
  std::snprintf(line, sizeof line, "%s (%s+0x%zx)", name, file, static_cast<size_t>(offset));
  return line;
}

// The whole of a /proc file, or "" when it cannot be read.
std::string read_proc(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return in ? text.str() : std::string();
}

const char* state_name(char state) {
  switch (state) {
    case 'R':
      return "running";
    case 'S':
      return "sleeping";
    case 'D':
      return "uninterruptible, in the kernel";
    case 'T':
      return "stopped";
    case 't':
      return "stopped by a tracer";
    case 'Z':
      return "a zombie";
    default:
      return "other";
  }
}

}  // namespace

std::string kernel_state_of(pid_t tid, const std::string& indent) {
  const std::string task = "/proc/self/task/" + std::to_string(tid) + "/";
  const std::vector<std::string> fields = proc_stat_fields(task + "stat");
  if (fields.size() < 13) return indent + "kernel: (thread " + std::to_string(tid) + " is gone)\n";
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  const double user_s = std::strtod(fields[11].c_str(), nullptr) / tick;
  const double system_s = std::strtod(fields[12].c_str(), nullptr) / tick;
  const std::string wchan = read_proc(task + "wchan");
  char line[512];
  std::snprintf(line, sizeof line,
                "kernel: state %c (%s)%s%s, %.2f s of CPU (user %.2f s, system %.2f s)\n",
                fields[0][0], state_name(fields[0][0]), wchan.empty() || wchan == "0" ? "" : " in ",
                wchan == "0" ? "" : wchan.c_str(), user_s + system_s, user_s, system_s);
  std::string text = indent + line;
  std::istringstream stack(read_proc(task + "stack"));  // root only
  for (std::string frame; std::getline(stack, frame);) text += indent + "  " + frame + "\n";
  return text;
}

void prepare_stack_dumps() {
  static std::once_flag once;
  std::call_once(once, [] {
    void* warm[2];
    ::backtrace(warm, 2);  // loads libgcc_s now, not inside the handler
    struct sigaction action {};
    action.sa_handler = record_frames;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    if (::sigaction(dump_signal(), &action, nullptr) == 0) g_prepared = true;
  });
}

std::string stack_of(pthread_t thread, double wait_s, const std::string& indent) {
  if (!g_prepared) return indent + "(no stack: stack dumps were not prepared)\n";
  const std::lock_guard lock(g_one_dump);
  g_ready = false;
  if (::pthread_kill(thread, dump_signal()) != 0)
    return indent + "(no stack: the thread is gone)\n";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  while (!g_ready.load(std::memory_order_acquire)) {
    if (std::chrono::steady_clock::now() > deadline) {
      return indent + "(no stack: the thread did not answer within " + std::to_string(wait_s) +
             " s)\n";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::string text;
  const int count = g_count.load(std::memory_order_relaxed);
  // Frame 0 is the handler itself, frame 1 the kernel's signal trampoline.
  for (int i = 2; i < count; ++i) text += indent + describe_frame(g_frames[i]) + "\n";
  return text;
}

}  // namespace malleus
