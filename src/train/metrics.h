// Progress output: the human-readable step line and the JSONL metrics file carry the same fields.
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>

#include "common/json.h"

namespace malleus::train {

// Appends one JSON object per line and flushes, so a crash loses at most the current line.
class MetricsLog {
 public:
  explicit MetricsLog(const std::filesystem::path& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const Json& record);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::FILE* file_;
};

// "1h02m", "3m05s", "12.3s"
std::string format_duration(double seconds);
// "12.3k", "1.20M"
std::string format_count(double value);

}  // namespace malleus::train
