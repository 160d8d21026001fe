// report: a run's metrics.jsonl as an SVG timeline plus a text summary.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "common/error.h"
#include "common/files.h"
#include "report/report.h"

namespace malleus::cli {

namespace fs = std::filesystem;

void add_report_command(CLI::App& app) {
  struct ReportArgs {
    std::string metrics, output, title;
  };
  auto args = std::make_shared<ReportArgs>();
  auto* cmd = app.add_subcommand(
      "report",
      "Draw a run's metrics.jsonl as an SVG timeline (throughput, straggle rates, loss, "
      "re-plans) and print a summary");
  cmd->add_option("metrics", args->metrics,
                  "Metrics file (a run's metrics.jsonl, or the run directory)")
      ->required();
  cmd->add_option("--output", args->output,
                  "SVG file to write (default: timeline.svg next to the metrics file)");
  cmd->add_option("--title", args->title, "Title of the chart (default: the metrics file)");
  cmd->callback([args] {
    fs::path metrics = args->metrics;
    if (fs::is_directory(metrics)) metrics /= "metrics.jsonl";  // a run directory
    const report::Report report = report::read_metrics(metrics);
    check(!report.steps.empty(), metrics.string() + ": no step records to report");
    const fs::path output =
        args->output.empty() ? metrics.parent_path() / "timeline.svg" : fs::path(args->output);
    report::RenderOptions options;
    options.title = args->title;
    write_file_atomic(output, report::render_svg(report, options));
    std::fputs(report::summarize(report).c_str(), stdout);
    std::printf("wrote %s\n", output.c_str());
  });
}

}  // namespace malleus::cli
