// Recovery from lost ranks: the watchdog's diagnosis (watchdog/watchdog.h), its probes between
// hosts and the partition rule (watchdog/probe.h, watchdog/partition.h), and the supervisor's
// reading of hostfiles and of how a job ended (launch/supervisor.h, launch/job_end.h). The
// end-to-end runs under `malleus launch` are in test_recovery_runs.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <map>
#include <thread>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint/memory_checkpoint.h"
#include "checkpoint/memory_gather.h"
#include "common/files.h"
#include "common/json.h"
#include "launch/job_end.h"
#include "launch/supervisor.h"
#include "test_util.h"
#include "watchdog/watchdog.h"

using namespace malleus;
using malleus::testing::error_of;
using malleus::testing::ScratchDir;

namespace {

watchdog::Heartbeat beat(int rank, int64_t step, const std::string& phase, double at) {
  watchdog::Heartbeat h;
  h.rank = rank;
  h.pid = 1000 + rank;
  h.host = "node0";
  h.step = step;
  h.phase = phase;
  h.phase_since = at - 1;
  h.beat = at;
  return h;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

TEST(Watchdog, NamesTheRankWhoseHeartbeatStopped) {
  const double now = 1000;
  // Ranks 0, 1 and 3 wait in step 7, alive; rank 2 last beat 30 s ago.
  const auto d =
      watchdog::diagnose_hang({beat(0, 7, "step", now - 0.5), beat(1, 7, "step", now - 0.2),
                               beat(2, 7, "step", now - 30), beat(3, 7, "step", now - 0.4)},
                              now, 5);
  EXPECT_EQ(d.lost_ranks, std::vector<int>{2});
  EXPECT_NE(d.message.find("rank 2: no heartbeat for 30.0 s"), std::string::npos) << d.message;
  EXPECT_EQ(d.ranks[2]["status"], "stale");
  EXPECT_EQ(d.ranks[0]["status"], "waiting");
}

TEST(Watchdog, NamesRanksBehindTheOthersAndMissingOnes) {
  const double now = 1000;
  // Rank 1 is alive but still in step 6's checkpoint while the others are in step 7; rank 3
  // never wrote a heartbeat.
  const auto d = watchdog::diagnose_hang({beat(0, 7, "step", now), beat(1, 6, "checkpoint", now),
                                          beat(2, 7, "step", now), std::nullopt},
                                         now, 5);
  EXPECT_EQ(d.lost_ranks, (std::vector<int>{1, 3}));
  EXPECT_NE(d.message.find("rank 1: still in the checkpoint of step 6"), std::string::npos)
      << d.message;
  EXPECT_NE(d.message.find("rank 3: no heartbeat"), std::string::npos) << d.message;
  // Within a step, the phases are ordered: an evaluation comes before the checkpoint.
  const auto e =
      watchdog::diagnose_hang({beat(0, 7, "checkpoint", now), beat(1, 7, "eval", now)}, now, 5);
  EXPECT_EQ(e.lost_ranks, std::vector<int>{1});
}

TEST(Watchdog, WaitsForARankBehindUntilItsOwnPhaseReachesItsLimit) {
  const double now = 1000;
  // Ranks 0 and 2 wait in step 3's checkpoint; rank 1 is alive, still in step 3 since now - 1
  // (a straggling step). Steps may take 30 s: rank 1 is due at now - 1 + 30.
  const auto heartbeats = std::vector<std::optional<watchdog::Heartbeat>>{
      beat(0, 3, "checkpoint", now), beat(1, 3, "step", now), beat(2, 3, "checkpoint", now)};
  const auto d = watchdog::diagnose_hang(heartbeats, now, 5);
  ASSERT_EQ(d.lost_ranks, std::vector<int>{1});
  const auto limit_of = [](const std::string& phase) { return phase == "step" ? 30.0 : 2.0; };
  EXPECT_DOUBLE_EQ(watchdog::behind_ranks_due(d, heartbeats, limit_of), now - 1 + 30);
  // A stale or missing rank is not waited for: nothing is due.
  const auto stale = std::vector<std::optional<watchdog::Heartbeat>>{
      beat(0, 3, "checkpoint", now), beat(1, 3, "step", now), beat(2, 3, "step", now - 60)};
  const auto e = watchdog::diagnose_hang(stale, now, 5);
  ASSERT_EQ(e.lost_ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(watchdog::behind_ranks_due(e, stale, limit_of), 0);
  const auto missing = std::vector<std::optional<watchdog::Heartbeat>>{
      beat(0, 3, "checkpoint", now), beat(1, 3, "step", now), std::nullopt};
  EXPECT_EQ(watchdog::behind_ranks_due(watchdog::diagnose_hang(missing, now, 5), missing, limit_of),
            0);
  // Nobody named: nothing to wait for.
  const auto same = std::vector<std::optional<watchdog::Heartbeat>>{beat(0, 3, "step", now),
                                                                    beat(1, 3, "step", now)};
  EXPECT_EQ(watchdog::behind_ranks_due(watchdog::diagnose_hang(same, now, 5), same, limit_of), 0);
}

TEST(Watchdog, GivesARankBehindItsOwnLimitBeforeEndingTheJob) {
  ScratchDir dir;
  const auto run = dir.path();
  std::filesystem::create_directories(watchdog::heartbeat_dir(run));
  // This process is rank 0 of 2. It makes three steps of 0.3 s (a step's limit becomes
  // 10 x 0.3 = 3 s), then waits in step 3's checkpoint, whose limit is the 0.5 s floor. Rank 1 is
  // alive (it keeps beating) but stays in step 3: it is given until its step's 3 s limit. Rank 1
  // beats every 50 ms from this process's own thread; the watchdog's beat interval of 0.2 s calls
  // a heartbeat stale after 0.6 s (3 intervals), which a thread that sleeps 50 ms does not reach
  // on a loaded machine (at 0.05 s, 0.25 s: a first-tier run at -j 4 saw a 0.3 s gap, rank 1
  // taken for dead).
  EXPECT_EXIT(
      {
        watchdog::Watchdog watchdog(run, 0, 2,
                                    {.floor_s = 0.5, .multiple = 10, .beat_interval_s = 0.2});
        auto behind = beat(1, 1, "step", unix_now());
        for (int step = 1; step <= 3; ++step) {
          watchdog.enter("step", step);
          behind.step = step;
          behind.phase_since = behind.beat = unix_now();
          write_file_atomic(watchdog::heartbeat_dir(run) / "rank_00001.json",
                            behind.to_json().dump());
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
        }
        watchdog.enter("checkpoint", 3);
        for (int i = 0; i < 400; ++i) {
          behind.beat = unix_now();
          write_file_atomic(watchdog::heartbeat_dir(run) / "rank_00001.json",
                            behind.to_json().dump());
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(watchdog::kHangExitCode), "rank 1: still in step 3");
  const Json report = read_json_file(watchdog::hang_report_path(run).string());
  EXPECT_EQ(report["lost_ranks"], Json::array({1}));
  EXPECT_EQ(report["phase"], "checkpoint");
  EXPECT_DOUBLE_EQ(report["limit_s"].get<double>(), 0.5);
  // Not at the checkpoint's own 0.5 s, but once rank 1's step had its ~3 s (it entered step 3
  // 0.3 s before this rank entered the checkpoint).
  EXPECT_GE(report["waited_s"].get<double>(), 2.4);
  EXPECT_LT(report["waited_s"].get<double>(), 10.0);
}

TEST(Watchdog, NamesNobodyWhenEveryRankWaitsAtTheSamePoint) {
  const double now = 1000;
  const auto d =
      watchdog::diagnose_hang({beat(0, 3, "step", now), beat(1, 3, "step", now - 1)}, now, 5);
  EXPECT_TRUE(d.lost_ranks.empty());
  EXPECT_NE(d.message.find("no rank to blame"), std::string::npos) << d.message;
}

TEST(Watchdog, EndsTheProcessNamingTheStaleRank) {
  ScratchDir dir;
  const auto run = dir.path();
  // Rank 1 of a 2-rank job beat once, long ago; this process is rank 0 in step 1.
  std::filesystem::create_directories(watchdog::heartbeat_dir(run));
  write_file_atomic(watchdog::heartbeat_dir(run) / "rank_00001.json",
                    beat(1, 1, "step", unix_now() - 60).to_json().dump());
  // The default ("fast") death test forks here, so the child writes into this very directory.
  EXPECT_EXIT(
      {
        watchdog::Watchdog watchdog(run, 0, 2,
                                    {.floor_s = 0.5, .multiple = 10, .beat_interval_s = 0.05});
        watchdog.enter("step", 1);
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(watchdog::kHangExitCode), "rank 1: no heartbeat for");
  const Json report = read_json_file(watchdog::hang_report_path(run).string());
  EXPECT_EQ(report["lost_ranks"], Json::array({1}));
  EXPECT_EQ(report["detected_by"], 0);
  EXPECT_EQ(report["phase"], "step");
  EXPECT_GE(report["waited_s"].get<double>(), 0.5);
  EXPECT_LT(report["waited_s"].get<double>(), 10.0);
  // Where the stuck thread was: in the sleep above (libc's nanosleep, named by dladdr).
  EXPECT_NE(report["stack"].get<std::string>().find("nanosleep"), std::string::npos)
      << report["stack"];
}

TEST(Watchdog, LeavesPhasesThatEndInTimeAlone) {
  ScratchDir dir;
  watchdog::Watchdog watchdog(dir.path(), 0, 2,
                              {.floor_s = 0.5, .multiple = 10, .beat_interval_s = 0.05});
  // Twenty steps of 0.1 s each, under a limit of max(0.5 s, 10 × median): no alarm.
  for (int step = 1; step <= 20; ++step) {
    watchdog.enter("step", step);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GE(watchdog.limit_s("step"), 0.9);  // 10 × ~0.1 s
  EXPECT_EQ(watchdog.limit_s("eval"), 0.5);  // never seen: the floor
  EXPECT_FALSE(std::filesystem::exists(watchdog::hang_report_path(dir.path())));
  const Json own =
      read_json_file((watchdog::heartbeat_dir(dir.path()) / "rank_00000.json").string());
  EXPECT_EQ(own["step"], 20);
  EXPECT_EQ(own["phase"], "step");
}

// A phase's start is in the heartbeat at once, not at the next beat: a short phase (a 0.5 s
// migration) is seen by the other ranks' diagnosis, and by a test that acts in it.
TEST(Watchdog, APhasesStartIsInTheHeartbeatBeforeTheNextBeat) {
  ScratchDir dir;
  watchdog::Watchdog watchdog(dir.path(), 0, 1,
                              {.floor_s = 60, .multiple = 10, .beat_interval_s = 30});
  const auto path = watchdog::heartbeat_dir(dir.path()) / "rank_00000.json";
  for (const auto& [phase, step] : {std::pair{"step", 1}, {"migration", 1}, {"step", 2}}) {
    const auto start = std::chrono::steady_clock::now();
    watchdog.enter(phase, step);
    Json beat;
    while (std::chrono::steady_clock::now() - start < std::chrono::seconds(5)) {
      beat = read_json_file(path.string());
      if (beat["phase"] == phase && beat["step"] == step) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(beat["phase"], phase);
    EXPECT_EQ(beat["step"], step);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << phase;
  }
}

// ---- The probes between hosts and the partition rule ----

namespace {

// A listening socket on 127.0.0.1 that never accepts, its queue filled: a SYN to it is dropped
// (Linux drops SYNs to a listener whose accept queue is full), so a probe of it times out, as
// over a link that is down. Closes everything at the end.
class Unanswering {
 public:
  Unanswering() {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof a;
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(listener_, 0), 0);
    EXPECT_EQ(::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &size), 0);
    port_ = ntohs(a.sin_port);
    for (int i = 0; i < 3; ++i) {  // backlog 0 takes one; the rest wait in SYN_SENT
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      fillers_.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ~Unanswering() {
    for (int fd : fillers_) ::close(fd);
    ::close(listener_);
  }
  int port() const { return port_; }

 private:
  int listener_ = -1, port_ = 0;
  std::vector<int> fillers_;
};

// Waits up to `seconds` for `done`.
template <typename Done>
bool eventually(double seconds, Done&& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

watchdog::HostReport report(const std::string& host, std::map<std::string, watchdog::Reach> reach) {
  return {host, std::move(reach)};
}

}  // namespace

TEST(Probe, ReachesAListenerAndARefusingHostButNotASilentOne) {
  using watchdog::Endpoint;
  watchdog::Prober target({"127.0.0.1"});
  ASSERT_EQ(target.endpoints().size(), 1u);
  EXPECT_EQ(target.endpoints()[0].address, "127.0.0.1");
  // A port nobody listens on: the host answers with a reset, so the path is there.
  int closed_port = 0;
  {
    watchdog::Prober gone({"127.0.0.1"});
    closed_port = gone.endpoints()[0].port;
  }
  Unanswering silent;
  watchdog::Prober prober({"127.0.0.1"});
  EXPECT_FALSE(prober.probing());
  prober.set_targets({{"up", target.endpoints()},
                      {"refusing", {{"127.0.0.1", closed_port}}},
                      {"silent", {{"127.0.0.1", silent.port()}}}});
  EXPECT_TRUE(prober.probing());
  ASSERT_TRUE(eventually(10, [&] {
    const auto r = prober.reach();
    return r.at("up").last_ok > 0 && r.at("refusing").last_ok > 0 && r.at("silent").last_fail > 0;
  }));
  const auto r = prober.reach();
  EXPECT_EQ(r.at("up").last_fail, 0);
  EXPECT_EQ(r.at("silent").last_ok, 0);
  // A failed probe took the whole timeout (the SYN went unanswered), counted from its start.
  EXPECT_GE(r.at("silent").last_fail - r.at("silent").since, watchdog::Prober::kTimeoutS - 0.05);
  EXPECT_EQ(r.at("silent").failures, r.at("silent").probes);
  EXPECT_EQ(r.at("silent").spells, 1);
  EXPECT_EQ(r.at("up").failures, 0);
  EXPECT_GE(r.at("up").probes, 1);
  // New targets start fresh records; none stops probing.
  prober.set_targets({{"up", target.endpoints()}});
  EXPECT_EQ(prober.reach().size(), 1u);
  prober.set_targets({});
  EXPECT_FALSE(prober.probing());
  EXPECT_EQ(Endpoint::parse("198.18.13.1:40123", "x"), (Endpoint{"198.18.13.1", 40123}));
  EXPECT_EQ(error_of([] { Endpoint::parse("node0:80", "rank_00001.json"); }),
            "rank_00001.json: \"node0:80\" is not an address:port like 198.18.13.1:40123");
}

TEST(Probe, KeepsTheAddressesOfTheJobsNetwork) {
  // Whatever this machine's interfaces are: each address is its own /32, and a range or name
  // that matches none keeps none; loopback is never the job's network.
  for (const std::string& a : watchdog::job_addresses("")) {
    EXPECT_EQ(watchdog::job_addresses(a + "/32"), std::vector<std::string>{a});
  }
  EXPECT_TRUE(watchdog::job_addresses("127.0.0.0/8").empty());
  EXPECT_TRUE(watchdog::job_addresses("no-such-interface0").empty());
  EXPECT_EQ(error_of([] { watchdog::job_addresses("198.18.13.0/33"); }),
            "watchdog network \"198.18.13.0/33\": \"198.18.13.0/33\" is neither an interface "
            "name nor a CIDR range like 198.18.13.0/24");
}

TEST(Partition, AHostNoProbeReachedForTheGraceIsCutOff) {
  const double now = 1000;
  // h0 probed h1 from 990 on: nothing since 992 (its last success); h1 saw the same of h0.
  const watchdog::Reach down{990, 992, 999.8, 30, 22, 1};
  const auto p = watchdog::find_partition(
      {"h0", "h1"}, {report("h0", {{"h1", down}}), report("h1", {{"h0", down}})}, now, 3);
  EXPECT_EQ(p.kept, std::vector<std::string>{"h0"});  // even halves: rank 0's host stays
  EXPECT_EQ(p.cut_off, std::vector<std::string>{"h1"});
  EXPECT_EQ(p.message(), "host h1 is cut off (h0 – h1: no probe connected for 8.0 s)");
  // One side's report is enough (h1's leader may be gone with its heartbeat).
  EXPECT_EQ(watchdog::find_partition({"h0", "h1"}, {report("h0", {{"h1", down}})}, now, 3).cut_off,
            std::vector<std::string>{"h1"});
  // Not yet for the grace: failing, and the watchdog waits.
  const auto young = watchdog::find_partition({"h0", "h1"}, {report("h0", {{"h1", down}})}, 994, 3);
  EXPECT_FALSE(young.partitioned());
  EXPECT_EQ(young.failing, std::vector<std::string>{"h0 – h1: probes failing for 2.0 s"});
}

TEST(Partition, ALossyLinkCountsAsCutAndAHealedOneDoesNot) {
  const double now = 1000;
  const auto judged = [&](watchdog::Reach r) {
    return watchdog::find_partition({"h0", "h1"}, {report("h0", {{"h1", r}})}, now, 3);
  };
  // 6 of 40 probes failed, in 4 spells, the latest 1 s ago; the latest probe connected: lossy,
  // so cut off.
  const auto lossy = judged({990, 999.9, 999, 40, 6, 4});
  EXPECT_EQ(lossy.cut_off, std::vector<std::string>{"h1"});
  EXPECT_EQ(lossy.lossy, std::vector<std::string>{"h0 – h1: 6 of 40 probes failed, in 4 spells"});
  EXPECT_EQ(lossy.message(), "host h1 is cut off (h0 – h1: 6 of 40 probes failed, in 4 spells)");
  // Fewer than one in ten: not lossy (a probe lost now and then), only healed.
  const auto rare = judged({990, 999.9, 999, 40, 2, 2});
  EXPECT_FALSE(rare.partitioned());
  EXPECT_EQ(rare.healed, std::vector<std::string>{"h0 – h1"});
  // One spell (down, then up again a second ago): healed, however many probes it cost.
  const auto back = judged({990, 999.9, 999, 40, 20, 1});
  EXPECT_FALSE(back.partitioned());
  EXPECT_EQ(back.healed, std::vector<std::string>{"h0 – h1"});
  // Its latest probe failed, 0.5 s after one connected: failing, judged again shortly.
  const auto failing = judged({990, 999.5, 999.9, 40, 6, 4});
  EXPECT_FALSE(failing.partitioned());
  EXPECT_EQ(failing.failing.size(), 1u);
  // Lossy spells long ago, every probe connected for the last 4 s: healed, nothing cut.
  const auto healed = judged({990, 999.9, 996, 40, 16, 5});
  EXPECT_FALSE(healed.partitioned());
  EXPECT_TRUE(healed.failing.empty() && healed.lossy.empty());
  EXPECT_EQ(healed.healed, std::vector<std::string>{"h0 – h1"});
  // A phase given more time and still held: the link whose probes failed is cut after all (2 of
  // 40 is below the lossy share); a link whose probes never failed is not.
  const auto held = watchdog::find_partition(
      {"h0", "h1"}, {report("h0", {{"h1", {990, 999.9, 999, 40, 2, 2}}})}, now, 3, true);
  EXPECT_EQ(held.cut_off, std::vector<std::string>{"h1"});
  EXPECT_EQ(held.lossy,
            std::vector<std::string>{"h0 – h1: 2 of 40 probes failed, and the phase still waits"});
  EXPECT_TRUE(held.healed.empty());
  EXPECT_FALSE(watchdog::find_partition(
                   {"h0", "h1"}, {report("h0", {{"h1", {990, 999.9, 0, 40, 0, 0}}})}, now, 3, true)
                   .partitioned());
  // Probes that never failed: nothing at all.
  const auto fine = judged({990, 999.9, 0, 40, 0, 0});
  EXPECT_TRUE(fine.cut.empty() && fine.lossy.empty() && fine.failing.empty() &&
              fine.healed.empty());
}

TEST(Partition, TheHostCutFromTheOthersGoesAndTheLargestGroupStays) {
  const double now = 1000;
  const watchdog::Reach up{990, 999.9, 0, 40, 0, 0}, down{990, 0, 999.9, 40, 40, 1};
  // Three hosts: h1's link is down, so h0 and h2 reach each other but neither reaches h1.
  const auto p = watchdog::find_partition(
      {"h0", "h1", "h2"},
      {report("h0", {{"h1", down}, {"h2", up}}), report("h2", {{"h0", up}, {"h1", down}})}, now, 3);
  EXPECT_EQ(p.kept, (std::vector<std::string>{"h0", "h2"}));
  EXPECT_EQ(p.cut_off, std::vector<std::string>{"h1"});
  EXPECT_EQ(p.message(),
            "host h1 is cut off (h0 – h1: no probe connected for 10.0 s, h1 – h2: no probe "
            "connected for 10.0 s)");
  // Rank 0's host alone on its side: the larger group stays.
  const auto q = watchdog::find_partition(
      {"h0", "h1", "h2"},
      {report("h0", {{"h1", down}, {"h2", down}}), report("h1", {{"h0", down}, {"h2", up}})}, now,
      3);
  EXPECT_EQ(q.kept, (std::vector<std::string>{"h1", "h2"}));
  EXPECT_EQ(q.cut_off, std::vector<std::string>{"h0"});
}

TEST(Partition, NamesTheRanksOfTheHostsCutOff) {
  std::vector<std::optional<watchdog::Heartbeat>> beats;
  for (int r = 0; r < 4; ++r) {
    watchdog::Heartbeat h = beat(r, 7, "step", 1000);
    h.host = r < 2 ? "h0" : "h1";
    beats.push_back(h);
  }
  watchdog::Partition p;
  p.kept = {"h0"};
  p.cut_off = {"h1"};
  p.cut = {"h0 – h1: no probe connected for 5.0 s"};
  const auto d = watchdog::diagnose_partition(beats, p);
  EXPECT_EQ(d.lost_ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(d.message,
            "host h1 is cut off (h0 – h1: no probe connected for 5.0 s): ranks 2, 3 left out");
  EXPECT_EQ(d.ranks[2]["status"], "cut off");
  EXPECT_EQ(watchdog::job_hosts(beats), (std::vector<std::string>{"h0", "h1"}));
}

TEST(Partition, EachHostsLeaderProbesTheOtherLeadersNotTheRanksHeldWithIt) {
  std::vector<std::optional<watchdog::Heartbeat>> beats(4);
  for (int r : {0, 1, 3}) {  // rank 2 has no heartbeat: rank 3 leads h1
    watchdog::Heartbeat h = beat(r, 7, "step", 1000);
    h.host = r < 2 ? "h0" : "h1";
    h.probe = {{"198.18.13." + std::to_string(r < 2 ? 1 : 2), 4000 + r}};
    beats[static_cast<size_t>(r)] = h;
  }
  using Targets = std::map<std::string, std::vector<watchdog::Endpoint>>;
  EXPECT_EQ(watchdog::probe_targets(beats, 0), (Targets{{"h1", {{"198.18.13.2", 4003}}}}));
  EXPECT_EQ(watchdog::probe_targets(beats, 3), (Targets{{"h0", {{"198.18.13.1", 4000}}}}));
  EXPECT_TRUE(watchdog::probe_targets(beats, 1).empty());
  // What a leader found travels in its heartbeat.
  beats[0]->reach = {{"h1", {990, 992, 999, 30, 21, 3}}};
  const auto back = watchdog::Heartbeat::from_json(beats[0]->to_json(), "rank_00000.json");
  EXPECT_EQ(back.probe, beats[0]->probe);
  EXPECT_EQ(back.reach.at("h1").last_ok, 992);
  EXPECT_EQ(back.reach.at("h1").failures, 21);
  EXPECT_EQ(back.reach.at("h1").spells, 3);
  const auto reports = watchdog::leader_reports(beats, 1000, 5);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].host, "h0");
  EXPECT_TRUE(watchdog::leader_reports(beats, 1010, 5).empty());  // its heartbeat went stale
}

TEST(Partition, ARankHeldInAStepItsLeaderFinishedProbesForItsHost) {
  // 70 % of host h1's packets lost: the step's all-reduce ended on ranks 0-2, which wait in the
  // memory save (not overdue), while its last bytes to rank 3 are resent. Rank 3 is the only rank
  // held: it probes for h1, and its report stands for h1 (CI once found rank 3 "hung", with no
  // probe run, and restarted the job across the lossy link).
  std::vector<std::optional<watchdog::Heartbeat>> beats(4);
  for (int r = 0; r < 4; ++r) {
    watchdog::Heartbeat h = beat(r, 7, r == 3 ? "step" : "checkpoint", 1000);
    h.host = r < 2 ? "h0" : "h1";
    h.probe = {{"198.18.13." + std::to_string(r < 2 ? 1 : 2), 4000 + r}};
    beats[static_cast<size_t>(r)] = h;
  }
  using Targets = std::map<std::string, std::vector<watchdog::Endpoint>>;
  EXPECT_EQ(watchdog::probe_targets(beats, 3), (Targets{{"h0", {{"198.18.13.1", 4000}}}}));
  EXPECT_TRUE(watchdog::probe_targets(beats, 1).empty());  // with its leader, in the save
  beats[3]->reach = {{"h0", {995, 996, 999.5, 18, 16, 2}}};
  const auto reports = watchdog::leader_reports(beats, 1000, 5);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].host, "h1");
  // What its probes found cuts h1 off: the link is lossy, not the rank hung.
  const watchdog::Partition p = watchdog::find_partition({"h0", "h1"}, reports, 1000, 3);
  EXPECT_EQ(p.cut_off, std::vector<std::string>{"h1"}) << p.message();
}

TEST(Launch, ReadsHostfiles) {
  const auto hosts = launch::parse_hostfile(
      "# cluster\nnode0 slots=2\n\nnode1 slots=4 max_slots=8  # big\nnode2\n", "hosts");
  ASSERT_EQ(hosts.size(), 3u);
  EXPECT_EQ(hosts[0].name, "node0");
  EXPECT_EQ(hosts[0].slots, 2);
  EXPECT_EQ(hosts[1].slots, 4);
  EXPECT_EQ(hosts[2].slots, 1);
  EXPECT_EQ(error_of([] { launch::parse_hostfile("node0 slots=x\n", "hosts"); }),
            "hosts:1: \"slots=x\" must give a positive whole number of slots");
  EXPECT_EQ(error_of([] { launch::parse_hostfile("node0 cpus=2\n", "hosts"); }),
            "hosts:1: \"cpus=2\" is not understood (expected slots=N)");
  EXPECT_EQ(error_of([] { launch::parse_hostfile("# nothing\n", "hosts"); }),
            "hosts lists no hosts");
}

TEST(Launch, TellsLostRanksFromStopsAndErrors) {
  using Kind = launch::Outcome::Kind;
  EXPECT_EQ(launch::classify(0, "", std::nullopt).kind, Kind::kFinished);

  // What Open MPI 4.1 prints when rank 3 is killed with SIGKILL.
  const std::string killed =
      "step     5/20 | loss 5.1\n"
      "--------------------------------------------------------------------------\n"
      "mpirun noticed that process rank 3 with PID 4242 on node box exited on signal 9 "
      "(Killed).\n"
      "--------------------------------------------------------------------------\n";
  const auto k = launch::classify(137, killed, std::nullopt);
  EXPECT_EQ(k.kind, Kind::kLost);
  EXPECT_EQ(k.reason, "killed");
  EXPECT_EQ(k.lost_ranks, std::vector<int>{3});

  // The watchdog's report wins over mpirun's words about the rank that ended the job.
  const Json hang = {{"lost_ranks", {2}}, {"message", "watchdog: ... rank 2: no heartbeat"}};
  const auto h = launch::classify(watchdog::kHangExitCode, "exited with status 87", hang);
  EXPECT_EQ(h.kind, Kind::kLost);
  EXPECT_EQ(h.reason, "hung");
  EXPECT_EQ(h.lost_ranks, std::vector<int>{2});

  // A partition: the ranks of the hosts cut off.
  const Json cut = {{"lost_ranks", {2, 3}},
                    {"cut_off_hosts", {"h1"}},
                    {"message", "watchdog: ... host h1 is cut off (...)"}};
  const auto c = launch::classify(watchdog::kHangExitCode, "", cut);
  EXPECT_EQ(c.kind, Kind::kLost);
  EXPECT_EQ(c.reason, "cut off");
  EXPECT_EQ(c.lost_ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(c.cut_off_hosts, std::vector<std::string>{"h1"});

  EXPECT_EQ(launch::classify(128 + SIGUSR1, "stopped by SIGUSR1", std::nullopt).kind,
            Kind::kStopped);
  const auto e = launch::classify(1, "error: [rank 0] bad.json: no such file\n", std::nullopt);
  EXPECT_EQ(e.kind, Kind::kFailed);
  EXPECT_EQ(e.detail, "error: [rank 0] bad.json: no such file");
}

TEST(Launch, SeesMpirunAbortingAJob) {
  EXPECT_EQ(launch::job_abort_sign("step 5\nPrimary job  terminated normally, but 1 process "
                                   "returned\na non-zero exit code. Per user-direction, the job "
                                   "has been aborted.\n"),
            "a non-zero exit code. Per user-direction, the job has been aborted.");
  EXPECT_TRUE(
      launch::job_abort_sign("mpirun noticed that process rank 3 with PID 4242 on node "
                             "box exited on signal 9 (Killed).\n"));
  EXPECT_FALSE(launch::job_abort_sign("step 5/20 | loss 5.1\nsaved checkpoint run/step_5\n"));
}

TEST(Launch, EndsAProcessTreeAndNamesTheRanksStillBeating) {
  // A shell whose child and grandchild sleep: all three end.
  const pid_t root = ::fork();
  ASSERT_GE(root, 0);
  if (root == 0) {
    ::execl("/bin/sh", "sh", "-c", "sleep 60 & (sleep 60 & wait) & wait", nullptr);
    std::_Exit(127);
  }
  ASSERT_TRUE(eventually(10, [&] { return launch::process_tree(root).size() >= 4; }));
  const auto tree = launch::process_tree(root);
  EXPECT_EQ(tree.front(), root);
  const auto killed = launch::kill_process_tree(root);
  EXPECT_EQ(killed.size(), tree.size());
  int status = 0;
  ASSERT_EQ(::waitpid(root, &status, 0), root);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  for (pid_t pid : tree) {
    EXPECT_TRUE(eventually(10, [&] { return launch::process_tree(pid).empty(); })) << pid;
  }
  // Heartbeats: rank 1 beat after the end, rank 0 before it, rank 2 never.
  ScratchDir dir;
  fs::create_directories(watchdog::heartbeat_dir(dir.path()));
  for (int r : {0, 1}) {
    watchdog::Heartbeat h = beat(r, 7, "step", r == 0 ? 990 : 1010);
    h.host = "h" + std::to_string(r);
    write_file_atomic(
        watchdog::heartbeat_dir(dir.path()) / ("rank_0000" + std::to_string(r) + ".json"),
        h.to_json().dump());
  }
  const auto running = launch::ranks_beating_since(dir.path(), 3, 1000);
  ASSERT_EQ(running.size(), 1u);
  EXPECT_EQ(running[0].rank, 1);
  EXPECT_EQ(launch::describe(running), "rank 1 (pid 1001 on h1)");
}

TEST(MemoryHolders, PeersAreOnAnotherHostWhereThereIsOne) {
  // One host: the next rank holds a rank's copy, and nobody keeps a second copy of their own.
  for (int r = 0; r < 4; ++r) {
    const auto h = checkpoint::memory_holders({0, 0, 0, 0}, r);
    EXPECT_EQ(h.peer, (r + 1) % 4);
    EXPECT_EQ(h.source, (r + 3) % 4);
    EXPECT_FALSE(h.own_copy);
  }
  // Two hosts of two ranks, listed out of order: every copy crosses to the other host, and each
  // rank keeps its own too, so that every shard is on both hosts.
  const std::vector<int> hosts{0, 1, 0, 1};
  std::vector<int> held_by(4, -1);
  for (int r = 0; r < 4; ++r) {
    const auto h = checkpoint::memory_holders(hosts, r);
    EXPECT_NE(hosts[static_cast<size_t>(h.peer)], hosts[static_cast<size_t>(r)]) << "rank " << r;
    EXPECT_TRUE(h.own_copy);
    EXPECT_EQ(checkpoint::memory_holders(hosts, h.peer).source, r);
    held_by[static_cast<size_t>(h.peer)] = r;
  }
  EXPECT_EQ(std::count(held_by.begin(), held_by.end(), -1), 0);  // each holds exactly one copy
  // Alone: a rank holds its own copy.
  const auto alone = checkpoint::memory_holders({0}, 0);
  EXPECT_EQ(alone.peer, 0);
  EXPECT_TRUE(alone.own_copy);
  // Uneven hosts (3 + 1): the rank alone on its host sends its copy to the larger one, whose
  // first rank sends its own over.
  EXPECT_EQ(checkpoint::memory_holders({0, 0, 0, 1}, 3).peer, 2);
  EXPECT_EQ(checkpoint::memory_holders({0, 0, 0, 1}, 0).peer, 3);
}

TEST(MemoryCopyBytes, BuffersAndFilesAreWhatARankSendsReceivesAndWrites) {
  const std::vector<int64_t> shards{10, 20, 30, 40};
  // One host: rank 0 sends its 10 bytes to rank 1 and receives rank 3's 40, which it writes;
  // two step directories while a save replaces the last.
  const auto one_host = checkpoint::memory_copy_bytes({0, 0, 0, 0}, 0, shards);
  EXPECT_EQ(one_host.buffers, 10 + 40);
  EXPECT_EQ(one_host.files, 2 * 40);
  // Two hosts of two: rank 0's peer and source are rank 2, across; it also writes its own shard.
  const auto two_hosts = checkpoint::memory_copy_bytes({0, 0, 1, 1}, 0, shards);
  EXPECT_EQ(two_hosts.buffers, 10 + 30);
  EXPECT_EQ(two_hosts.files, 2 * (30 + 10));
  EXPECT_EQ(two_hosts.total(), 120);
  // Alone: its own shard, in a buffer and in memory.
  const auto alone = checkpoint::memory_copy_bytes({0}, 0, {64});
  EXPECT_EQ(alone.buffers, 64);
  EXPECT_EQ(alone.files, 2 * 64);
  EXPECT_NE(error_of([] {
              checkpoint::memory_copy_bytes({0, 0}, 0, {1});
            }).find("1 shards for 2 ranks"),
            std::string::npos);
}

namespace {

// A host's copy of `step` holding `files` (name, bytes); with a manifest listing the rank files of
// `listed` shards of 100 bytes each when `listed` > 0.
checkpoint::HostMemoryCopies::Step step_copy(int64_t step,
                                             const std::map<std::string, int64_t>& files,
                                             int listed = 0) {
  checkpoint::HostMemoryCopies::Step s{step, files, {}};
  for (int r = 0; r < listed; ++r) {
    s.listed["rank_0000" + std::to_string(r) + ".bin"] = 100;
  }
  return s;
}

std::map<std::string, int64_t> shards(const std::vector<int>& ranks, bool with_manifest) {
  std::map<std::string, int64_t> files;
  for (int r : ranks) files["rank_0000" + std::to_string(r) + ".bin"] = 100;
  if (with_manifest) {
    files["manifest.json"] = 40;
    files["tokenizer_meta.json"] = 7;
  }
  return files;
}

}  // namespace

TEST(MemoryCopyPlan, AHostThatLostItsMemoryIsSentEveryFileManifestLast) {
  // Two hosts of two ranks: host 1 holds all four shards; host 0 came back empty.
  const std::vector<checkpoint::HostMemoryCopies> hosts{
      {}, {{step_copy(5, shards({0, 1, 2, 3}, true), 4)}}};
  const auto plan = checkpoint::plan_memory_copies(hosts, 4, "/shm/run");
  ASSERT_TRUE(plan.step.has_value()) << plan.refused;
  EXPECT_EQ(*plan.step, 5);
  ASSERT_EQ(plan.transfers.size(), 6u);  // four shards, the tokenizer, the manifest
  for (const auto& t : plan.transfers) {
    EXPECT_EQ(t.from, 1);
    EXPECT_EQ(t.to, 0);
  }
  EXPECT_EQ(plan.transfers.back().file, "manifest.json");
  EXPECT_EQ(plan.bytes, 4 * 100 + 40 + 7);
  // Nothing to move where every host holds everything.
  const std::vector<checkpoint::HostMemoryCopies> whole{hosts[1], hosts[1]};
  const auto none = checkpoint::plan_memory_copies(whole, 4, "/shm/run");
  EXPECT_EQ(none.step, std::optional<int64_t>(5));
  EXPECT_TRUE(none.transfers.empty());
}

TEST(MemoryCopyPlan, SpreadCopiesAreCompletedFromEachHolderInTurn) {
  // Three hosts, host 0 lost and back empty: host 1 holds shards 0-3, host 2 shards 2-5 (each
  // host's ranks' own and their peers'); only host 2 has the manifest.
  const std::vector<checkpoint::HostMemoryCopies> hosts{
      {},
      {{step_copy(7, shards({0, 1, 2, 3}, false))}},
      {{step_copy(7, shards({2, 3, 4, 5}, true), 6)}}};
  const auto plan = checkpoint::plan_memory_copies(hosts, -1, "/shm/run");
  ASSERT_EQ(plan.step, std::optional<int64_t>(7)) << plan.refused;
  std::map<int, std::vector<std::string>> received;
  std::map<std::string, int> shard_to_0_from;
  for (const auto& t : plan.transfers) {
    received[t.to].push_back(t.file);
    if (t.to == 0) shard_to_0_from[t.file] = t.from;
    EXPECT_NE(t.from, 0);
  }
  EXPECT_EQ(received[0].size(), 8u);  // everything
  EXPECT_EQ(received[1].size(), 4u);  // shards 4 and 5, tokenizer, manifest
  EXPECT_EQ(received[2].size(), 2u);  // shards 0 and 1
  EXPECT_EQ(received[1].back(), "manifest.json");
  // Shards both hold go from whichever has sent less so far: host 1 had sent shards 0 and 1
  // (which only it holds), host 2 only the manifest's bytes.
  EXPECT_EQ(shard_to_0_from["rank_00000.bin"], 1);
  EXPECT_EQ(shard_to_0_from["rank_00002.bin"], 2);
  EXPECT_EQ(shard_to_0_from["rank_00003.bin"], 2);
}

TEST(MemoryCopyPlan, AShardNoHostHoldsIsNamedAndAnOlderCompleteStepTaken) {
  // Step 6's shard 1 is on no host (both holders gone), nor of the right size; step 5 is whole on
  // host 1.
  auto six = shards({0, 2, 3}, true);
  const std::vector<checkpoint::HostMemoryCopies> partial{
      {{step_copy(6, {{"rank_00001.bin", 99}})}}, {{step_copy(6, six, 4)}}};
  const auto refused = checkpoint::plan_memory_copies(partial, 4, "/shm/run");
  EXPECT_FALSE(refused.step.has_value());
  EXPECT_EQ(refused.refused,
            "checkpoint /shm/run/step_00000006: rank_00001.bin is missing on every host");
  auto with_older = partial;
  with_older[1].steps.insert(with_older[1].steps.begin(),
                             step_copy(5, shards({0, 1, 2, 3}, true), 4));
  const auto older = checkpoint::plan_memory_copies(with_older, 4, "/shm/run");
  EXPECT_EQ(older.step, std::optional<int64_t>(5));
  EXPECT_EQ(older.transfers.size(), 6u);
  // Not later than the disk checkpoint: stale.
  const auto stale = checkpoint::plan_memory_copies(with_older, 6, "/shm/run");
  EXPECT_FALSE(stale.step.has_value());
  EXPECT_EQ(stale.refused,
            "memory checkpoint /shm/run/step_00000006 is of step 6, not later than the disk's 6");
  // No memory checkpoint at all: nothing to say.
  EXPECT_EQ(checkpoint::plan_memory_copies({{}, {}}, 4, "/shm/run").refused, "");
}
