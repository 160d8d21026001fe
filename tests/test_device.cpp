// The choice of what a rank computes on (src/device): --backend, --devices and the local rank that
// picks a device, with one test per kind of bad value; and that a binary without CUDA says how to
// build one with it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "device/device.h"

using namespace malleus;
using namespace malleus::device;

namespace {

// The message `body` throws, or "" when it returns.
template <typename Body>
std::string error_of(Body&& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Sets the launcher variables for the scope of a test, restoring what was there.
class Environment {
 public:
  explicit Environment(const std::map<std::string, std::optional<std::string>>& values) {
    for (const auto& [name, value] : values) {
      const char* before = std::getenv(name.c_str());
      saved_[name] = before ? std::optional<std::string>(before) : std::nullopt;
      set(name, value);
    }
  }
  ~Environment() {
    for (const auto& [name, value] : saved_) set(name, value);
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

 private:
  static void set(const std::string& name, const std::optional<std::string>& value) {
    if (value) {
      ::setenv(name.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

}  // namespace

TEST(Device, BackendKindIsCpuOrCudaAndAnythingElseIsNamed) {
  EXPECT_EQ(parse_backend_kind("cpu", "--backend"), BackendKind::kCpu);
  EXPECT_EQ(parse_backend_kind("cuda", "--backend"), BackendKind::kCuda);
  EXPECT_STREQ(backend_kind_name(BackendKind::kCuda), "cuda");
  const std::string e = error_of([] { parse_backend_kind("gpu", "--backend"); });
  EXPECT_NE(e.find("--backend: \"gpu\" is not a backend (cpu or cuda)"), std::string::npos) << e;
  EXPECT_NE(error_of([] { parse_backend_kind("CUDA", "--backend"); }), "");
}

TEST(Device, DeviceListsParseAndBadEntriesAreNamed) {
  EXPECT_EQ(parse_devices("", "--devices"), std::vector<int>{});
  EXPECT_EQ(parse_devices("0", "--devices"), std::vector<int>{0});
  EXPECT_EQ(parse_devices("3,0,12", "--devices"), (std::vector<int>{3, 0, 12}));
  EXPECT_EQ(devices_text({3, 0, 12}), "3,0,12");
  const std::map<std::string, std::string> bad = {
      {"0,x", "\"x\" is not a device index"},  {"-1", "\"-1\" is not a device index"},
      {"0,,1", "\"\" is not a device index"},  {" 1", "\" 1\" is not a device index"},
      {"1,", "\"\" is not a device index"},    {"1,1", "device 1 is listed twice"},
      {"99999999999", "is not a device index"}};
  for (const auto& [text, part] : bad) {
    const std::string e = error_of([&] { parse_devices(text, "--devices"); });
    EXPECT_NE(e.find("--devices \"" + text + "\""), std::string::npos) << text << ": " << e;
    EXPECT_NE(e.find(part), std::string::npos) << text << ": " << e;
  }
}

TEST(Device, LocalRankComesFromTheLauncher) {
  {
    Environment none({{"OMPI_COMM_WORLD_LOCAL_RANK", std::nullopt},
                      {"SLURM_LOCALID", std::nullopt},
                      {"MPI_LOCALRANKID", std::nullopt}});
    EXPECT_EQ(local_rank(), 0);
  }
  {
    Environment slurm({{"OMPI_COMM_WORLD_LOCAL_RANK", std::nullopt},
                       {"SLURM_LOCALID", "3"},
                       {"MPI_LOCALRANKID", "5"}});
    EXPECT_EQ(local_rank(), 3);
  }
  {
    // Open MPI's own variable wins (mpirun inside a Slurm allocation sets both).
    Environment both({{"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"SLURM_LOCALID", "0"}});
    EXPECT_EQ(local_rank(), 1);
  }
  {
    Environment hydra({{"OMPI_COMM_WORLD_LOCAL_RANK", std::nullopt},
                       {"SLURM_LOCALID", std::nullopt},
                       {"MPI_LOCALRANKID", "2"}});
    EXPECT_EQ(local_rank(), 2);
  }
  {
    Environment bad({{"OMPI_COMM_WORLD_LOCAL_RANK", "one"}, {"SLURM_LOCALID", std::nullopt}});
    const std::string e = error_of([] { local_rank(); });
    EXPECT_NE(e.find("OMPI_COMM_WORLD_LOCAL_RANK=\"one\" is not a local rank"), std::string::npos)
        << e;
  }
}

TEST(Device, EachRankTakesADeviceInTurnAndRanksMayShareOne) {
  // One device: every rank of the node on it.
  for (int r = 0; r < 4; ++r) EXPECT_EQ(pick_device({}, r, 1), 0) << r;
  // Every device, in turn.
  EXPECT_EQ(pick_device({}, 0, 2), 0);
  EXPECT_EQ(pick_device({}, 1, 2), 1);
  EXPECT_EQ(pick_device({}, 2, 2), 0);
  // A list, in its order, in turn.
  const std::vector<int> list = {3, 1};
  EXPECT_EQ(pick_device(list, 0, 4), 3);
  EXPECT_EQ(pick_device(list, 1, 4), 1);
  EXPECT_EQ(pick_device(list, 2, 4), 3);
  EXPECT_EQ(pick_device({0}, 5, 2), 0);
}

TEST(Device, AMissingDeviceIsNamedWithWhatTheNodeHas) {
  std::string e = error_of([] { pick_device({0, 2}, 0, 2); });
  EXPECT_NE(e.find("--devices 0,2: device 2 is not on this node, which has 2 CUDA devices "
                   "(indices 0 to 1)"),
            std::string::npos)
      << e;
  e = error_of([] { pick_device({1}, 0, 1); });
  EXPECT_NE(e.find("which has 1 CUDA device (index 0)"), std::string::npos) << e;
  e = error_of([] { pick_device({}, 0, 0); });
  EXPECT_NE(e.find("no CUDA device found"), std::string::npos) << e;
}

TEST(Device, TheCpuChoiceMakesCpuBackendsAsOftenAsAsked) {
  const Device cpu = open_device(BackendChoice{}, 0);
  EXPECT_EQ(cpu.kind, BackendKind::kCpu);
  EXPECT_EQ(cpu.description, "cpu");
  const auto reference = backend::make_cpu_backend<float>(2);
  for (int i = 0; i < 2; ++i) {
    const auto made = cpu.make_backend(2);
    EXPECT_EQ(made->name(), reference->name());
    EXPECT_EQ(made->num_threads(), 2);
  }
}

TEST(Device, CudaInABinaryWithoutItSaysHowToBuildIt) {
  if (built_with_cuda()) GTEST_SKIP() << "this binary has the CUDA backend";
  BackendChoice choice;
  choice.kind = BackendKind::kCuda;
  const std::string e = error_of([&] { open_device(choice, 0); });
  EXPECT_NE(e.find("--backend cuda: this malleus was built without CUDA"), std::string::npos) << e;
  EXPECT_NE(e.find("-DMALLEUS_BUILD_CUDA=ON"), std::string::npos) << e;
  EXPECT_NE(e.find("docs/cuda.md"), std::string::npos) << e;
}
