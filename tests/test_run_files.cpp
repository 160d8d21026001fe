// What a run leaves on disk when things go wrong: a full disk during a save or a metrics line
// (the right error, no half-written file or line), a torn metrics line from a crash, a run
// directory wanted by two runs; a stop signal while stdout is a pipe no one reads. The full-disk
// tests mount a small tmpfs (root only) and skip, saying why, where mounting is not allowed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/files.h"
#include "common/json.h"
#include "metrics/metrics.h"
#include "model/parameters.h"
#include "test_util.h"
#include "train/run_directory.h"
#include "train/stop_signal.h"

using namespace malleus;
using malleus::testing::error_of;
using malleus::testing::ScratchDir;
using malleus::testing::SmallFilesystem;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

checkpoint::Checkpoint tiny_checkpoint(bool with_optimizer) {
  checkpoint::Checkpoint c;
  c.model = model::load_model_config("tiny");
  const auto size = static_cast<size_t>(model::ParameterLayout(c.model).total_size());
  c.train_config = Json{{"note", "test"}};
  c.step = 3;
  c.params.assign(size, 0.5f);
  if (with_optimizer) {
    c.adam_m.assign(size, 0.25f);
    c.adam_v.assign(size, 0.125f);
  }
  return c;
}

// Every line of a metrics file is a whole JSON object (what `malleus report` needs).
void expect_whole_lines(const fs::path& path, size_t expected_lines) {
  const std::string text = read_file(path);
  ASSERT_TRUE(text.empty() || text.back() == '\n') << "torn last line: " << text;
  std::istringstream lines(text);
  size_t count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    EXPECT_NO_THROW(parse_json(line, "metrics")) << line;
  }
  EXPECT_EQ(count, expected_lines);
}

}  // namespace

TEST(FullDisk, AtomicFileReportsNoSpaceAndLeavesNothing) {
  ScratchDir dir;
  SmallFilesystem small(dir / "mnt", 64 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  write_file_atomic(small / "kept.txt", "previous contents");
  const std::string message =
      error_of([&] { write_file_atomic(small / "kept.txt", std::string(1 << 20, 'x')); });
  // It used to say "No such file or directory", from a stale errno.
  EXPECT_TRUE(contains(message, "No space left on device")) << message;
  EXPECT_TRUE(contains(message, "kept.txt")) << message;
  EXPECT_EQ(read_file(small / "kept.txt"), "previous contents");
  EXPECT_EQ(entries(small / ""), std::vector<std::string>{"kept.txt"});
}

TEST(FullDisk, CheckpointSaveReportsNoSpaceAndKeepsTheOldOne) {
  ScratchDir dir;
  // Room for parameters only (the tiny model's 35k floats, 140 KB), not for the Adam moments too.
  SmallFilesystem small(dir / "mnt", 256 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  checkpoint::save_checkpoint(small / "step_00000002", tiny_checkpoint(false));
  const std::string message = error_of(
      [&] { checkpoint::save_checkpoint(small / "step_00000003", tiny_checkpoint(true)); });
  EXPECT_TRUE(contains(message, "No space left on device")) << message;
  EXPECT_EQ(entries(small / ""), std::vector<std::string>{"step_00000002"});
  EXPECT_EQ(checkpoint::load_checkpoint(small / "step_00000002", false).step, 3);
}

TEST(FullDisk, MetricsLinesAreWholeOrAbsent) {
  ScratchDir dir;
  SmallFilesystem small(dir / "mnt", 16 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  const fs::path path = small / "metrics.jsonl";
  metrics::StepRecord record;
  record.step = 1;
  record.plan = std::string(300, 'x');
  size_t written = 0;
  std::string message;
  {
    metrics::MetricsLog log(path);
    for (; written < 1000 && message.empty(); ++written) {
      message = error_of([&] { log.write(record); });
    }
    --written;  // the last attempt failed
  }
  EXPECT_TRUE(contains(message, "No space left on device")) << message;
  EXPECT_TRUE(contains(message, "metrics.jsonl")) << message;
  EXPECT_GT(written, 10u);
  expect_whole_lines(path, written);
  // With room again, a later run appends after the whole lines.
  fs::resize_file(path, 0);
  {
    metrics::MetricsLog log(path);
    log.write(record);
  }
  expect_whole_lines(path, 1);
}

TEST(Metrics, TornLastLineIsRemovedWithAWarning) {
  ScratchDir dir;
  const fs::path path = dir / "metrics.jsonl";
  write_file_atomic(path, "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3, \"lo");
  ::testing::internal::CaptureStderr();
  {
    metrics::MetricsLog log(path);
    log.write(metrics::EvalRecord{3, 1.5});
  }
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(
      contains(warning, "warning: " + path.string() + " ended in an incomplete line (15 bytes"))
      << warning;
  EXPECT_EQ(read_file(path), "{\"step\": 1}\n{\"step\": 2}\n{\"step\":3,\"val_loss\":1.5}\n");
  // A file that is nothing but a torn line becomes empty; a whole file is left alone.
  write_file_atomic(path, "{\"st");
  { metrics::MetricsLog log(path); }
  EXPECT_EQ(read_file(path), "");
  write_file_atomic(path, "{}\n");
  ::testing::internal::CaptureStderr();
  { metrics::MetricsLog log(path); }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(read_file(path), "{}\n");
}

TEST(RunDirectory, OneRunAtATime) {
  ScratchDir dir;
  const fs::path run = dir / "run";
  std::optional<train::RunDirectory> first(std::in_place, run, std::nullopt);
  // flock locks belong to open files, so a second open in this process conflicts too.
  std::string message = error_of([&] { train::RunDirectory second(run, std::nullopt); });
  EXPECT_TRUE(contains(
      message, "run directory " + run.string() + " is in use by pid " + std::to_string(::getpid())))
      << message;
  message = error_of([&] { train::RunDirectory second(run, run); });
  EXPECT_TRUE(contains(message, "is in use")) << message;
  first.reset();
  // Released: the same run may go on (it holds only the lock file so far).
  EXPECT_EQ(error_of([&] { train::RunDirectory again(run, std::nullopt); }), "");
}

TEST(RunDirectory, AnotherRunsFilesAreRefusedUnlessResumingThem) {
  ScratchDir dir;
  const fs::path run = dir / "run";
  fs::create_directories(run / "checkpoints");
  write_file_atomic(run / "metrics.jsonl", "{}\n");
  std::string message = error_of([&] { train::RunDirectory fresh(run, std::nullopt); });
  EXPECT_TRUE(contains(message, "run directory " + run.string() + " already holds a run"))
      << message;
  EXPECT_TRUE(contains(message, "checkpoints")) << message;
  EXPECT_TRUE(contains(message, "metrics.jsonl")) << message;
  // Resuming another run into it is refused as well; resuming this run is not.
  message = error_of([&] { train::RunDirectory other(run, dir / "elsewhere"); });
  EXPECT_TRUE(contains(message, "already holds a run")) << message;
  EXPECT_EQ(error_of([&] { train::RunDirectory same(run, dir / "." / "run"); }), "");
  EXPECT_EQ(read_file(run / "metrics.jsonl"), "{}\n");
}

// ---- A stop signal while stdout is a pipe no one reads (mpirun, once it is terminated) ----

namespace {

// Fills `fd` (a pipe or a terminal no one reads) until a write would block, which the returned
// count of refused writes, 2, proves; leaves it blocking, as mpirun's are. Lines, then single bytes
// into what is left of the last page (the kernel merges small writes into it), until not even a
// byte fits.
int fill_until_full(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  const std::string line(200, 'x');
  int refused = 0;
  for (size_t size : {line.size(), size_t{1}}) {
    while (::write(fd, line.data(), size) > 0) {
    }
    refused += errno == EAGAIN ? 1 : 0;
  }
  ::fcntl(fd, F_SETFL, flags);
  return refused;
}

// A pipe whose write end is this process's stdout, full (fill_until_full's count). The read end
// stays open and unread.
int fill_stdout_with_a_pipe() {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const int refused = fill_until_full(fds[1]);
  ::dup2(fds[1], 1);
  return refused;
}

// Runs `child` in a forked process; its exit status, or -1 if it had not ended after
// `limit_s` (it is then killed). `after_start` runs in the parent once the child is running.
int run_child(const std::function<int()>& child, double limit_s,
              const std::function<void(pid_t)>& after_start = {}) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(child());
  if (after_start) after_start(pid);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

}  // namespace

TEST(StopSignals, AWriteAfterSigtermReturnsThoughThePipeIsFull) {
  // The signal first, then the step's line: it must not block on the full pipe (the race behind
  // the signal test's rare failure: the kill came while rank 0 waited to write its step line).
  for (const int signal : {SIGTERM, SIGINT}) {
    const int status = run_child(
        [signal] {
          if (fill_stdout_with_a_pipe() != 2) return 2;
          train::StopSignals stop;
          ::raise(signal);  // the handler runs before raise returns
          if (train::StopSignals::received() != signal) return 3;
          const std::string line = "step     3/100 | loss 4.2\n";
          const ssize_t n = ::write(1, line.data(), line.size());
          return n < 0 && errno == EAGAIN ? 0 : 4;
        },
        20);
    EXPECT_EQ(status, 0) << "signal " << signal
                         << (status == -1 ? ": the write blocked" : ": see the child's code");
  }
}

TEST(StopSignals, AWriteBlockedOnAFullPipeReturnsWhenSigtermComes) {
  const int status = run_child(
      [] {
        if (fill_stdout_with_a_pipe() != 2) return 2;
        train::StopSignals stop;
        const std::string line = "step     3/100 | loss 4.2\n";
        const ssize_t n = ::write(1, line.data(), line.size());  // blocks until the signal
        return n < 0 && errno == EINTR && train::StopSignals::received() == SIGTERM ? 0 : 4;
      },
      20,
      [](pid_t pid) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ::kill(pid, SIGTERM);
      });
  EXPECT_EQ(status, 0) << (status == -1 ? "the write blocked" : "see the child's code");
}

TEST(StopSignals, AWriteBlockedOnAFullPipeReturnsWhenSigtermReachesAnotherThread) {
  // The kernel may hand a process's SIGTERM to any of its threads (MPI's, OpenMP's): the main
  // thread's blocked write must return all the same.
  const int status = run_child(
      [] {
        if (fill_stdout_with_a_pipe() != 2) return 2;
        train::StopSignals stop;
        std::thread other([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          ::pthread_kill(::pthread_self(), SIGTERM);  // delivered to this thread
        });
        const std::string line = "step     3/100 | loss 4.2\n";
        const ssize_t n = ::write(1, line.data(), line.size());  // blocks until woken
        const int error = errno;
        other.join();
        return n < 0 && (error == EINTR || error == EAGAIN) &&
                       train::StopSignals::received() == SIGTERM
                   ? 0
                   : 4;
      },
      10);
  EXPECT_EQ(status, 0) << (status == -1 ? "the write blocked" : "see the child's code");
}

TEST(StopSignals, ASecondSigtermDoesNotEndTheStopButASecondCtrlCDoes) {
  // Under Slurm a rank started by mpirun gets SIGTERM from its step and again from mpirun's kill
  // sequence: the second must not end the save the first one started.
  for (const int signal : {SIGTERM, SIGUSR1}) {
    const int status = run_child(
        [signal] {
          train::StopSignals stop;
          ::raise(signal);
          ::raise(signal);  // would end the process with the default action
          return train::StopSignals::received() == signal ? 0 : 4;
        },
        20);
    EXPECT_EQ(status, 0) << "signal " << signal << ": " << status;
  }
  const int status = run_child(
      [] {
        train::StopSignals stop;
        ::raise(SIGINT);
        ::raise(SIGINT);
        return 5;  // not reached
      },
      20);
  EXPECT_EQ(status, 100 + SIGINT);
}

namespace {

// A pseudo-terminal in raw mode, as mpirun gives each rank's stdout: the master stays with the
// test (read or not), the slave becomes stdout in a child.
struct PseudoTerminal {
  int master = -1;
  int slave = -1;
  PseudoTerminal() {
    master = ::posix_openpt(O_RDWR | O_NOCTTY);
    if (master < 0 || ::grantpt(master) != 0 || ::unlockpt(master) != 0) return;
    slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY);
    struct termios mode;
    if (slave >= 0 && ::tcgetattr(slave, &mode) == 0) {
      ::cfmakeraw(&mode);
      ::tcsetattr(slave, TCSANOW, &mode);
    }
  }
  ~PseudoTerminal() {
    if (slave >= 0) ::close(slave);
    if (master >= 0) ::close(master);
  }
};

// Whether one more byte fits in `fd` without blocking (it is written if it does).
bool a_byte_fits(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  const bool fits = ::write(fd, "x", 1) == 1;
  ::fcntl(fd, F_SETFL, flags);
  return fits;
}

// In the child: the terminal's slave as stdout, full (fill_until_full). A pseudo-terminal hands
// what was written to its master's buffer on a kernel worker, after the write returns, so room
// can appear after the first refusal (this test failed so once under the suite's load): it is
// full when a pause of 20 ms makes no room, up to 2 s.
bool fill_stdout_with(const PseudoTerminal& terminal) {
  ::close(terminal.master);
  if (::dup2(terminal.slave, 1) < 0) return false;
  int refused = fill_until_full(1);
  for (int pause = 0; pause < 100; ++pause) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!a_byte_fits(1)) return refused == 2;
    refused = fill_until_full(1);
  }
  return false;
}

}  // namespace

TEST(StopSignals, AWriteAfterSigtermReturnsThoughThePseudoTerminalIsFull) {
  // mpirun gives each rank's stdout a pseudo-terminal, and stops reading it when it is terminated:
  // the step's line after the signal must not block on it (the signal test failed so, 2 times in
  // 50, while only pipes were made non-blocking).
  for (const int signal : {SIGTERM, SIGINT}) {
    PseudoTerminal terminal;
    ASSERT_GE(terminal.slave, 0) << std::strerror(errno);
    const int status = run_child(
        [&terminal, signal] {
          if (!fill_stdout_with(terminal)) return 2;
          train::StopSignals stop;
          ::raise(signal);
          if (train::StopSignals::received() != signal) return 3;
          std::printf("step     3/100 | loss 4.2\n");
          return std::fflush(stdout) == EOF && errno == EAGAIN ? 0 : 4;
        },
        10);
    EXPECT_EQ(status, 0) << "signal " << signal
                         << (status == -1 ? ": the write blocked" : ": see the child's code");
  }
}

TEST(StopSignals, EachStopSignalsNameGivesItsNumberBack) {
  for (const int signal : {SIGTERM, SIGINT, SIGUSR1}) {
    EXPECT_EQ(train::StopSignals::number(train::StopSignals::name(signal)), signal);
  }
  EXPECT_EQ(train::StopSignals::number("SIGKILL"), 0);  // no stop's
  EXPECT_EQ(train::StopSignals::number(""), 0);
}

TEST(StopSignals, TheUsersOwnTerminalStaysBlocking) {
  // A terminal that is the process's controlling one is read by its user: the stop's lines are
  // shown, not dropped, and the shell gets its terminal back as it was.
  PseudoTerminal terminal;
  ASSERT_GE(terminal.slave, 0) << std::strerror(errno);
  const int status = run_child(
      [&terminal] {
        ::close(terminal.master);
        if (::setsid() < 0 || ::ioctl(terminal.slave, TIOCSCTTY, 0) != 0) return 2;
        ::dup2(terminal.slave, 1);
        train::StopSignals stop;
        ::raise(SIGTERM);
        return (::fcntl(1, F_GETFL) & O_NONBLOCK) == 0 ? 0 : 4;
      },
      20);
  EXPECT_EQ(status, 0);
}

TEST(StopSignals, SigusrOneLeavesTheOutputBlockingForAReaderThatStillReads) {
  // mpirun forwards SIGUSR1 and goes on reading: the step and stop lines are not to be dropped.
  const int status = run_child(
      [] {
        int fds[2];
        if (::pipe(fds) != 0) return 2;
        ::dup2(fds[1], 1);
        train::StopSignals stop;
        ::raise(SIGUSR1);
        return (::fcntl(1, F_GETFL) & O_NONBLOCK) == 0 ? 0 : 4;
      },
      20);
  EXPECT_EQ(status, 0);
}
