#include "train/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include "common/error.h"

namespace malleus::train {

MetricsLog::MetricsLog(const std::filesystem::path& path) : path_(path) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  file_ = std::fopen(path.c_str(), "a");
  check(file_ != nullptr,
        "cannot open metrics file " + path.string() + ": " + std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  std::fclose(file_);
}

void MetricsLog::write(const Json& record) {
  std::string line = record.dump() + "\n";
  check(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
        "cannot write metrics file " + path_.string());
}

std::string format_duration(double seconds) {
  char text[32];
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  if (seconds < 60) {
    std::snprintf(text, sizeof text, "%.1fs", seconds);
  } else if (seconds < 3600) {
    std::snprintf(text, sizeof text, "%dm%02ds", static_cast<int>(seconds) / 60,
                  static_cast<int>(seconds) % 60);
  } else {
    std::snprintf(text, sizeof text, "%dh%02dm", static_cast<int>(seconds) / 3600,
                  static_cast<int>(seconds) / 60 % 60);
  }
  return text;
}

std::string format_count(double value) {
  char text[32];
  if (value >= 1e9) {
    std::snprintf(text, sizeof text, "%.2fB", value / 1e9);
  } else if (value >= 1e6) {
    std::snprintf(text, sizeof text, "%.2fM", value / 1e6);
  } else if (value >= 1e3) {
    std::snprintf(text, sizeof text, "%.1fk", value / 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.0f", value);
  }
  return text;
}

}  // namespace malleus::train
