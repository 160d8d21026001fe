// Shared test helpers: scratch directories, a small synthetic corpus, running the CLI.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>

#include "common/error.h"
#include "data/shard.h"
#include "model/config.h"
#include "test_models.h"
#include "tokenizer/byte_tokenizer.h"
#include "tokenizer/sentencepiece_tokenizer.h"

namespace malleus::testing {

namespace fs = std::filesystem;

// Open MPI 4 makes its session directory, <TMPDIR>/ompi.<host>.<uid>, when a job or a singleton
// starts and removes it when the last one ends; two starts at the same moment (CTest runs tests
// side by side) race on the mkdir, and the loser's MPI_Init fails ("A call to mkdir was unable to
// create the desired directory ... File exists": seen once in the sanitizer run; Open MPI's
// report of the race: open-mpi/ompi#8510). So a test process gives itself, and whatever it
// starts, a TMPDIR of its own (its scratch directories, and Open MPI's session directories under
// it), removed when it exits: not in a rank mpirun started (its session directory is mpirun's),
// nor under MALLEUS_KEEP_SCRATCH=1 (which keeps scratch directories); a fork (a death test's
// child) leaves it to the process that made it.
class OwnTmpdir {
 public:
  OwnTmpdir() {
    if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) return;
    if (const char* keep = std::getenv("MALLEUS_KEEP_SCRATCH"); keep && *keep == '1') return;
    const char* base = std::getenv("TMPDIR");
    std::string made = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/mt.XXXXXX";
    if (::mkdtemp(made.data()) == nullptr) return;  // then the shared TMPDIR, as before
    ::chmod(made.c_str(), 01777);  // as /tmp: tests run commands as another user too
    path_ = made;
    owner_ = ::getpid();
    ::setenv("TMPDIR", path_.c_str(), 1);
  }
  ~OwnTmpdir() {
    if (path_.empty() || ::getpid() != owner_) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  OwnTmpdir(const OwnTmpdir&) = delete;
  OwnTmpdir& operator=(const OwnTmpdir&) = delete;

 private:
  std::string path_;
  pid_t owner_ = 0;
};
inline OwnTmpdir own_tmpdir;

// Removes the memory copies (checkpoint/memory_folder.h: <base>/malleus-*/owner.json names the
// run directory) of every run inside `dir`, as a test removes its run directories: tests leave no
// /dev/shm/malleus-* behind, whether their runs ended, were killed or were given up on.
inline void remove_memory_copies_of_runs_under(const fs::path& dir) {
  const char* env = std::getenv("MALLEUS_MEMORY_CHECKPOINT_DIR");
  const fs::path base = env != nullptr && *env != '\0' ? fs::path(env) : fs::path("/dev/shm");
  const std::string prefix = fs::absolute(dir).lexically_normal().string() + "/";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(base, ec)) {
    if (entry.path().filename().string().rfind("malleus-", 0) != 0) continue;
    std::ifstream in(entry.path() / "owner.json");
    if (!in) continue;
    const nlohmann::json owner = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!owner.is_object() || !owner.contains("run_dir") || !owner["run_dir"].is_string()) continue;
    const std::string run = owner["run_dir"].get<std::string>() + "/";
    std::error_code ignored;
    if (run.rfind(prefix, 0) == 0) fs::remove_all(entry.path(), ignored);
  }
}

// A fresh directory, removed afterwards; named after the running test, so tests can run in
// parallel (ctest -j) and leave nothing behind. MALLEUS_KEEP_SCRATCH=1 keeps the directory of a
// failed test (its runs' logs, metrics and hang records) and prints where it is.
class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("malleus_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
             std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    const char* keep = std::getenv("MALLEUS_KEEP_SCRATCH");
    if (keep != nullptr && std::string(keep) == "1" && ::testing::Test::HasFailure()) {
      std::fprintf(stderr, "kept the failed test's directory %s\n", path_.c_str());
      return;
    }
    std::error_code ignored;
    fs::remove_all(path_, ignored);
    remove_memory_copies_of_runs_under(path_);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// The start of a command line running mpirun: OpenMPI as root (containers) needs explicit
// consent, and with more ranks than cores, ranks waiting in MPI must yield the CPU to the ones
// computing instead of busy-polling. Ends in a space.
inline const std::string kMpiEnvironment =
    "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 ";

// The message of the malleus::Error that `f` throws, or "" if it throws none. Another exception
// is a test failure (its message is returned): bad input must be reported as an Error.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected malleus::Error, got another exception: " << e.what();
    return e.what();
  }
  return "";
}

// Token ids as shards hold them.
inline std::vector<uint16_t> shard_tokens(const std::vector<int32_t>& ids) {
  return {ids.begin(), ids.end()};
}

// English-like text with enough regularity that a tiny model's loss falls within a few dozen
// steps; written as byte-tokenized train and val shards under `dir`, with the tokenizer's record.
inline void write_synthetic_corpus(const fs::path& dir) {
  const char* subjects[] = {"the cat", "a dog", "my friend", "the old man", "our teacher"};
  const char* verbs[] = {"sees", "likes", "finds", "reads", "paints"};
  const char* objects[] = {"a red ball.", "the blue sky.", "an old book.", "the green tree."};
  std::string train, val;
  for (int i = 0; i < 400; ++i) {
    std::string sentence = std::string(subjects[i % 5]) + " " + verbs[(i / 5) % 5] + " " +
                           objects[(i / 25) % 4] + "\n";
    (i % 10 == 9 ? val : train) += sentence;
  }
  const tokenizer::ByteTokenizer bytes;
  fs::create_directories(dir);
  data::write_shard(dir / "train_000000.bin", shard_tokens(bytes.encode(train)));
  data::write_shard(dir / "val_000000.bin", shard_tokens(bytes.encode(val)));
  tokenizer::save_tokenizer(bytes, dir);
}

// About 9 KB of English-like lines with punctuation and numbers: enough for a few hundred
// SentencePiece pieces.
inline std::vector<std::string> tokenizer_corpus_lines() {
  const char* subjects[] = {"The old sailor", "A quiet child", "Every teacher",   "My neighbour",
                            "The clever fox", "Nobody",        "Your best friend"};
  const char* verbs[] = {"remembers",    "forgets",   "believes in",
                         "writes about", "laughs at", "dreams of"};
  const char* objects[] = {"the long winter.",
                           "a red balloon!",
                           "the 12 wise men?",
                           "three silver coins.",
                           "the sea, the sky and the wind.",
                           "what happened in 1984."};
  std::vector<std::string> lines;
  for (int i = 0; i < 210; ++i) {
    lines.push_back(std::string(subjects[i % 7]) + " " + verbs[(i / 7) % 6] + " " +
                    objects[(i / 42) % 6]);
  }
  return lines;
}

// A SentencePiece model ("bpe" or "unigram") trained on tokenizer_corpus_lines().
inline std::shared_ptr<const tokenizer::Tokenizer> small_sentencepiece(const std::string& type,
                                                                       int vocab) {
  const auto lines = tokenizer_corpus_lines();
  size_t next = 0;
  tokenizer::SentencePieceTraining options;
  options.vocab_size = vocab;
  options.model_type = type;
  const std::string model = tokenizer::train_sentencepiece(
      [&](std::string& sentence) {
        if (next == lines.size()) return false;
        sentence = lines[next++];
        return true;
      },
      options);
  return tokenizer::sentencepiece_from_bytes(model, "trained " + type + " model");
}

struct CommandResult {
  int exit_code;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line.
inline CommandResult run_command(const std::string& command) {
  CommandResult result{-1, ""};
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> chunk;
  size_t n;
  while ((n = std::fread(chunk.data(), 1, chunk.size(), pipe)) > 0)
    result.output.append(chunk.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

#ifdef MALLEUS_PYTHON
// Parses `path` with Python's xml.etree (an XML parser independent of ours) and prints every
// element's text and attribute values, one per line; the exit code is non-zero unless the file is
// well-formed XML.
inline CommandResult parse_xml(const fs::path& path) {
  return run_command(std::string(MALLEUS_PYTHON) +
                     " -c 'import sys, xml.etree.ElementTree as E\n"
                     "for e in E.parse(sys.argv[1]).iter():\n"
                     "  print(e.text or \"\")\n"
                     "  for v in e.attrib.values(): print(v)' " +
                     path.string());
}
#endif

#ifdef MALLEUS_BINARY
// Runs `malleus <arguments>`.
inline CommandResult run_malleus(const std::string& arguments) {
  return run_command(std::string(MALLEUS_BINARY) + " " + arguments);
}
#endif

// A shell command running in the background, its stdout and stderr going to a file, for tests
// that act on a job while it runs (signals, a second run on the same directory).
class BackgroundCommand {
 public:
  BackgroundCommand(const std::string& command, const fs::path& output) : output_(output) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      // exec: the command itself gets this pid, so signals to pid() reach it.
      ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~BackgroundCommand() {
    if (running()) {
      ::kill(pid_, SIGTERM);  // mpirun passes it on to its ranks
      if (wait(10) == -1) {
        ::kill(pid_, SIGKILL);
        wait(10);
      }
    }
  }
  BackgroundCommand(const BackgroundCommand&) = delete;
  BackgroundCommand& operator=(const BackgroundCommand&) = delete;

  pid_t pid() const { return pid_; }
  bool running() const { return exit_code_ == kRunning; }
  std::string output() const {
    std::ifstream in(output_);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }
  // Waits until the output contains `text` (true) or `timeout_s` passed or the command ended.
  bool wait_for_output(const std::string& text, double timeout_s) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < end) {
      if (output().find(text) != std::string::npos) return true;
      if (!running() || poll()) return output().find(text) != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // The exit status (128 + n when killed by signal n), or -1 if still running after timeout_s.
  int wait(double timeout_s) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (running() && !poll() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return running() ? -1 : exit_code_;
  }

 private:
  static constexpr int kRunning = -1000;
  // Reaps the command if it ended; returns whether it has.
  bool poll() {
    if (!running()) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  }

  fs::path output_;
  pid_t pid_ = -1;
  int exit_code_ = kRunning;
};

// A tmpfs of `bytes` mounted on `dir` for a full-disk test, unmounted at the end. Mounting needs
// root and a system that allows it; mounted() says whether it worked and why_not() why not.
class SmallFilesystem {
 public:
  SmallFilesystem(const fs::path& dir, size_t bytes) : dir_(dir) {
    fs::create_directories(dir_);
    const std::string options = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", dir_.c_str(), "tmpfs", 0, options.c_str()) == 0) {
      mounted_ = true;
    } else {
      why_not_ = std::strerror(errno);
    }
  }
  ~SmallFilesystem() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  SmallFilesystem(const SmallFilesystem&) = delete;
  SmallFilesystem& operator=(const SmallFilesystem&) = delete;
  bool mounted() const { return mounted_; }
  const std::string& why_not() const { return why_not_; }
  const fs::path& path() const { return dir_; }
  fs::path operator/(const std::string& name) const { return dir_ / name; }

 private:
  fs::path dir_;
  bool mounted_ = false;
  std::string why_not_;
};

#define MALLEUS_REQUIRE_SMALL_FILESYSTEM(small)                            \
  if (!(small).mounted())                                                  \
  GTEST_SKIP() << "cannot mount a small tmpfs here (" << (small).why_not() \
               << "): the full-disk cases need root and permission to mount"

}  // namespace malleus::testing
