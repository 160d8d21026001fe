// Cluster specs, straggle rates and shapes: what the planner reads, with errors that name the file
// and the key at fault.
#include <gtest/gtest.h>

#include "test_util.h"

#include <cmath>

#include "common/error.h"
#include "plan/cluster.h"
#include "plan/planner.h"
#include "plan/shared_cores.h"

using namespace malleus;

namespace {

using malleus::testing::error_of;

}  // namespace

TEST(Cluster, PresetsMatchTheirFilesAndValidate) {
  const auto names = plan::cluster_preset_names();
  for (const char* expected :
       {"a800-4x8", "a800-8x8", "a800-128x8", "h100-8x8", "h100-2048x8", "cpu-local"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
  for (const auto& name : names) {
    const std::string file =
        std::string(MALLEUS_SOURCE_DIR) + "/configs/clusters/" + name + ".json";
    EXPECT_EQ(plan::load_cluster(name).to_json(), plan::load_cluster(file).to_json()) << name;
  }
  const auto a800 = plan::load_cluster("a800-8x8");
  EXPECT_EQ(a800.num_devices(), 64);
  EXPECT_EQ(a800.node_of(15), 1);
  EXPECT_DOUBLE_EQ(a800.flops(), 312e12 * 0.5);
  EXPECT_DOUBLE_EQ(a800.bandwidth(0, 7), a800.intra_node_bandwidth);
  EXPECT_DOUBLE_EQ(a800.bandwidth(7, 8), a800.inter_node_bandwidth);
}

TEST(Cluster, JsonRoundTripsAndRejectsBadKeys) {
  const auto c = plan::load_cluster("h100-8x8");
  EXPECT_EQ(plan::ClusterSpec::from_json(c.to_json(), "x").to_json(), c.to_json());
  Json bad = c.to_json();
  bad["memory_gb"] = 80;
  EXPECT_NE(error_of([&] { plan::ClusterSpec::from_json(bad, "c.json"); }).find("memory_gb"),
            std::string::npos);
  bad = c.to_json();
  bad["mfu"] = 1.5;
  const std::string e = error_of([&] { plan::ClusterSpec::from_json(bad, "c.json"); });
  EXPECT_NE(e.find("c.json"), std::string::npos);
  EXPECT_NE(e.find("mfu"), std::string::npos);
  bad = c.to_json();
  bad.erase("nodes");
  EXPECT_NE(error_of([&] { plan::ClusterSpec::from_json(bad, "c.json"); }).find("nodes"),
            std::string::npos);
  EXPECT_NE(error_of([] { plan::load_cluster("no-such-cluster"); }).find("no-such-cluster"),
            std::string::npos);
  // Ranks taking turns on fewer cores than devices: kept through JSON, bounded by the devices.
  bad = c.to_json();
  bad["cores_per_node"] = 2;
  EXPECT_EQ(plan::SharedCores::of(plan::ClusterSpec::from_json(bad, "c.json"))->core_of(11),
            3);  // node 1 (cores 2, 3), its device 3 on core 3 mod 2
  EXPECT_EQ(plan::ClusterSpec::from_json(plan::ClusterSpec::from_json(bad, "c.json").to_json(), "x")
                .cores_per_node,
            2);
  for (int cores : {0, 9}) {
    bad["cores_per_node"] = cores;
    const std::string why = error_of([&] { plan::ClusterSpec::from_json(bad, "c.json"); });
    EXPECT_NE(why.find("cores_per_node"), std::string::npos) << why;
  }
}

TEST(Rates, ParseInlineAndFileForms) {
  const auto r = plan::parse_rates(R"({"3": 2.5, "1": "inf"})", 4);
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0], 1.0);
  EXPECT_TRUE(plan::is_gone(r[1]));
  EXPECT_EQ(r[3], 2.5);
  EXPECT_EQ(plan::parse_rates("", 3), plan::Rates(3, 1.0));
  EXPECT_EQ(plan::rates_to_json(r), Json::parse(R"({"1": "inf", "3": 2.5})"));
  EXPECT_NE(error_of([] { plan::parse_rates(R"({"9": 2})", 4); }).find("\"9\""), std::string::npos);
  EXPECT_NE(error_of([] { plan::parse_rates(R"({"2": 0.5})", 4); }).find("\"2\""),
            std::string::npos);
  EXPECT_NE(error_of([] { plan::parse_rates(R"({"2": "slow"})", 4); }).find("slow"),
            std::string::npos);
  EXPECT_NE(error_of([] { plan::parse_rates(R"({"x1": 2})", 4); }).find("x1"), std::string::npos);
  EXPECT_NE(error_of([] { plan::parse_rates("/no/such/rates.json", 4); }).find("rates.json"),
            std::string::npos);
}

TEST(Shape, ParsesBothForms) {
  const auto a = plan::Shape::parse("dp2,tp8,pp4");
  EXPECT_EQ(a.dp, 2);
  EXPECT_EQ(a.tp, 8);
  EXPECT_EQ(a.pp, 4);
  const auto b = plan::Shape::parse("4x2x4");
  EXPECT_EQ(b.dp, 4);
  EXPECT_EQ(b.tp, 2);
  EXPECT_EQ(b.text(), "dp4 tp2 pp4");
  EXPECT_NE(error_of([] { plan::Shape::parse("dp2,tp8"); }).find("dp2,tp8"), std::string::npos);
  EXPECT_NE(error_of([] { plan::Shape::parse("dp0,tp1,pp1"); }).find("dp0"), std::string::npos);
}
