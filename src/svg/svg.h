// A small SVG writer for the project's charts (`malleus report`'s timeline, the scenario charts of
// `malleus simulate` and `malleus experiments`), and the axis arithmetic they share. Every text and
// attribute value it writes is escaped, so names that come from files and command lines (plans,
// scenarios, titles) cannot break the document. Kept in C++ rather than moved to a plotting library
// so that `malleus report`, which the main command runs at the end of every demo, needs nothing
// beyond the binary (docs/cost-model.md, "Charts").
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace malleus::svg {

// &, <, > and " as entities: safe in text and in double-quoted attribute values.
std::string escape(std::string_view text);
// A coordinate with one decimal (finer than a pixel, keeps files small); never "-0.0".
std::string number(double value);

// An element's attributes, written in order; values are escaped.
using Attributes = std::vector<std::pair<std::string, std::string>>;

class Document {
 public:
  Document(double width, double height);

  // A <style> sheet (its text is escaped like any other).
  void style(std::string_view css);
  void text(double x, double y, std::string_view content, const Attributes& attributes = {});
  void line(double x1, double y1, double x2, double y2, const Attributes& attributes = {});
  void rect(double x, double y, double width, double height, const Attributes& attributes = {});
  // `tooltip`, when given, is the element's <title> (shown on hover).
  void circle(double cx, double cy, double r, const Attributes& attributes = {},
              std::string_view tooltip = {});
  // Path data `d` (see path_data); nothing is written for empty data.
  void path(std::string_view d, const Attributes& attributes = {});
  void begin_group(const Attributes& attributes = {}, std::string_view tooltip = {});
  void end_group();
  // Closes the document (and any open group) and returns it.
  std::string finish();

 private:
  void open(std::string_view tag, const Attributes& attributes);
  void title(std::string_view tooltip);

  std::string out_;
  int open_groups_ = 0;
};

using Points = std::vector<std::pair<double, double>>;

// Path data of a polyline in pixel coordinates; a point with a non-finite coordinate starts a new
// piece. Points that land in the same pixel column are thinned to that column's first, lowest,
// highest and last, so a long series draws the same picture from a path of bounded size.
std::string path_data(const Points& points);

// A linear map from data [d0, d1] to pixels [r0, r1].
struct Scale {
  double d0 = 0, d1 = 1, r0 = 0, r1 = 1;
  double operator()(double v) const { return r0 + (v - d0) / (d1 - d0) * (r1 - r0); }
};

struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks;
};

// A round tick step (1, 2, 2.5 or 5 × 10^k) giving about `target` steps over `range`.
double nice_step(double range, int target);
// [lo, hi] widened to whole tick steps, so the frame's edges carry labels.
Axis nice_axis(double lo, double hi, int target);

}  // namespace malleus::svg
