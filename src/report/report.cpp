#include "report/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/json.h"
#include "common/stats.h"
#include "svg/svg.h"

namespace malleus::report {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

double mean_of(const std::vector<double>& values) {
  double sum = 0;
  size_t count = 0;
  for (double v : values) {
    if (std::isfinite(v)) {
      sum += v;
      ++count;
    }
  }
  return count == 0 ? kNaN : sum / static_cast<double>(count);
}

std::string printf_string(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

// Steps that go down (or repeat) mean the run was resumed from a checkpoint.
std::vector<size_t> resume_points(const std::vector<StepRecord>& steps) {
  std::vector<size_t> points;
  for (size_t i = 1; i < steps.size(); ++i) {
    if (steps[i].step <= steps[i - 1].step) points.push_back(i);
  }
  return points;
}

// ---------------------------------------------------------------------------------------------
// The timeline

using svg::Attributes;
using svg::Axis;
using svg::nice_axis;
using svg::nice_step;
using svg::path_data;
using svg::Points;
using svg::Scale;

// Counts code points, not bytes, so "→" is one character wide.
size_t text_length(const std::string& text) {
  return static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

std::string truncate(const std::string& text, size_t max_chars) {
  if (text_length(text) <= max_chars) return text;
  if (max_chars == 0) return "";
  std::string out;
  size_t chars = 0;
  for (char c : text) {
    const bool starts_char = (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    if (starts_char && ++chars > max_chars - 1) break;
    out += c;
  }
  out += "…";
  return out;
}

// Average advance of an 11 px sans-serif character: to keep labels from overlapping without
// measuring text.
constexpr double kCharWidth = 6.4;

// The step axis keeps the data's own ends (no empty margin before step 1) and integer ticks.
Axis step_axis(double lo, double hi) {
  if (hi - lo < 1) {
    lo -= 1;
    hi += 1;
  }
  Axis axis;
  axis.lo = lo;
  axis.hi = hi;
  axis.step = std::max(1.0, nice_step(hi - lo, 8));
  for (double t = std::ceil(lo / axis.step) * axis.step; t <= hi + 1e-9; t += axis.step) {
    axis.ticks.push_back(t);
  }
  return axis;
}

std::string tick_label(double value, double step, bool si) {
  if (si && std::fabs(value) >= 1e3) return format_count(value);
  const int decimals = std::clamp(static_cast<int>(std::ceil(-std::log10(step) - 1e-9)), 0, 6);
  char format[16];
  std::snprintf(format, sizeof format, "%%.%df", decimals);
  return printf_string(format, value);
}

// Ten well-separated colours (Tableau 10), then evenly spread hues for large clusters.
std::string rank_colour(size_t rank) {
  static const char* tableau[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  if (rank < 10) return tableau[rank];
  const double hue = std::fmod(static_cast<double>(rank) * 137.508, 360.0) / 60.0;
  const double s = 0.65, l = 0.45;
  const double c = (1 - std::fabs(2 * l - 1)) * s;
  const double x = c * (1 - std::fabs(std::fmod(hue, 2.0) - 1));
  double r = 0, g = 0, b = 0;
  switch (static_cast<int>(hue)) {
    case 0:
      r = c, g = x;
      break;
    case 1:
      r = x, g = c;
      break;
    case 2:
      g = c, b = x;
      break;
    case 3:
      g = x, b = c;
      break;
    case 4:
      r = x, b = c;
      break;
    default:
      r = c, b = x;
  }
  const double m = l - c / 2;
  char buffer[8];
  std::snprintf(buffer, sizeof buffer, "#%02x%02x%02x", static_cast<int>((r + m) * 255 + 0.5),
                static_cast<int>((g + m) * 255 + 0.5), static_cast<int>((b + m) * 255 + 0.5));
  return buffer;
}

Attributes stroke(const std::string& colour, const char* css_class) {
  return {{"stroke", colour}, {"class", css_class}};
}

// Path data of a triangle pointing down: apex `height` below the middle of its top edge.
std::string down_triangle(double x, double top, double half_width, double height) {
  return "M" + svg::number(x - half_width) + ' ' + svg::number(top) + 'L' +
         svg::number(x + half_width) + ' ' + svg::number(top) + 'L' + svg::number(x) + ' ' +
         svg::number(top + height) + 'Z';
}

struct Panel {
  double top = 0, height = 0;
  double bottom() const { return top + height; }
};

constexpr double kRowHeight = 15;
constexpr double kPanelGap = 34;
constexpr int kMaxLabelRows = 4;
constexpr size_t kMaxTableReplans = 10;

// Labels of re-plan and resume lines sit in rows above the panels. A label's line starts at its
// row, so a label keeps clear of other labels in its row, of the lines of labels in rows above
// it, and its own line of the labels in rows below.
struct BandLabel {
  int row = -1;  // -1: no room; the line is drawn without a label
  std::string text;
  bool flip = false;  // right-aligned, left of its line
};

struct LabelRequest {
  double x;
  std::vector<std::string> candidates;  // longest first; the last is the short name
};

struct LabelSpan {
  double x0, x1, line_x;
  int row;
};

std::optional<BandLabel> try_place(std::vector<LabelSpan>& taken, double x, const std::string& text,
                                   double right_edge) {
  const double w = static_cast<double>(text_length(text)) * kCharWidth;
  const bool flip = x + 4 + w > right_edge;  // near the right edge the label goes left
  const double x0 = flip ? x - 4 - w : x + 4, x1 = flip ? x - 4 : x + 4 + w;
  if (x0 < 4) return std::nullopt;
  for (int row = 0; row < kMaxLabelRows; ++row) {
    const bool clash = std::any_of(taken.begin(), taken.end(), [&](const LabelSpan& s) {
      if (s.row == row) return x1 + 6 > s.x0 && x0 - 6 < s.x1;
      if (s.row < row) return s.line_x > x0 - 3 && s.line_x < x1 + 3;
      return x > s.x0 - 3 && x < s.x1 + 3;
    });
    if (clash) continue;
    taken.push_back({x0, x1, x, row});
    return BandLabel{row, text, flip};
  }
  return std::nullopt;
}

// Left to right, each label takes its longest text that still leaves room for the short names of
// all labels after it (or for as many of them as any of its texts does): greedy without this
// lets the first few long labels fill every row.
std::vector<BandLabel> place_labels(const std::vector<LabelRequest>& requests, double right_edge) {
  std::vector<size_t> order(requests.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return requests[a].x < requests[b].x; });
  // The look-ahead is cubic in the number of labels; crowds get short names only.
  const bool look_ahead = requests.size() <= 30;
  std::vector<BandLabel> labels(requests.size());
  std::vector<LabelSpan> taken;
  for (size_t k = 0; k < order.size(); ++k) {
    const LabelRequest& request = requests[order[k]];
    const size_t remaining = order.size() - k - 1;
    std::optional<BandLabel> best;
    std::vector<LabelSpan> best_taken;
    size_t best_score = 0;
    for (size_t c = look_ahead ? 0 : request.candidates.size() - 1; c < request.candidates.size();
         ++c) {
      std::vector<LabelSpan> trial = taken;
      const auto label = try_place(trial, request.x, request.candidates[c], right_edge);
      if (!label) continue;
      size_t score = 0;
      if (look_ahead) {
        std::vector<LabelSpan> rest = trial;
        for (size_t j = k + 1; j < order.size(); ++j) {
          const LabelRequest& later = requests[order[j]];
          if (try_place(rest, later.x, later.candidates.back(), right_edge)) ++score;
        }
      }
      if (!best || score > best_score) {
        best = label;
        best_taken = std::move(trial);
        best_score = score;
      }
      if (!look_ahead || score == remaining) break;
    }
    if (best) {
      labels[order[k]] = *best;
      taken = std::move(best_taken);
    }
  }
  return labels;
}

// Everything the three panels share: geometry, the step axis and the events drawn across them.
class Timeline {
 public:
  Timeline(const Report& report, const RenderOptions& options)
      : report_(report), options_(options) {}

  std::string render();

 private:
  void layout();
  void draw_frame(const Panel& panel, const Axis& y, const Scale& ys, bool si, bool x_labels,
                  const std::string& heading);
  void draw_no_data(const Panel& panel, const std::string& message);
  void draw_throughput();
  void draw_rates();
  void draw_loss();
  void draw_events();
  double label_y(int row) const { return band_top_ + row * kRowHeight + 10; }
  void draw_band_label(double x, const BandLabel& label, const char* css_class);
  void draw_replan_table();
  double legend_x() const { return left_ + plot_width_ + 18; }
  void legend_line(double y, const std::string& label, const Attributes& stroke);
  // A line through pixel points (breaks at non-finite ones), not filled.
  void polyline(const Points& points, Attributes attributes);

  const Report& report_;
  const RenderOptions& options_;
  std::optional<svg::Document> svg_;  // once the layout knows the size

  double width_ = 0, height_ = 0, left_ = 74, right_margin_ = 176, plot_width_ = 0;
  double band_top_ = 0;
  Axis x_axis_;
  Scale xs_;
  Panel throughput_, rates_, loss_;
  size_t ranks_ = 0;
  int legend_columns_ = 1;
  bool any_injected_ = false;
  std::vector<BandLabel> replan_labels_, resume_labels_;
  int label_rows_ = 0;
  size_t table_rows_ = 0;
  std::vector<size_t> resumes_;
};

void Timeline::layout() {
  width_ = std::max(640, options_.width);
  plot_width_ = width_ - left_ - right_margin_;
  ranks_ = report_.num_ranks();
  for (const auto& s : report_.steps) any_injected_ = any_injected_ || !s.injected.empty();
  resumes_ = resume_points(report_.steps);

  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  auto extend = [&](int64_t step) {
    lo = std::min(lo, static_cast<double>(step));
    hi = std::max(hi, static_cast<double>(step));
  };
  for (const auto& r : report_.steps) extend(r.step);
  for (const auto& r : report_.evals) extend(r.step);
  for (const auto& r : report_.replans) extend(r.step);
  for (const auto& r : report_.declined) extend(r.step);
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  x_axis_ = step_axis(lo, hi);
  xs_ = {x_axis_.lo, x_axis_.hi, left_, left_ + plot_width_};

  std::vector<LabelRequest> requests;
  for (size_t i = 0; i < report_.replans.size(); ++i) {
    const ReplanRecord& r = report_.replans[i];
    std::string name = "R";
    name += std::to_string(i + 1);
    LabelRequest request{xs_(static_cast<double>(r.step)), {}};
    // The new plan matters more than the old one (the label to the left says it), so the old
    // one shortens first.
    const std::pair<size_t, size_t> limits[] = {
        {1000, 1000}, {24, 1000}, {14, 1000}, {14, 40}, {14, 24}};
    for (const auto& [old_limit, new_limit] : limits) {
      std::string text = name;
      text += " re-plan: ";
      text += truncate(r.old_plan, old_limit);
      text += " → ";
      text += truncate(r.new_plan, new_limit);
      request.candidates.push_back(text);
    }
    request.candidates.push_back(name);
    requests.push_back(std::move(request));
  }
  for (size_t r : resumes_) {
    requests.push_back({xs_(static_cast<double>(report_.steps[r].step)), {"resumed"}});
  }
  std::vector<BandLabel> labels = place_labels(requests, width_ - 6);
  for (const BandLabel& label : labels) label_rows_ = std::max(label_rows_, label.row + 1);
  replan_labels_.assign(labels.begin(),
                        labels.begin() + static_cast<std::ptrdiff_t>(report_.replans.size()));
  resume_labels_.assign(labels.begin() + static_cast<std::ptrdiff_t>(report_.replans.size()),
                        labels.end());

  band_top_ = 62;
  throughput_.top = band_top_ + label_rows_ * kRowHeight + 24;
  throughput_.height = 180;
  rates_.top = throughput_.bottom() + kPanelGap;
  // Room for the legend: one row per rank (in up to three columns) plus the line-style key.
  legend_columns_ = ranks_ <= 12 ? 1 : (ranks_ <= 48 ? 2 : 3);
  const size_t legend_rows =
      (ranks_ + static_cast<size_t>(legend_columns_) - 1) / static_cast<size_t>(legend_columns_);
  rates_.height =
      std::max(170.0, static_cast<double>(legend_rows + (any_injected_ ? 3 : 0)) * kRowHeight + 10);
  loss_.top = rates_.bottom() + kPanelGap;
  loss_.height = 170;
  table_rows_ = 2 * std::min(report_.replans.size(), kMaxTableReplans) +
                (report_.replans.size() > kMaxTableReplans ? 1 : 0);
  height_ = loss_.bottom() + 48;
  if (table_rows_ > 0) height_ += 28 + static_cast<double>(table_rows_) * kRowHeight;
}

void Timeline::draw_frame(const Panel& panel, const Axis& y, const Scale& ys, bool si,
                          bool x_labels, const std::string& heading) {
  svg::Document& s = *svg_;
  s.text(left_, panel.top - 9, heading, {{"class", "heading"}});
  s.rect(left_, panel.top, plot_width_, panel.height, {{"fill", "#fcfcfc"}, {"stroke", "none"}});
  for (double t : x_axis_.ticks) {
    const double x = xs_(t);
    s.line(x, panel.top, x, panel.bottom(), {{"class", "grid"}});
    s.line(x, panel.bottom(), x, panel.bottom() + 4, {{"class", "tick"}});
    if (x_labels) {
      s.text(x, panel.bottom() + 16, tick_label(t, x_axis_.step, false),
             {{"class", "tick-label"}, {"text-anchor", "middle"}});
    }
  }
  for (double t : y.ticks) {
    const double yy = ys(t);
    s.line(left_, yy, left_ + plot_width_, yy, {{"class", "grid"}});
    s.line(left_ - 4, yy, left_, yy, {{"class", "tick"}});
    s.text(left_ - 7, yy + 3.5, tick_label(t, y.step, si),
           {{"class", "tick-label"}, {"text-anchor", "end"}});
  }
  s.rect(left_, panel.top, plot_width_, panel.height, {{"class", "frame"}});
}

void Timeline::draw_no_data(const Panel& panel, const std::string& message) {
  svg_->text(left_ + plot_width_ / 2, panel.top + panel.height / 2, message,
             {{"class", "note"}, {"text-anchor", "middle"}});
}

void Timeline::legend_line(double y, const std::string& label, const Attributes& stroke) {
  const double x = legend_x();
  svg_->line(x, y - 3.5, x + 20, y - 3.5, stroke);
  svg_->text(x + 26, y, label, {{"class", "legend"}});
}

void Timeline::polyline(const Points& points, Attributes attributes) {
  attributes.emplace_back("fill", "none");
  svg_->path(path_data(points), attributes);
}

void Timeline::draw_throughput() {
  const auto& steps = report_.steps;
  double hi = 0;
  for (const auto& s : steps) {
    if (std::isfinite(s.tokens_per_s)) hi = std::max(hi, s.tokens_per_s);
  }
  const Axis y = nice_axis(0, hi > 0 ? hi * 1.04 : 1, 5);
  const Scale ys{y.lo, y.hi, throughput_.bottom(), throughput_.top};
  svg_->begin_group({{"id", "panel-throughput"}});
  draw_frame(throughput_, y, ys, true, false, "Throughput (tokens/s)");
  if (hi <= 0) {
    draw_no_data(throughput_, "no throughput in this file");
    svg_->end_group();
    return;
  }

  // Blocks of steps under one plan in one run: the median must not smear a re-plan's jump.
  std::vector<size_t> block_starts{0};
  {
    size_t replan = 0;
    for (size_t i = 1; i < steps.size(); ++i) {
      bool cut = steps[i].step <= steps[i - 1].step;
      while (replan < report_.replans.size() && report_.replans[replan].line < steps[i].line) {
        if (report_.replans[replan].line > steps[i - 1].line) cut = true;
        ++replan;
      }
      if (cut) block_starts.push_back(i);
    }
    block_starts.push_back(steps.size());
  }
  const size_t window =
      std::clamp<size_t>((steps.size() / 40) | 1, 5, 51);  // odd, so it centres on a step
  Points raw, medians, means;
  for (size_t b = 0; b + 1 < block_starts.size(); ++b) {
    const size_t begin = block_starts[b], end = block_starts[b + 1];
    std::vector<double> values;
    for (size_t i = begin; i < end; ++i) values.push_back(steps[i].tokens_per_s);
    const bool resumed = b > 0 && steps[begin].step <= steps[begin - 1].step;
    if (resumed) raw.push_back({kNaN, kNaN});
    for (size_t i = begin; i < end; ++i) {
      const double x = xs_(static_cast<double>(steps[i].step));
      raw.push_back({x, ys(steps[i].tokens_per_s)});
      const size_t lo = i - begin >= window / 2 ? i - window / 2 : begin;
      const size_t hi_index = std::min(end, i + window / 2 + 1);
      medians.push_back({x, ys(median(std::vector<double>(
                                values.begin() + static_cast<std::ptrdiff_t>(lo - begin),
                                values.begin() + static_cast<std::ptrdiff_t>(hi_index - begin))))});
    }
    medians.push_back({kNaN, kNaN});
    const double mean = mean_of(values);
    means.push_back({xs_(static_cast<double>(steps[begin].step)), ys(mean)});
    means.push_back({xs_(static_cast<double>(steps[end - 1].step)), ys(mean)});
    means.push_back({kNaN, kNaN});
  }
  polyline(raw, {{"class", "tps-raw"}});
  polyline(means, {{"class", "tps-mean"}});
  polyline(medians, {{"class", "tps-median"}});
  svg_->end_group();

  double row_y = throughput_.top + 14;
  legend_line(row_y, "per step", {{"class", "tps-raw"}});
  std::string median_label = "median of ";
  median_label += std::to_string(window);
  legend_line(row_y += kRowHeight, median_label, {{"class", "tps-median"}});
  legend_line(row_y += kRowHeight, report_.replans.empty() ? "mean" : "mean per plan",
              {{"class", "tps-mean"}});
  if (!report_.replans.empty())
    legend_line(row_y += kRowHeight, "re-plan", {{"class", "replan-line"}});
  if (!report_.declined.empty()) {
    row_y += kRowHeight;
    const double x = legend_x() + 10;
    svg_->path(down_triangle(x, row_y - 8, 5, 8), {{"class", "declined-marker"}});
    svg_->text(legend_x() + 26, row_y, "re-plan declined", {{"class", "legend"}});
  }
}

void Timeline::draw_rates() {
  const auto& steps = report_.steps;
  double lo = 1, hi = 1.5;
  for (const auto& s : steps) {
    for (const auto* series : {&s.rates, &s.injected}) {
      for (double v : *series) {
        if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
      }
    }
  }
  // Padding below 1 keeps healthy ranks off the frame's bottom edge.
  const Axis y = nice_axis(lo - 0.06 * (hi - lo), hi + 0.04 * (hi - lo), 5);
  const Scale ys{y.lo, y.hi, rates_.bottom(), rates_.top};
  svg_->begin_group({{"id", "panel-rates"}});
  draw_frame(rates_, y, ys, false, false, "Straggle rate per rank (1 = healthy)");
  if (ranks_ == 0) draw_no_data(rates_, "no per-rank rates in this file");
  if (ranks_ > 0 && y.lo < 1) {
    svg_->line(left_, ys(1), left_ + plot_width_, ys(1), {{"class", "baseline"}});
  }

  const auto resumed = [&](size_t i) { return i > 0 && steps[i].step <= steps[i - 1].step; };
  for (size_t rank = 0; rank < ranks_; ++rank) {
    Points measured, injected;
    for (size_t i = 0; i < steps.size(); ++i) {
      const double x = xs_(static_cast<double>(steps[i].step));
      if (resumed(i)) measured.push_back({kNaN, kNaN}), injected.push_back({kNaN, kNaN});
      const auto& s = steps[i];
      measured.push_back({x, rank < s.rates.size() ? ys(s.rates[rank]) : kNaN});
      injected.push_back({x, rank < s.injected.size() ? ys(s.injected[rank]) : kNaN});
    }
    const std::string colour = rank_colour(rank);
    // Injected on top: its dashes stay visible over a noisy measured line.
    polyline(measured, stroke(colour, "rate-measured"));
    polyline(injected, stroke(colour, "rate-injected"));
  }
  svg_->end_group();

  double y0 = rates_.top + 14;
  if (any_injected_) {
    legend_line(y0, "measured", {{"class", "rate-measured"}, {"stroke", "#444"}});
    legend_line(y0 + kRowHeight, "injected", {{"class", "rate-injected"}, {"stroke", "#444"}});
    y0 += 2.5 * kRowHeight;
  }
  const double column_width = (right_margin_ - 22) / legend_columns_;
  const size_t rows =
      (ranks_ + static_cast<size_t>(legend_columns_) - 1) / static_cast<size_t>(legend_columns_);
  const double swatch = legend_columns_ == 3 ? 12 : 18;
  for (size_t rank = 0; rank < ranks_; ++rank) {
    const double x = legend_x() + static_cast<double>(rank / rows) * column_width;
    const double yy = y0 + static_cast<double>(rank % rows) * kRowHeight;
    std::string label = legend_columns_ == 3 ? "r" : "rank ";
    label += std::to_string(rank);
    svg_->begin_group({{"class", "legend-rank"}});
    svg_->line(x, yy - 3.5, x + swatch, yy - 3.5, stroke(rank_colour(rank), "rate-measured"));
    svg_->text(x + swatch + 5, yy, label, {{"class", "legend"}});
    svg_->end_group();
  }
}

void Timeline::draw_loss() {
  const auto& steps = report_.steps;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& s : steps) {
    if (std::isfinite(s.loss)) lo = std::min(lo, s.loss), hi = std::max(hi, s.loss);
  }
  for (const auto& e : report_.evals) {
    if (std::isfinite(e.val_loss)) lo = std::min(lo, e.val_loss), hi = std::max(hi, e.val_loss);
  }
  const bool any = std::isfinite(lo);
  const Axis y =
      any ? nice_axis(lo - 0.03 * (hi - lo), hi + 0.03 * (hi - lo), 5) : nice_axis(0, 1, 5);
  const Scale ys{y.lo, y.hi, loss_.bottom(), loss_.top};
  svg_->begin_group({{"id", "panel-loss"}});
  draw_frame(loss_, y, ys, false, true, "Loss");
  svg_->text(left_ + plot_width_ / 2, loss_.bottom() + 34, "step",
             {{"class", "axis-label"}, {"text-anchor", "middle"}});
  if (!any) draw_no_data(loss_, "no loss in this file");

  Points train;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i > 0 && steps[i].step <= steps[i - 1].step) train.push_back({kNaN, kNaN});
    train.push_back({xs_(static_cast<double>(steps[i].step)), ys(steps[i].loss)});
  }
  polyline(train, {{"class", "loss-train"}});
  for (const auto& e : report_.evals) {
    if (!std::isfinite(e.val_loss)) continue;
    svg_->circle(
        xs_(static_cast<double>(e.step)), ys(e.val_loss), 3, {{"class", "loss-val"}},
        "step " + std::to_string(e.step) + ": val loss " + printf_string("%.4f", e.val_loss));
  }
  svg_->end_group();
  const double y0 = loss_.top + 14;
  legend_line(y0, "train", {{"class", "loss-train"}});
  svg_->circle(legend_x() + 10, y0 + kRowHeight - 3.5, 3, {{"class", "loss-val"}});
  svg_->text(legend_x() + 26, y0 + kRowHeight, "validation", {{"class", "legend"}});
}

void Timeline::draw_band_label(double x, const BandLabel& label, const char* css_class) {
  if (label.row < 0) return;
  Attributes attributes{{"class", css_class}};
  if (label.flip) attributes.emplace_back("text-anchor", "end");
  svg_->text(label.flip ? x - 4 : x + 4, label_y(label.row), label.text, attributes);
}

void Timeline::draw_events() {
  const double bottom = loss_.bottom();
  for (size_t i = 0; i < resumes_.size(); ++i) {
    const int64_t step = report_.steps[resumes_[i]].step;
    const double x = xs_(static_cast<double>(step));
    const BandLabel& label = resume_labels_[i];
    svg_->begin_group({{"class", "resume"}}, "run resumed at step " + std::to_string(step));
    svg_->line(x, label.row < 0 ? throughput_.top : label_y(label.row) - 9, x, bottom,
               {{"class", "resume-line"}});
    svg_->end_group();
    draw_band_label(x, label, "resume-label");
  }
  for (const auto& d : report_.declined) {
    const double x = xs_(static_cast<double>(d.step));
    std::string tooltip = "re-plan declined at step " + std::to_string(d.step);
    if (!d.reason.empty()) tooltip += ": " + d.reason;
    svg_->begin_group({{"class", "declined"}}, tooltip);
    for (const Panel* panel : {&throughput_, &rates_}) {
      svg_->path(down_triangle(x, panel->top + 1, 4.5, 7), {{"class", "declined-marker"}});
    }
    svg_->end_group();
  }
  for (size_t i = 0; i < report_.replans.size(); ++i) {
    const ReplanRecord& r = report_.replans[i];
    const double x = xs_(static_cast<double>(r.step));
    const BandLabel& label = replan_labels_[i];
    std::ostringstream tooltip;
    tooltip << "R" << (i + 1) << ": re-plan at step " << r.step << "\n"
            << r.old_plan << " → " << r.new_plan << "\nmoved "
            << format_bytes(static_cast<double>(r.bytes_moved)) << " in "
            << format_duration(r.migration_s) << "; planning took " << format_duration(r.planning_s)
            << "\npredicted step time " << format_duration(r.predicted_old_s) << " → "
            << format_duration(r.predicted_new_s) << " (gain "
            << format_duration(r.predicted_gain_s) << ")";
    svg_->begin_group({{"class", "replan"}}, tooltip.str());
    svg_->line(x, label.row < 0 ? throughput_.top : label_y(label.row) - 9, x, bottom,
               {{"class", "replan-line"}});
    svg_->line(x, throughput_.top, x, bottom, {{"class", "hit"}});
    svg_->end_group();
    draw_band_label(x, label, "replan-label");
  }
}

// Two lines per re-plan (what it cost and predicted, then the plans), since plan texts are long.
void Timeline::draw_replan_table() {
  if (table_rows_ == 0) return;
  double y = loss_.bottom() + 48 + 16;
  svg_->text(left_, y, "Re-plans", {{"class", "heading"}});
  const size_t max_chars = static_cast<size_t>((width_ - left_ - 40) / kCharWidth);
  for (size_t i = 0; i < std::min(report_.replans.size(), kMaxTableReplans); ++i) {
    const ReplanRecord& r = report_.replans[i];
    std::ostringstream head, plans;
    head << "R" << (i + 1) << "  step " << r.step << ": moved "
         << format_bytes(static_cast<double>(r.bytes_moved)) << " in "
         << format_duration(r.migration_s) << "; predicted step time "
         << format_duration(r.predicted_old_s) << " → " << format_duration(r.predicted_new_s)
         << " (gain " << format_duration(r.predicted_gain_s) << "); planning "
         << format_duration(r.planning_s);
    plans << r.old_plan << "  →  " << r.new_plan;
    y += kRowHeight;
    svg_->text(left_, y, truncate(head.str(), max_chars), {{"class", "table"}});
    y += kRowHeight;
    svg_->text(left_ + 26, y, truncate(plans.str(), max_chars), {{"class", "table plans"}});
  }
  if (report_.replans.size() > kMaxTableReplans) {
    y += kRowHeight;
    std::string more = "… and ";
    more += std::to_string(report_.replans.size() - kMaxTableReplans);
    more += " more (hover over the dashed lines for each one)";
    svg_->text(left_, y, more, {{"class", "table"}});
  }
}

std::string Timeline::render() {
  layout();
  svg_.emplace(width_, height_);
  svg::Document& s = *svg_;
  s.style(
      "text{font-family:'DejaVu Sans',Helvetica,Arial,sans-serif;fill:#222}\n"
      ".title{font-size:17px;font-weight:bold}\n"
      ".subtitle{font-size:12px;fill:#555}\n"
      ".heading{font-size:12.5px;font-weight:bold;fill:#333}\n"
      ".tick-label,.legend,.table{font-size:11px;fill:#444}\n"
      ".axis-label{font-size:12px;fill:#444}\n"
      ".note{font-size:12px;fill:#999;font-style:italic}\n"
      ".replan-label{font-size:11px;fill:#333}\n"
      ".resume-label{font-size:10.5px;fill:#999}\n"
      ".plans{fill:#666}\n"
      ".grid{stroke:#ececec;stroke-width:1}\n"
      ".tick{stroke:#888;stroke-width:1}\n"
      ".frame{fill:none;stroke:#bbb;stroke-width:1}\n"
      ".baseline{stroke:#aaa;stroke-width:1;stroke-dasharray:2 3}\n"
      ".tps-raw{stroke:#9ecae1;stroke-width:1}\n"
      ".tps-median{stroke:#08519c;stroke-width:1.4}\n"
      ".tps-mean{stroke:#e6550d;stroke-width:1.2;stroke-dasharray:1 3;"
      "stroke-linecap:round}\n"
      ".rate-measured{fill:none;stroke-width:1.4;stroke-opacity:0.75}\n"
      ".rate-injected{fill:none;stroke-width:1.8;stroke-dasharray:7 4}\n"
      ".loss-train{stroke:#1f77b4;stroke-width:1.3}\n"
      ".loss-val{fill:#ff7f0e;stroke:#fff;stroke-width:1}\n"
      ".replan-line{stroke:#333;stroke-width:1.1;stroke-dasharray:5 3}\n"
      ".hit{stroke:transparent;stroke-width:8}\n"
      ".resume-line{stroke:#bbb;stroke-width:1;stroke-dasharray:1 2}\n"
      ".declined-marker{fill:#999}\n");
  s.rect(0, 0, width_, height_, {{"fill", "#fff"}});
  std::string title = options_.title;
  if (title.empty()) {
    title = "malleus timeline: ";
    title += report_.source;
  }
  s.text(left_, 30, title, {{"class", "title"}});

  std::ostringstream subtitle;
  subtitle << report_.steps.size() << " steps";
  double mean_tps = 0;
  {
    std::vector<double> values;
    for (const auto& step : report_.steps) values.push_back(step.tokens_per_s);
    mean_tps = mean_of(values);
  }
  if (std::isfinite(mean_tps)) subtitle << " · mean " << format_count(mean_tps) << " tokens/s";
  int64_t bytes = 0;
  for (const auto& r : report_.replans) bytes += r.bytes_moved + r.migration_background_bytes;
  subtitle << " · " << report_.replans.size()
           << (report_.replans.size() == 1 ? " re-plan" : " re-plans");
  if (!report_.declined.empty()) subtitle << " (" << report_.declined.size() << " declined)";
  if (!report_.replans.empty())
    subtitle << " · " << format_bytes(static_cast<double>(bytes)) << " moved";
  if (!resumes_.empty()) subtitle << " · resumed " << resumes_.size() << "×";
  s.text(left_, 49, subtitle.str(), {{"class", "subtitle"}});

  draw_throughput();
  draw_rates();
  draw_loss();
  draw_events();
  draw_replan_table();
  return s.finish();
}

}  // namespace

size_t Report::num_ranks() const {
  size_t ranks = 0;
  for (const auto& s : steps) ranks = std::max({ranks, s.rates.size(), s.injected.size()});
  return ranks;
}

Report parse_metrics(const std::string& text, const std::string& source) {
  Report report;
  report.source = source;
  std::istringstream in(text);
  std::string line;
  size_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (blank(line)) continue;
    const std::string where = source + ":" + std::to_string(number);
    const auto record = metrics::parse_record(parse_json(line, where), where);
    if (!record) continue;  // a kind the timeline has nothing to draw for
    if (const auto* step = std::get_if<metrics::StepRecord>(&*record)) {
      report.steps.push_back({*step, number});
    } else if (const auto* eval = std::get_if<metrics::EvalRecord>(&*record)) {
      report.evals.push_back({*eval, number});
    } else if (const auto* replan = std::get_if<metrics::ReplanRecord>(&*record)) {
      (replan->switched ? report.replans : report.declined).push_back({*replan, number});
    }
  }
  return report;
}

Report read_metrics(const std::filesystem::path& path) {
  return parse_metrics(read_file(path), path.string());
}

std::vector<PlanSegment> plan_segments(const Report& report) {
  std::vector<PlanSegment> segments;
  std::vector<double> values;
  size_t replan = 0;
  bool open = false;
  auto close = [&] {
    if (!open) return;
    segments.back().mean_tokens_per_s = mean_of(values);
    values.clear();
    open = false;
  };
  for (const StepRecord& s : report.steps) {
    while (replan < report.replans.size() && report.replans[replan].line < s.line) {
      close();
      ++replan;
    }
    if (!open) {
      segments.push_back({s.plan, s.step, s.step, 0, kNaN});
      open = true;
    }
    PlanSegment& segment = segments.back();
    segment.last_step = s.step;
    ++segment.num_steps;
    values.push_back(s.tokens_per_s);
  }
  close();
  return segments;
}

std::string summarize(const Report& report) {
  std::ostringstream out;
  out << report.source << ": " << report.steps.size() << " steps";
  if (!report.steps.empty()) {
    int64_t first = report.steps.front().step, last = first;
    for (const auto& s : report.steps)
      first = std::min(first, s.step), last = std::max(last, s.step);
    out << " (" << first << "-" << last << ")";
  }
  out << ", " << report.evals.size() << " evaluations";
  const size_t resumes = resume_points(report.steps).size();
  if (resumes > 0) out << ", resumed " << resumes << (resumes == 1 ? " time" : " times");
  out << "\n";
  if (!report.steps.empty()) {
    out << "  last loss " << printf_string("%.4f", report.steps.back().loss);
    if (!report.evals.empty()) {
      out << ", last val loss " << printf_string("%.4f", report.evals.back().val_loss);
    }
    out << "\n";
  }
  std::vector<double> all;
  for (const auto& s : report.steps) all.push_back(s.tokens_per_s);
  out << "throughput: mean " << format_count(mean_of(all)) << " tokens/s\n";
  const auto segments = plan_segments(report);
  for (size_t i = 0; i < segments.size(); ++i) {
    const PlanSegment& g = segments[i];
    out << "  plan " << (i + 1) << ": steps " << g.first_step << "-" << g.last_step << " ("
        << g.num_steps << " steps), mean " << format_count(g.mean_tokens_per_s) << " tokens/s";
    if (!g.plan.empty()) out << "  [" << g.plan << "]";
    out << "\n";
  }
  int64_t bytes = 0;
  double migration = 0;
  for (const auto& r : report.replans) {
    bytes += r.bytes_moved + r.migration_background_bytes;
    if (std::isfinite(r.migration_s)) migration += r.migration_s;
  }
  out << "re-plans: " << report.replans.size() << " (" << report.declined.size() << " declined), "
      << format_bytes(static_cast<double>(bytes)) << " moved in " << format_duration(migration)
      << "\n";
  return out.str();
}

std::string render_svg(const Report& report, const RenderOptions& options) {
  return Timeline(report, options).render();
}

}  // namespace malleus::report
