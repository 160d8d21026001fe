// common/stack_dump.h: another thread's stack, named, and the kernel's view of it;
// common/proc_stat.h: the stat lines it reads.
#include "common/stack_dump.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/proc_stat.h"

namespace {

using namespace std::chrono_literals;

TEST(StackDump, NamesTheCallAnotherThreadWaitsIn) {
  malleus::prepare_stack_dumps();
  std::atomic<bool> stop{false};
  std::thread sleeper([&] {
    while (!stop) std::this_thread::sleep_for(10ms);
  });
  std::this_thread::sleep_for(50ms);
  const std::string stack = malleus::stack_of(sleeper.native_handle(), 2.0, "> ");
  stop = true;
  sleeper.join();
  EXPECT_NE(stack.find("nanosleep"), std::string::npos) << stack;
  EXPECT_EQ(stack.rfind("> ", 0), 0u) << stack;  // every line indented as asked
}

TEST(StackDump, SaysSoWhenTheThreadDoesNotAnswer) {
  malleus::prepare_stack_dumps();
  std::atomic<bool> stop{false}, blocked{false};
  std::thread deaf([&] {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    blocked = true;
    while (!stop) std::this_thread::sleep_for(10ms);
  });
  while (!blocked) std::this_thread::sleep_for(1ms);
  const auto start = std::chrono::steady_clock::now();
  const std::string stack = malleus::stack_of(deaf.native_handle(), 0.2);
  const auto waited = std::chrono::steady_clock::now() - start;
  stop = true;
  deaf.join();  // the signal stays pending on a thread that ends: nothing runs it
  EXPECT_NE(stack.find("did not answer within"), std::string::npos) << stack;
  EXPECT_LT(waited, 5s);
}

// The threads' states do not depend on the machine's load: the sleeper waits on a condition
// variable (no timer that wakes it, so it is never caught runnable), and the spinner spins until
// its own CPU clock has counted 0.2 s, however long that takes on a busy machine (seen: 300 ms of
// wall time gave less than 0.1 s of CPU beside 3 other tests), then waits too.
TEST(StackDump, TheKernelSaysWhetherAThreadSleepsOrRunsAndHowMuchCpuItHad) {
  std::mutex m;
  std::condition_variable cv;
  bool stop = false, spun = false;
  pid_t sleeping = 0, spinning = 0;
  const auto wait_for_stop = [&](std::unique_lock<std::mutex>& lock) {
    cv.wait(lock, [&] { return stop; });
  };
  std::thread sleeper([&] {
    std::unique_lock lock(m);
    sleeping = ::gettid();
    cv.notify_all();
    wait_for_stop(lock);
  });
  std::thread spinner([&] {
    timespec cpu{};
    do {
      ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
    } while (cpu.tv_sec == 0 && cpu.tv_nsec < 200'000'000);
    std::unique_lock lock(m);
    spinning = ::gettid();
    spun = true;
    cv.notify_all();
    wait_for_stop(lock);
  });
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return sleeping != 0 && spun; });
  }
  // Both are in their waits now; a moment for the sleeper to settle back into its own after
  // the spinner's notify woke it.
  std::this_thread::sleep_for(50ms);
  const std::string asleep = malleus::kernel_state_of(sleeping, "> ");
  const std::string spun_state = malleus::kernel_state_of(spinning);
  {
    std::lock_guard lock(m);
    stop = true;
  }
  cv.notify_all();
  sleeper.join();
  spinner.join();
  EXPECT_EQ(asleep.rfind("> kernel: state S (sleeping)", 0), 0u) << asleep;
  EXPECT_NE(asleep.find("s of CPU (user"), std::string::npos) << asleep;
  // 0.2 s of the spinner's own CPU clock, read from the kernel's stat line in clock ticks.
  const double cpu_s = std::stod(spun_state.substr(spun_state.find(", ") + 2));
  EXPECT_GE(cpu_s, 0.15) << spun_state;
  EXPECT_NE(malleus::kernel_state_of(999'999'999).find("is gone"), std::string::npos);
}

TEST(ProcStat, FieldsComeAfterACommandNameWithSpacesAndParentheses) {
  char path[] = "/tmp/malleus-proc-stat-XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  std::ofstream(path) << "4242 (a (b) c) S 17 4242 4242 0 -1\n";
  EXPECT_EQ(malleus::proc_stat_fields(path),
            (std::vector<std::string>{"S", "17", "4242", "4242", "0", "-1"}));
  std::remove(path);
  EXPECT_TRUE(malleus::proc_stat_fields(path).empty());  // gone
  const std::vector<std::string> self = malleus::proc_stat_fields("/proc/self/stat");
  ASSERT_GT(self.size(), 19u);
  EXPECT_EQ(self[0], "R");  // this thread reads it
  EXPECT_EQ(self[1], std::to_string(::getppid()));
}

}  // namespace
