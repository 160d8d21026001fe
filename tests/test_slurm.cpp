// Slurm's side of `malleus launch` and `malleus train` (launch/slurm.h, common/slurm_lists.h):
// host and count lists (against Slurm's own `scontrol show hostnames` where it is installed), the
// allocation from the environment, node states and job node lists as `scontrol show ... -o`
// prints them (output captured from Debian's Slurm 22.05 on the local cluster of
// scripts/slurm.sh), srun's lines naming killed tasks, and which nodes a restart may use. The
// runs against a real slurmctld and slurmd: tests/slurm_test.sh.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "common/slurm_lists.h"
#include "launch/slurm.h"
#include "launch/supervisor.h"
#include "test_util.h"
#include "train/setup.h"

using namespace malleus;
using namespace malleus::launch;
using malleus::testing::error_of;
using malleus::testing::run_command;
using malleus::testing::ScratchDir;

namespace {

using Strings = std::vector<std::string>;

// Two lines of `scontrol show node -o` (Slurm 22.05): a node running a job, and one an operator
// drained while idle (its Reason ends in who set it and when).
const std::string kNodeLines =
    "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=19.14 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 "
    "NodeHostName=vm Port=45239 Version=22.05.8 OS=Linux 6.18.44 #1 SMP PREEMPT_DYNAMIC @0  "
    "RealMemory=1 AllocMem=0 FreeMem=16086 Sockets=2 Boards=1 State=MIXED ThreadsPerCore=1 "
    "TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  "
    "CfgTRES=cpu=2,mem=1M,billing=2 AllocTRES=cpu=1 CapWatts=n/a\n"
    "NodeName=vm-n3 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 "
    "NodeAddr=127.0.0.1 NodeHostName=vm-n3 Port=36283 Version=22.05.8 State=IDLE+DRAIN "
    "ThreadsPerCore=1 Partitions=debug  AllocTRES= CapWatts=n/a ExtSensorsTemp=n/s "
    "Reason=disk failing [root@2026-11-27T12:05:43]\n";

// A line of `scontrol show job -o`: ReqNodeList= and ExcNodeList= come before NodeList=.
std::string job_line(const std::string& nodes) {
  return "JobId=4 JobName=wrap UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
         "Partition=debug AllocNode:Sid=localhost:13467 ReqNodeList=(null) ExcNodeList=(null) "
         "NodeList=" +
         nodes + " BatchHost=vm NumNodes=2 NumCPUs=2 NumTasks=2 Power= \n";
}

// An environment of the given variables only.
Environment env_of(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

}  // namespace

TEST(SlurmLists, HostListsExpandAsSlurmReadsThem) {
  EXPECT_EQ(expand_hostlist("node[2-3,10],login", "L"),
            (Strings{"node2", "node3", "node10", "login"}));
  EXPECT_EQ(expand_hostlist("n[08-10]", "L"), (Strings{"n08", "n09", "n10"}));
  EXPECT_EQ(expand_hostlist("vm,vm-n[2-3]", "L"), (Strings{"vm", "vm-n2", "vm-n3"}));
  EXPECT_EQ(expand_hostlist("a,,b", "L"), (Strings{"a", "b"}));
  EXPECT_EQ(expand_counts("2(x3),1", "C"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(expand_counts("4", "C"), (std::vector<int>{4}));
}

TEST(SlurmLists, HostListsAgreeWithScontrolShowHostnames) {
  if (run_command("command -v scontrol").exit_code != 0) {
    GTEST_SKIP() << "scontrol is not installed (scripts/setup.sh installs slurm-wlm)";
  }
  // scontrol reads a configuration first, though it asks no daemon to expand a list.
  ScratchDir dir;
  std::ofstream(dir / "slurm.conf")
      << "ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=ALL\n";
  for (const std::string list : {"n[08-10],x[1-2],login,n[7,9-10]", "gpu[001-003,100]",
                                 "a1,b[0-1],c[9-11]", "node[098-101]"}) {
    const auto r = run_command("SLURM_CONF=" + (dir / "slurm.conf").string() +
                               " scontrol show hostnames '" + list + "'");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::istringstream lines(r.output);
    Strings slurm;
    for (std::string line; std::getline(lines, line);) slurm.push_back(line);
    EXPECT_EQ(expand_hostlist(list, "L"), slurm) << list;
  }
}

TEST(SlurmLists, MalformedListsNameTheVariableAndTheText) {
  const auto bad = [](const std::string& list) {
    return error_of([&] { expand_hostlist(list, "SLURM_JOB_NODELIST"); });
  };
  EXPECT_NE(bad("n[3-1]").find("SLURM_JOB_NODELIST \"n[3-1]\": the range \"3-1\" runs backwards"),
            std::string::npos)
      << bad("n[3-1]");
  EXPECT_NE(bad("n[1-2").find("has no closing ']'"), std::string::npos);
  EXPECT_NE(bad("n[1-2]x").find("goes on after its ']'"), std::string::npos);
  EXPECT_NE(bad("r[1-2]n[1-2]").find("more than one bracket"), std::string::npos);
  EXPECT_NE(bad("n[a-b]").find("is not a number or a range"), std::string::npos);
  EXPECT_NE(bad("n1 n2").find("no spaces"), std::string::npos);
  EXPECT_NE(bad("n[0-99999]").find("more than 65536 hosts"), std::string::npos);
  EXPECT_NE(bad(",").find("no hosts"), std::string::npos);
  EXPECT_NE(bad("n]").find("has no '['"), std::string::npos);
  const std::string counts = error_of([] { expand_counts("2(x3,1", "SLURM_TASKS_PER_NODE"); });
  EXPECT_NE(counts.find("SLURM_TASKS_PER_NODE \"2(x3,1\""), std::string::npos) << counts;
  EXPECT_NE(error_of([] { expand_counts("", "C"); }).find("is not a count"), std::string::npos);
  EXPECT_NE(error_of([] { expand_counts("-1", "C"); }).find("is not a count"), std::string::npos);
}

TEST(SlurmAllocation, NodesAndTasksComeFromTheEnvironment) {
  EXPECT_FALSE(slurm_allocation(env_of({})).has_value());
  const auto a = slurm_allocation(env_of({{"SLURM_JOB_ID", "17"},
                                          {"SLURM_JOB_NODELIST", "vm,vm-n[2-3]"},
                                          {"SLURM_TASKS_PER_NODE", "2(x2),1"}}));
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->job_id, "17");
  ASSERT_EQ(a->nodes.size(), 3u);
  EXPECT_EQ(a->nodes[1].name, "vm-n2");
  EXPECT_EQ(a->nodes[1].slots, 2);
  EXPECT_EQ(a->nodes[2].slots, 1);
  EXPECT_EQ(a->tasks(), 5);
  // SLURM_NODELIST and SLURM_NTASKS_PER_NODE where the others are absent.
  const auto b = slurm_allocation(env_of(
      {{"SLURM_JOB_ID", "3"}, {"SLURM_NODELIST", "n[1-2]"}, {"SLURM_NTASKS_PER_NODE", "4"}}));
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->tasks(), 8);
}

TEST(SlurmAllocation, ABrokenAllocationIsAnErrorNamingTheVariable) {
  const auto error = [](const std::map<std::string, std::string>& vars) {
    return error_of([&] { slurm_allocation(env_of(vars)); });
  };
  EXPECT_NE(error({{"SLURM_JOB_ID", "5"}}).find("neither SLURM_JOB_NODELIST nor SLURM_NODELIST"),
            std::string::npos);
  EXPECT_NE(error({{"SLURM_JOB_ID", "5"}, {"SLURM_JOB_NODELIST", "n[1-2]"}})
                .find("neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE"),
            std::string::npos);
  const std::string mismatch = error(
      {{"SLURM_JOB_ID", "5"}, {"SLURM_JOB_NODELIST", "n[1-3]"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}});
  EXPECT_NE(mismatch.find("gives 2 nodes, but SLURM_JOB_NODELIST \"n[1-3]\" names 3"),
            std::string::npos)
      << mismatch;
  EXPECT_NE(error({{"SLURM_JOB_ID", "5"},
                   {"SLURM_JOB_NODELIST", "n1,n1"},
                   {"SLURM_TASKS_PER_NODE", "1(x2)"}})
                .find("names n1 twice"),
            std::string::npos);
  EXPECT_NE(
      error({{"SLURM_JOB_ID", "5"}, {"SLURM_JOB_NODELIST", "n1"}, {"SLURM_TASKS_PER_NODE", "0"}})
          .find("gives node n1 no task"),
      std::string::npos);
  EXPECT_EQ(slurm_restart_count(env_of({})), 0);
  EXPECT_EQ(slurm_restart_count(env_of({{"SLURM_RESTART_COUNT", "2"}})), 2);
  EXPECT_NE(error_of([] {
              slurm_restart_count(env_of({{"SLURM_RESTART_COUNT", "x"}}));
            }).find("SLURM_RESTART_COUNT \"x\""),
            std::string::npos);
}

TEST(SlurmNodeStates, StatesAndReasonsAreReadFromScontrol) {
  const auto nodes = parse_node_states(kNodeLines);
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes.at("vm").state, "MIXED");
  EXPECT_EQ(nodes.at("vm").reason, "");
  EXPECT_EQ(nodes.at("vm-n3").state, "IDLE+DRAIN");
  EXPECT_EQ(nodes.at("vm-n3").reason, "disk failing");
  EXPECT_EQ(unusable_because("MIXED"), "");
  EXPECT_EQ(unusable_because("ALLOCATED"), "");
  EXPECT_EQ(unusable_because("IDLE+DRAIN"), "drained");
  EXPECT_EQ(unusable_because("MIXED+DRAIN"), "drained");
  EXPECT_EQ(unusable_because("DOWN+NOT_RESPONDING"), "down, not responding");
  EXPECT_EQ(unusable_because("IDLE+NOT_RESPONDING"), "not responding");
  EXPECT_EQ(unusable_because("DOWN+DRAIN+FAIL"), "down, drained, failing");
  EXPECT_EQ(parse_job_nodes(job_line("vm,vm-n[2-3]")), (Strings{"vm", "vm-n2", "vm-n3"}));
  EXPECT_FALSE(parse_job_nodes(job_line("(null)")).has_value());
  EXPECT_FALSE(parse_job_nodes("garbage").has_value());
}

TEST(SlurmNodeStates, ARestartLeavesOutDrainedAndLostNodesAndSaysWhy) {
  const Allocation allocation{"4", {{"vm", 1}, {"vm-n2", 2}, {"vm-n3", 1}}};
  std::string job = job_line("vm,vm-n[2-3]"), nodes = kNodeLines;
  int calls = 0;
  SlurmNodes slurm(allocation, [&](const std::vector<std::string>& args) {
    ++calls;
    return std::optional<std::string>(args.at(1) == "job" ? job : nodes);
  });
  std::vector<Host> usable = slurm.usable();
  ASSERT_EQ(usable.size(), 2u);
  EXPECT_EQ(usable[0].name, "vm");
  EXPECT_EQ(usable[1].name, "vm-n2");
  EXPECT_EQ(usable[1].slots, 2);
  EXPECT_EQ(slurm.left_out().at("vm-n3"),
            "drained (Slurm state IDLE+DRAIN, reason \"disk failing\")");
  EXPECT_EQ(calls, 2);
  // vm-n2 leaves the allocation (a node that failed under --no-kill); vm-n3 is resumed.
  job = job_line("vm,vm-n3");
  nodes = "NodeName=vm State=MIXED\nNodeName=vm-n3 State=MIXED\n";
  usable = slurm.usable();
  ASSERT_EQ(usable.size(), 2u);
  EXPECT_EQ(usable[1].name, "vm-n3");
  EXPECT_EQ(slurm.left_out().size(), 1u);
  EXPECT_EQ(slurm.left_out().at("vm-n2"), "no longer in job 4's allocation");
}

TEST(SlurmNodeStates, ANodeNotRespondingGetsTimeToAnswerAndScontrolFailingUsesEveryNode) {
  const Allocation allocation{"4", {{"a", 1}, {"b", 1}}};
  int asked = 0;
  SlurmNodes settling(
      allocation,
      [&](const std::vector<std::string>& args) -> std::optional<std::string> {
        if (args.at(1) == "job") return std::nullopt;  // the job's nodes unknown: all held
        ++asked;
        return std::string("NodeName=a State=IDLE\nNodeName=b State=") +
               (asked < 3 ? "IDLE+NOT_RESPONDING" : "IDLE");
      },
      30);
  EXPECT_EQ(settling.usable().size(), 2u);
  EXPECT_EQ(asked, 3);
  // Never answering within settle_s: left out.
  SlurmNodes silent(
      allocation,
      [](const std::vector<std::string>&) -> std::optional<std::string> {
        return std::string("NodeName=a State=IDLE\nNodeName=b State=IDLE+NOT_RESPONDING");
      },
      0.6);
  const auto usable = silent.usable();
  ASSERT_EQ(usable.size(), 1u);
  EXPECT_EQ(silent.left_out().at("b"), "not responding (Slurm state IDLE+NOT_RESPONDING)");
  SlurmNodes unknown(allocation, [](const std::vector<std::string>&) { return std::nullopt; });
  EXPECT_EQ(unknown.usable().size(), 2u);
  EXPECT_TRUE(unknown.left_out().empty());
}

TEST(SlurmRuns, SrunLinesNameTheKilledRanksAndNotTheOnesItEnded) {
  // What srun printed when rank 2's process was killed (SIGKILL) under --kill-on-bad-exit.
  const std::string output =
      "step     8/24 | loss 5.51\n"
      "srun: error: vm-n3: task 2: Killed\n"
      "srun: launch/slurm: _step_signal: Terminating StepId=4.0\n"
      "slurmstepd-vm: error: *** STEP 4.0 ON vm CANCELLED AT 2026-11-27T12:04:12 ***\n"
      "srun: Job step aborted: Waiting up to 17 seconds for job step to finish.\n"
      "srun: error: vm: tasks 0-1: Killed\n";
  std::string detail;
  EXPECT_EQ(srun_killed_ranks(output, &detail), (std::vector<int>{2}));
  EXPECT_EQ(detail, "srun: error: vm-n3: task 2: Killed");
  EXPECT_EQ(srun_killed_ranks("srun: error: n1: tasks 0,3-4: Segmentation fault\n", nullptr),
            (std::vector<int>{0, 3, 4}));
  // Exits and stop signals are not losses.
  EXPECT_TRUE(srun_killed_ranks("srun: error: n1: task 1: Exited with exit code 1\n"
                                "srun: error: n1: task 0: Terminated\n",
                                nullptr)
                  .empty());
  const Outcome o = classify(137, output, std::nullopt);
  EXPECT_EQ(o.kind, Outcome::Kind::kLost);
  EXPECT_EQ(o.reason, "killed");
  EXPECT_EQ(o.lost_ranks, (std::vector<int>{2}));
}

TEST(SlurmRuns, SrunCommandPlacesEachRankOnItsNode) {
  EXPECT_EQ(
      srun_command("srun", {"--cpu-bind=none"}, {"vm", "vm", "vm-n2"}, {"/bin/malleus", "train"}),
      (Strings{"srun", "--mpi=pmix", "--kill-on-bad-exit=1", "--distribution=arbitrary",
               "--nodes=2", "--ntasks=3", "--nodelist=vm,vm,vm-n2", "--cpu-bind=none",
               "/bin/malleus", "train"}));
}

TEST(SlurmRuns, RanksOnThisNodeComeFromTheStepUnderSrun) {
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "2,1", 1);
  ::setenv("SLURM_NODEID", "1", 1);
  EXPECT_EQ(train::ranks_on_this_node(3), 1);
  ::setenv("SLURM_NODEID", "0", 1);
  EXPECT_EQ(train::ranks_on_this_node(3), 2);
  ::unsetenv("SLURM_STEP_TASKS_PER_NODE");
  ::unsetenv("SLURM_NODEID");
  EXPECT_EQ(train::ranks_on_this_node(3), 3);
}
