#include "common/format.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace malleus {

namespace {

std::string printf_string(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

}  // namespace

std::string format_count(double value) {
  if (!std::isfinite(value)) return "n/a";
  // The suffix of the value as printed: 999,999 prints as "1M", not "1e+03k".
  struct Suffix {
    double scale;
    const char* name;
  };
  const double rounded = std::fabs(std::strtod(printf_string("%.3g", value).c_str(), nullptr));
  for (const Suffix& suffix : {Suffix{1e9, "B"}, Suffix{1e6, "M"}, Suffix{1e3, "k"}}) {
    if (rounded >= suffix.scale) return printf_string("%.3g", value / suffix.scale) + suffix.name;
  }
  return printf_string("%.3g", value);
}

std::string format_bytes(double bytes) {
  if (!std::isfinite(bytes)) return "n/a";
  if (std::fabs(bytes) < 1024) return printf_string("%.0f", bytes) + " B";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = bytes / 1024;
  size_t unit = 0;
  // The unit of the value as printed: 1,048,575 bytes is "1.00 MiB", not "1024.00 KiB".
  while (unit + 1 < std::size(units) && std::fabs(std::round(value * 100) / 100) >= 1024) {
    value /= 1024;
    ++unit;
  }
  return printf_string("%.2f", value) + ' ' + units[unit];
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds)) return "n/a";
  const char* sign = seconds < 0 ? "-" : "";
  seconds = std::fabs(seconds);
  char text[48];
  if (std::round(seconds * 1e3) < 1e3) {
    std::snprintf(text, sizeof text, "%s%.0f ms", sign, seconds * 1e3);
  } else if (std::round(seconds * 100) < 6000) {
    std::snprintf(text, sizeof text, "%s%.2f s", sign, seconds);
  } else if (const long long whole = std::llround(seconds); whole < 3600) {
    std::snprintf(text, sizeof text, "%s%lldm%02llds", sign, whole / 60, whole % 60);
  } else {
    std::snprintf(text, sizeof text, "%s%lldh%02lldm", sign, whole / 3600, whole / 60 % 60);
  }
  return text;
}

std::string format_counted(long long count, const std::string& noun) {
  return std::to_string(count) + " " + noun + (count == 1 ? "" : "s");
}

}  // namespace malleus
