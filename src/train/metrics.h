// Progress output: the human-readable step line and the JSONL metrics file carry the same fields.
#pragma once

#include <filesystem>
#include <string>

#include "common/json.h"

namespace malleus::train {

// Appends one JSON object per line. A line is in the file whole or not at all: a write that fails
// (a full disk) is cut back off before the error is thrown, and a torn last line left by a crash
// in the middle of a write is removed, with a warning, when the file is opened again; so readers
// (`malleus report`) never meet half a record, and later runs append after whole lines.
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
  int fd_ = -1;
};

// "1h02m", "3m05s", "12.3s"
std::string format_duration(double seconds);
// "12.3k", "1.20M"
std::string format_count(double value);

}  // namespace malleus::train
