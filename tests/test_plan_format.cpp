// The plan file format and its validation: bad plans are refused with a message naming the
// problem before any work starts.
#include <gtest/gtest.h>

#include "common/error.h"
#include "plan/plan.h"
#include "test_util.h"

using namespace malleus;

namespace {

// Two unlike pipelines on 5 ranks (rank 4 idle): [tp2 (uneven), tp1] and [tp1].
Json mixed_plan() {
  return Json::parse(R"({
    "world_size": 5, "micro_batch_size": 2,
    "pipelines": [
      {"micro_batches": 3, "stages": [
        {"layers": [0, 3], "ranks": [0, 1], "heads": [6, 2], "ffn": [30, 18], "vocab": [200, 57]},
        {"layers": [3, 4], "ranks": [2]}]},
      {"micro_batches": 1, "stages": [{"layers": [0, 4], "ranks": [3]}]}]})");
}

std::string error_of(const Json& json, int world = 5, int batch = 8) {
  try {
    const auto model = malleus::testing::parallel_test_model();
    const auto plan = plan::Plan::from_json(json, model, "p.json");
    plan::validate(plan, model, world, batch, "p.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(PlanFormat, RoundTripsAndSummarises) {
  const auto model = malleus::testing::parallel_test_model();
  const auto plan = plan::Plan::from_json(mixed_plan(), model, "p.json");
  EXPECT_EQ(error_of(mixed_plan()), "");
  EXPECT_EQ(plan.global_batch(), 8);
  EXPECT_EQ(plan.idle_ranks(), std::vector<int>{4});
  EXPECT_EQ(plan.pipelines[0].stages[1].heads, std::vector<int>{8});  // omitted shares: all
  EXPECT_EQ(plan.summary(), "2 pipelines: [pp2 tp2,1 m3] [pp1 tp1 m1] idle 4");
  const auto again = plan::Plan::from_json(plan.to_json(), model, "again");
  EXPECT_EQ(again.to_json(), plan.to_json());
}

TEST(PlanFormat, EvenSharesKeepWholeGroups) {
  EXPECT_EQ(plan::even_shares(8, 3, 2), (std::vector<int>{4, 2, 2}));
  EXPECT_EQ(plan::even_shares(10, 4), (std::vector<int>{3, 3, 2, 2}));
}

TEST(PlanFormat, UniformPlanUsesMegatronRankOrder) {
  const auto plan = plan::uniform_plan(malleus::testing::parallel_test_model(), 2, 2, 2, 8, 2);
  ASSERT_EQ(plan.pipelines.size(), 2u);
  EXPECT_EQ(plan.pipelines[1].stages[0].ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(plan.pipelines[0].stages[1].layer_begin, 2);
  EXPECT_EQ(plan.pipelines[0].micro_batches, 2);
  EXPECT_THROW(plan::uniform_plan(malleus::testing::parallel_test_model(), 1, 8, 1, 8, 2),
               Error);  // tp > KV heads
  EXPECT_THROW(plan::uniform_plan(malleus::testing::parallel_test_model(), 1, 1, 5, 8, 2),
               Error);  // pp > layers
}

TEST(PlanFormat, OverlappingRanksAreRefused) {
  Json j = mixed_plan();
  j["pipelines"][1]["stages"][0]["ranks"] = {2};
  const auto e = error_of(j);
  EXPECT_NE(e.find("rank 2 is already used by pipeline 0 stage 1"), std::string::npos) << e;
}

TEST(PlanFormat, MissingOrOverlappingLayersAreRefused) {
  Json j = mixed_plan();
  j["pipelines"][0]["stages"][1]["layers"] = {3, 3};
  EXPECT_NE(error_of(j).find("layers [3, 3)"), std::string::npos) << error_of(j);
  j = mixed_plan();
  j["pipelines"][1]["stages"][0]["layers"] = {0, 3};
  EXPECT_NE(error_of(j).find("layers [3, 4) are not covered"), std::string::npos) << error_of(j);
  j = mixed_plan();
  j["pipelines"][0]["stages"][1]["layers"] = {2, 4};
  EXPECT_NE(error_of(j).find("starting at layer 3"), std::string::npos) << error_of(j);
}

TEST(PlanFormat, SharesMustAddUpInWholeGroups) {
  Json j = mixed_plan();
  j["pipelines"][0]["stages"][0]["ffn"] = {30, 17};
  EXPECT_NE(error_of(j).find("\"ffn\" shares sum to 47, the model has 48"), std::string::npos)
      << error_of(j);
  j = mixed_plan();
  j["pipelines"][0]["stages"][0]["heads"] = {5, 3};
  EXPECT_NE(error_of(j).find("whole KV groups"), std::string::npos) << error_of(j);
  j = mixed_plan();
  j["pipelines"][0]["stages"][0]["vocab"] = {257};
  EXPECT_NE(error_of(j).find("lists 1 shares for 2 ranks"), std::string::npos) << error_of(j);
  j = mixed_plan();
  j["pipelines"][0]["stages"][0]["heads"] = {8, 0};
  EXPECT_NE(error_of(j).find("share"), std::string::npos) << error_of(j);
}

TEST(PlanFormat, WorldSizeAndBatchMustMatchTheJob) {
  EXPECT_NE(error_of(mixed_plan(), 4).find("the plan is for 5 ranks but the job has 4"),
            std::string::npos);
  EXPECT_NE(error_of(mixed_plan(), 5, 16).find("sum to 8 sequences, the global batch is 16"),
            std::string::npos);
  Json j = mixed_plan();
  j["pipelines"][0]["stages"][0]["ranks"] = {0, 7};
  EXPECT_NE(error_of(j).find("rank 7 is outside the world of 5"), std::string::npos);
  j = mixed_plan();
  j["pipelines"][1]["micro_batches"] = 0;
  EXPECT_NE(error_of(j).find("at least 1"), std::string::npos);
  j = mixed_plan();
  j["pipelines"][0]["stages"][0]["tp"] = 2;
  EXPECT_NE(error_of(j).find("unknown key(s) \"tp\""), std::string::npos) << error_of(j);
}

TEST(PlanFormat, RecomputationIsPerStageAndChecked) {
  const auto model = malleus::testing::parallel_test_model();
  Json json = mixed_plan();
  auto& first = json["pipelines"][0]["stages"][0];
  first["recompute"] = "selective";
  EXPECT_EQ(error_of(json), "");
  auto plan = plan::Plan::from_json(json, model, "p.json");
  // All of the stage's layers unless told otherwise; other stages keep everything.
  EXPECT_EQ(plan.pipelines[0].stages[0].recompute,
            (model::Recompute{model::RecomputeMode::kSelective, 3}));
  EXPECT_EQ(plan.pipelines[0].stages[1].recompute, model::Recompute{});
  first["recompute"] = "full";
  first["recompute_layers"] = 1;
  plan = plan::Plan::from_json(json, model, "p.json");
  EXPECT_EQ(plan::Plan::from_json(plan.to_json(), model, "again").pipelines[0].stages[0].recompute,
            (model::Recompute{model::RecomputeMode::kFull, 1}));

  EXPECT_EQ(plan.summary(), "2 pipelines: [pp2 tp2,1 m3 rc f1,-] [pp1 tp1 m1] idle 4");

  // Recomputing ahead of the gradient (the shifted schedule): kept through JSON, shown as ">",
  // only on a recomputing stage before the last.
  first["recompute_ahead"] = true;
  plan = plan::Plan::from_json(json, model, "p.json");
  EXPECT_TRUE(
      plan::Plan::from_json(plan.to_json(), model, "again").pipelines[0].stages[0].recompute_ahead);
  EXPECT_FALSE(plan.pipelines[0].stages[1].recompute_ahead);
  EXPECT_EQ(plan.summary(), "2 pipelines: [pp2 tp2,1 m3 rc f1>,-] [pp1 tp1 m1] idle 4");
  auto& second = json["pipelines"][0]["stages"][1];
  second["recompute"] = "full";
  second["recompute_ahead"] = true;
  EXPECT_EQ(error_of(json),
            "p.json: pipeline 0 stage 1: \"recompute_ahead\" is true on the last stage, which has "
            "no gradient to wait for");
  second.erase("recompute_ahead");
  first["recompute_layers"] = 0;
  EXPECT_EQ(error_of(json),
            "p.json: pipeline 0 stage 0: \"recompute_ahead\" is true but the stage recomputes no "
            "layer");
  first.erase("recompute_ahead");
  first["recompute_layers"] = 1;

  first["recompute_layers"] = 4;
  EXPECT_EQ(error_of(json),
            "p.json: pipeline 0 stage 0: \"recompute_layers\" is 4, the stage has 3 layers");
  first["recompute_layers"] = -1;
  EXPECT_EQ(error_of(json),
            "p.json: pipeline 0 stage 0: \"recompute_layers\" is -1, the stage has 3 layers");
  first["recompute"] = "none";
  first["recompute_layers"] = 2;
  EXPECT_EQ(error_of(json),
            "p.json: pipeline 0 stage 0: \"recompute_layers\" is 2 but \"recompute\" is \"none\"");
  first["recompute"] = "partial";
  EXPECT_EQ(error_of(json),
            "p.json: pipeline 0 stage 0: \"recompute\" is \"partial\"; expected "
            "\"none\", \"selective\" or \"full\"");
}
