#include "svg/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace malleus::svg {

std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string number(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.1f", value);
  const std::string text = buffer;
  return text == "-0.0" ? "0.0" : text;
}

Document::Document(double width, double height) {
  out_ = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + number(width) + "\" height=\"" +
         number(height) + "\" viewBox=\"0 0 " + number(width) + ' ' + number(height) + "\">\n";
}

void Document::open(std::string_view tag, const Attributes& attributes) {
  out_ += '<';
  out_ += tag;
  for (const auto& [name, value] : attributes) {
    out_ += ' ';
    out_ += name;
    out_ += "=\"";
    out_ += escape(value);
    out_ += '"';
  }
}

void Document::title(std::string_view tooltip) {
  out_ += "<title>";
  out_ += escape(tooltip);
  out_ += "</title>";
}

void Document::style(std::string_view css) {
  out_ += "<style>\n";
  out_ += escape(css);
  out_ += "</style>\n";
}

void Document::text(double x, double y, std::string_view content, const Attributes& attributes) {
  Attributes all{{"x", number(x)}, {"y", number(y)}};
  all.insert(all.end(), attributes.begin(), attributes.end());
  open("text", all);
  out_ += '>';
  out_ += escape(content);
  out_ += "</text>\n";
}

void Document::line(double x1, double y1, double x2, double y2, const Attributes& attributes) {
  Attributes all{{"x1", number(x1)}, {"y1", number(y1)}, {"x2", number(x2)}, {"y2", number(y2)}};
  all.insert(all.end(), attributes.begin(), attributes.end());
  open("line", all);
  out_ += "/>\n";
}

void Document::rect(double x, double y, double width, double height, const Attributes& attributes) {
  Attributes all{
      {"x", number(x)}, {"y", number(y)}, {"width", number(width)}, {"height", number(height)}};
  all.insert(all.end(), attributes.begin(), attributes.end());
  open("rect", all);
  out_ += "/>\n";
}

void Document::circle(double cx, double cy, double r, const Attributes& attributes,
                      std::string_view tooltip) {
  Attributes all{{"cx", number(cx)}, {"cy", number(cy)}, {"r", number(r)}};
  all.insert(all.end(), attributes.begin(), attributes.end());
  open("circle", all);
  if (tooltip.empty()) {
    out_ += "/>\n";
    return;
  }
  out_ += '>';
  title(tooltip);
  out_ += "</circle>\n";
}

void Document::path(std::string_view d, const Attributes& attributes) {
  if (d.empty()) return;
  Attributes all{{"d", std::string(d)}};
  all.insert(all.end(), attributes.begin(), attributes.end());
  open("path", all);
  out_ += "/>\n";
}

void Document::begin_group(const Attributes& attributes, std::string_view tooltip) {
  open("g", attributes);
  out_ += '>';
  if (!tooltip.empty()) title(tooltip);
  out_ += '\n';
  ++open_groups_;
}

void Document::end_group() {
  if (open_groups_ == 0) return;
  out_ += "</g>\n";
  --open_groups_;
}

std::string Document::finish() {
  while (open_groups_ > 0) end_group();
  out_ += "</svg>\n";
  return std::move(out_);
}

namespace {

Points thin_out(const Points& pts) {
  Points out;
  size_t begin = 0;
  while (begin < pts.size()) {
    size_t end = begin + 1;
    const double column = std::floor(pts[begin].first);
    while (end < pts.size() && std::floor(pts[end].first) == column) ++end;
    if (end - begin <= 4) {
      out.insert(out.end(), pts.begin() + static_cast<std::ptrdiff_t>(begin),
                 pts.begin() + static_cast<std::ptrdiff_t>(end));
    } else {
      size_t lowest = begin, highest = begin;
      for (size_t i = begin; i < end; ++i) {
        if (pts[i].second > pts[lowest].second) lowest = i;  // SVG y grows downwards
        if (pts[i].second < pts[highest].second) highest = i;
      }
      out.push_back(pts[begin]);
      out.push_back(pts[std::min(lowest, highest)]);
      out.push_back(pts[std::max(lowest, highest)]);
      out.push_back(pts[end - 1]);
    }
    begin = end;
  }
  return out;
}

}  // namespace

std::string path_data(const Points& pts) {
  std::string d;
  Points piece;
  auto flush = [&] {
    const Points thin = thin_out(piece);
    for (size_t i = 0; i < thin.size(); ++i) {
      // Inside a flat stretch only the ends matter.
      const std::string y = number(thin[i].second);
      if (i > 0 && i + 1 < thin.size() && number(thin[i - 1].second) == y &&
          number(thin[i + 1].second) == y) {
        continue;
      }
      d += i == 0 ? 'M' : 'L';
      d += number(thin[i].first);
      d += ' ';
      d += y;
    }
    if (thin.size() == 1) {  // a lone point still shows as a dot
      d += 'h';
      d += number(0.5);
    }
    piece.clear();
  };
  for (const auto& p : pts) {
    if (std::isfinite(p.first) && std::isfinite(p.second)) {
      piece.push_back(p);
    } else {
      flush();
    }
  }
  flush();
  return d;
}

double nice_step(double range, int target) {
  const double raw = range / target;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

Axis nice_axis(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (hi - lo < 1e-12) {
    const double pad = std::max(std::fabs(lo) * 0.1, 0.5);
    lo -= pad;
    hi += pad;
  }
  Axis axis;
  axis.step = nice_step(hi - lo, target);
  axis.lo = std::floor(lo / axis.step + 1e-9) * axis.step;
  axis.hi = std::ceil(hi / axis.step - 1e-9) * axis.step;
  for (double t = axis.lo; t <= axis.hi + axis.step * 1e-6; t += axis.step) {
    axis.ticks.push_back(std::fabs(t) < axis.step * 1e-9 ? 0.0 : t);
  }
  return axis;
}

}  // namespace malleus::svg
