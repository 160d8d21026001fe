// `malleus report`: reading metrics.jsonl of every record kind, the SVG timeline, the CLI.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>

#include "common/error.h"
#include "report/report.h"
#include "test_util.h"

namespace malleus::report {
namespace {

using malleus::testing::run_malleus;
using malleus::testing::ScratchDir;

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// 30 steps on 4 ranks: rank 2 is slowed from step 8 (injected 3x), the controller re-plans at
// step 10 and again at 20, declines once at 15; the run is resumed from step 25 after step 27.
std::string synthetic_metrics() {
  std::string text;
  auto step = [&](int s, const std::string& plan, double tps) {
    const bool slow = s >= 8;
    text += "{\"step\":" + std::to_string(s) + ",\"loss\":" + std::to_string(5.0 - 0.1 * s) +
            ",\"lr\":0.001,\"grad_norm\":1.5,\"tokens_per_s\":" + std::to_string(tps) +
            ",\"step_time_s\":0.5,\"eta_s\":10,\"consumed_samples\":" + std::to_string(16 * s) +
            ",\"plan\":\"" + plan + "\",\"rates\":[1.0,1.02," + (slow ? "2.9" : "1.0") +
            (s == 3 ? ",null" : ",0.99") + "],\"injected\":[1,1," + (slow ? "3" : "1") +
            ",1],\"future_key\":{\"a\":1}}\n";
  };
  const std::string a = "1 pipeline: [pp2 tp2,2 m8]", b = "2 pipelines: [pp1 tp1 m4] [pp1 tp2 m4]";
  for (int s = 1; s <= 10; ++s) step(s, a, s < 8 ? 1000 : 500);
  text += "{\"event\":\"replan\",\"step\":10,\"old_plan\":\"" + a + "\",\"new_plan\":\"" + b +
          "\",\"rates\":[1,1,2.9,1],\"predicted_old_s\":1.0,\"predicted_new_s\":0.6,"
          "\"predicted_gain_s\":0.4,\"bytes_moved\":1048576,\"migration_s\":0.25,"
          "\"planning_s\":0.003}\n";
  text += "{\"step\":10,\"val_loss\":4.2}\n";
  for (int s = 11; s <= 20; ++s) {
    step(s, b, 900);
    if (s == 15) {
      text +=
          "{\"event\":\"replan_declined\",\"step\":15,\"reason\":\"gain too small\","
          "\"predicted_gain_s\":0.01}\n";
    }
  }
  text += "\n";  // blank lines are skipped
  text += "{\"event\":\"replan\",\"step\":20,\"old_plan\":\"" + b + "\",\"new_plan\":\"" + a +
          "\",\"rates\":[1,1,1,1],\"predicted_old_s\":0.6,\"predicted_new_s\":0.5,"
          "\"predicted_gain_s\":0.1,\"bytes_moved\":2048,\"migration_s\":0.01,"
          "\"planning_s\":0.002}\n";
  text += "{\"event\":\"checkpoint\",\"step\":20}\n";  // an event kind the report does not know
  for (int s = 21; s <= 27; ++s) step(s, a, 1100);
  for (int s = 25; s <= 30; ++s) step(s, a, 1100);  // resumed from the step-24 checkpoint
  text += "{\"step\":30,\"val_loss\":2.5}\n";
  return text;
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

TEST(Report, ParsesEveryRecordKind) {
  const Report r = parse_metrics(synthetic_metrics(), "metrics.jsonl");
  ASSERT_EQ(r.steps.size(), 33u);
  ASSERT_EQ(r.evals.size(), 2u);
  ASSERT_EQ(r.replans.size(), 2u);
  ASSERT_EQ(r.declined.size(), 1u);
  EXPECT_EQ(r.num_ranks(), 4u);
  EXPECT_EQ(r.steps[0].step, 1);
  EXPECT_DOUBLE_EQ(r.steps[0].tokens_per_s, 1000);
  EXPECT_EQ(r.steps[0].plan, "1 pipeline: [pp2 tp2,2 m8]");
  EXPECT_TRUE(std::isnan(r.steps[2].rates[3]));  // null: no measurement
  EXPECT_DOUBLE_EQ(r.steps[9].injected[2], 3);
  EXPECT_EQ(r.replans[0].step, 10);
  EXPECT_EQ(r.replans[0].bytes_moved, 1048576);
  EXPECT_DOUBLE_EQ(r.replans[0].migration_s, 0.25);
  EXPECT_EQ(r.replans[0].new_plan, "2 pipelines: [pp1 tp1 m4] [pp1 tp2 m4]");
  EXPECT_EQ(r.declined[0].reason, "gain too small");
  EXPECT_DOUBLE_EQ(r.evals[1].val_loss, 2.5);

  const auto segments = plan_segments(r);
  ASSERT_EQ(segments.size(), 3u);
  EXPECT_EQ(segments[0].num_steps, 10u);
  EXPECT_DOUBLE_EQ(segments[0].mean_tokens_per_s, (7 * 1000 + 3 * 500) / 10.0);
  EXPECT_EQ(segments[1].first_step, 11);
  EXPECT_EQ(segments[1].last_step, 20);
  EXPECT_DOUBLE_EQ(segments[1].mean_tokens_per_s, 900);
  EXPECT_EQ(segments[2].num_steps, 13u);
  EXPECT_EQ(segments[2].last_step, 30);
}

TEST(Report, SummaryCountsStepsReplansAndBytes) {
  const std::string s = summarize(parse_metrics(synthetic_metrics(), "m.jsonl"));
  EXPECT_NE(s.find("33 steps"), std::string::npos) << s;
  EXPECT_NE(s.find("resumed 1 time"), std::string::npos) << s;
  EXPECT_NE(s.find("re-plans: 2 (1 declined)"), std::string::npos) << s;
  // 1050624 bytes, written once (the closing line once gave the figure twice: "... (0 bytes)").
  EXPECT_NE(s.find("1.00 MiB moved in "), std::string::npos) << s;
  EXPECT_EQ(s.find(" bytes)"), std::string::npos) << s;
  EXPECT_NE(s.find("plan 2: steps 11-20 (10 steps), mean 900 tokens/s"), std::string::npos) << s;
}

TEST(Report, SvgHasPanelsReplanLinesAndLegend) {
  const Report r = parse_metrics(synthetic_metrics(), "metrics.jsonl");
  RenderOptions options;
  options.title = "straggler <demo> & co";
  const std::string svg = render_svg(r, options);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("straggler &lt;demo&gt; &amp; co"), std::string::npos);  // escaped
  for (const char* panel : {"panel-throughput", "panel-rates", "panel-loss"}) {
    EXPECT_EQ(count(svg, std::string("id=\"") + panel + "\""), 1u) << panel;
  }
  EXPECT_EQ(count(svg, "class=\"replan\""), r.replans.size());
  EXPECT_EQ(count(svg, "class=\"declined\""), r.declined.size());
  EXPECT_EQ(count(svg, "class=\"legend-rank\""), 4u);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(svg.find(">rank " + std::to_string(rank) + "<"), std::string::npos);
  }
  EXPECT_NE(svg.find("class=\"rate-injected\""), std::string::npos);
  EXPECT_NE(svg.find("moved 1.00 MiB in 250 ms"), std::string::npos);  // the re-plan tooltip
  EXPECT_EQ(count(svg, "class=\"loss-val\""), 2u + 1u);                // two points, one legend
  // Lines are strokes only: a filled polyline would paint the area under it.
  for (const char* line : {"tps-raw", "tps-median", "rate-measured", "loss-train"}) {
    EXPECT_NE(svg.find(std::string("class=\"") + line + "\" fill=\"none\""), std::string::npos)
        << line;
  }
  EXPECT_EQ(count(svg, "<text"), count(svg, "</text>"));
  EXPECT_EQ(count(svg, "<g"), count(svg, "</g>"));
}

TEST(Report, SvgWithMarkupInEveryNameIsValidXml) {
  // Plans, reasons and the title come from files and the command line: the chart must escape them.
  const std::string nasty = "a<&\"b>";
  metrics::StepRecord step;
  step.step = 1;
  step.loss = 3;
  step.tokens_per_s = 100;
  step.plan = nasty;
  step.rates = {1, 2};
  metrics::ReplanRecord replan;
  replan.switched = true;
  replan.step = 1;
  replan.old_plan = nasty;
  replan.new_plan = nasty;
  metrics::ReplanRecord declined = replan;
  declined.switched = false;
  declined.reason = nasty;
  std::string text;
  for (const metrics::MetricsRecord& record :
       {metrics::MetricsRecord(step), {replan}, {declined}}) {
    text += metrics::to_json(record).dump() + "\n";
  }
  RenderOptions options;
  options.title = nasty;
  ScratchDir dir;
  write_text(dir / "chart.svg", render_svg(parse_metrics(text, nasty), options));
  const auto parsed = malleus::testing::parse_xml(dir / "chart.svg");
  ASSERT_EQ(parsed.exit_code, 0) << parsed.output;
  EXPECT_NE(parsed.output.find("\n" + nasty + "\n"), std::string::npos) << parsed.output;
  EXPECT_NE(parsed.output.find("declined at step 1: " + nasty), std::string::npos);
}

TEST(Report, RecordsRoundTripThroughTheSchema) {
  // What the trainer writes is what the report reads, field by field.
  metrics::StepRecord step;
  step.step = 7;
  step.loss = 2.5;
  step.lr = 1e-3;
  step.tokens_per_s = 1234.5;
  step.consumed_samples = 112;
  step.plan = "1 pipeline: [pp1 tp1 m8]";
  step.rates = {1.0, 3.0};
  step.injected = {1.0, 3.0};
  metrics::ReplanRecord replan;
  replan.switched = true;
  replan.step = 7;
  replan.rates = {1.0, 3.0};
  replan.old_plan = "a";
  replan.new_plan = "b";
  replan.predicted_old_s = 1.0;
  replan.predicted_new_s = 0.5;
  replan.predicted_gain_s = 0.5;
  replan.horizon_steps = 50;
  replan.bytes_moved = 4096;
  replan.migration_s = 0.1;
  const metrics::EvalRecord eval{7, 2.25};
  std::string text;
  for (const metrics::MetricsRecord& record : {metrics::MetricsRecord(step), {eval}, {replan}}) {
    text += metrics::to_json(record).dump() + "\n";
  }
  const Report r = parse_metrics(text, "m.jsonl");
  ASSERT_EQ(r.steps.size(), 1u);
  ASSERT_EQ(r.evals.size(), 1u);
  ASSERT_EQ(r.replans.size(), 1u);
  EXPECT_EQ(metrics::to_json(metrics::StepRecord(r.steps[0])), metrics::to_json(step));
  EXPECT_EQ(metrics::to_json(metrics::EvalRecord(r.evals[0])), metrics::to_json(eval));
  EXPECT_EQ(metrics::to_json(metrics::ReplanRecord(r.replans[0])), metrics::to_json(replan));
  EXPECT_TRUE(std::isnan(r.steps[0].grad_norm));  // never set: not written, read back unknown
  EXPECT_FALSE(metrics::to_json(step).contains("grad_norm"));
}

TEST(Report, EmptyReportStillRenders) {
  const std::string svg = render_svg(parse_metrics("", "empty.jsonl"));
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("no throughput"), std::string::npos);
}

TEST(Report, MalformedLineNamesFileAndLine) {
  const std::string good = "{\"step\":1,\"loss\":3.0,\"tokens_per_s\":10}\n";
  try {
    parse_metrics(good + good + "{\"step\":3,\"loss\":\n", "run/metrics.jsonl");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("run/metrics.jsonl:3"), std::string::npos) << e.what();
  }
  try {
    parse_metrics(good + "{\"step\":2,\"loss\":\"high\",\"tokens_per_s\":10}\n", "m.jsonl");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("m.jsonl:2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"loss\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_metrics("[1,2]\n", "m.jsonl"), Error);
  EXPECT_THROW(parse_metrics("{\"event\":\"replan\",\"old_plan\":\"a\"}\n", "m.jsonl"), Error);
  EXPECT_THROW(read_metrics("/nonexistent/metrics.jsonl"), Error);
}

TEST(Report, CliWritesTimelineAndPrintsSummary) {
  ScratchDir dir;
  write_text(dir / "metrics.jsonl", synthetic_metrics());
  const auto result = run_malleus("report " + (dir / "metrics.jsonl").string());
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("33 steps"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("re-plans: 2"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("mean "), std::string::npos) << result.output;
  ASSERT_TRUE(std::filesystem::exists(dir / "timeline.svg"));
  std::ifstream in(dir / "timeline.svg");
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("metrics.jsonl"), std::string::npos);  // the default title names the file

  const auto custom = run_malleus("report " + (dir / "metrics.jsonl").string() + " --output " +
                                  (dir / "out.svg").string() + " --title 'My run'");
  ASSERT_EQ(custom.exit_code, 0) << custom.output;
  std::ifstream in2(dir / "out.svg");
  const std::string svg2((std::istreambuf_iterator<char>(in2)), std::istreambuf_iterator<char>());
  EXPECT_NE(svg2.find(">My run<"), std::string::npos);

  std::filesystem::remove(dir / "timeline.svg");
  const auto run_dir = run_malleus("report " + dir.path().string());  // the run directory
  ASSERT_EQ(run_dir.exit_code, 0) << run_dir.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "timeline.svg"));
}

TEST(Report, CliFailsOnMissingOrMalformedFile) {
  ScratchDir dir;
  const auto missing = run_malleus("report " + (dir / "nope.jsonl").string());
  EXPECT_NE(missing.exit_code, 0) << missing.output;
  EXPECT_NE(missing.output.find("nope.jsonl"), std::string::npos) << missing.output;

  write_text(dir / "bad.jsonl", "{\"step\":1,\"loss\":3,\"tokens_per_s\":9}\nnot json\n");
  const auto bad = run_malleus("report " + (dir / "bad.jsonl").string());
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("bad.jsonl:2"), std::string::npos) << bad.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "timeline.svg"));
}

}  // namespace
}  // namespace malleus::report
