// common/stack_dump.h: another thread's stack, named.
#include "common/stack_dump.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <string>
#include <thread>

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

}  // namespace
