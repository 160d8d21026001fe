#include "metrics/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "common/error.h"
#include "common/format.h"
#include "metrics/schema.h"

namespace malleus::metrics {

namespace {

[[noreturn]] void fail(const std::string& what, const std::filesystem::path& path, int error) {
  throw Error("cannot " + what + " metrics file " + path.string() + ": " + std::strerror(error));
}

// Removes an incomplete last line (no final newline); returns how many bytes it had.
off_t cut_torn_tail(int fd, const std::filesystem::path& path) {
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size < 0) fail("read", path, errno);
  off_t end = size;  // the file up to `end` holds whole lines only
  char chunk[4096];
  while (end > 0) {
    const off_t start = std::max<off_t>(0, end - static_cast<off_t>(sizeof chunk));
    const auto length = static_cast<size_t>(end - start);
    if (::pread(fd, chunk, length, start) != static_cast<ssize_t>(length))
      fail("read", path, errno);
    const char* newline = static_cast<const char*>(::memrchr(chunk, '\n', length));
    if (newline != nullptr) {
      end = start + (newline - chunk) + 1;
      break;
    }
    end = start;
  }
  if (end != size && ::ftruncate(fd, end) != 0) fail("repair", path, errno);
  return size - end;
}

constexpr const char* kSwitched = "replan";
constexpr const char* kDeclined = "replan_declined";
constexpr const char* kRestart = "restart";

// ---- writing -----------------------------------------------------------------------------------

void put(Json& json, const char* key, double value) {
  if (!std::isnan(value)) json[key] = value;
}
template <typename T>
void put(Json& json, const char* key, const T& value) {
  json[key] = value;
}

template <typename Record>
Json write(const Record& record) {
  Json json = Json::object();
  std::apply([&](const auto&... field) { (put(json, field.key, record.*(field.member)), ...); },
             fields(&record));
  return json;
}

// ---- reading: typed access to one line's keys; every message names the file and line ----------

class Reader {
 public:
  Reader(const Json& object, const std::string& where) : object_(object), where_(where) {}

  bool has(const char* key) const { return object_.contains(key); }

  void get(const char* key, bool required, double& out) const {
    const Json* value = find(key, required);
    if (value == nullptr || value->is_null()) return;
    if (!value->is_number()) wrong_type(key, "a number");
    out = value->get<double>();
  }
  void get(const char* key, bool required, bool& out) const {
    const Json* value = find(key, required);
    if (value == nullptr || value->is_null()) return;
    if (!value->is_boolean()) wrong_type(key, "true or false");
    out = value->get<bool>();
  }
  void get(const char* key, bool required, int64_t& out) const {
    const Json* value = find(key, required);
    if (value == nullptr) return;
    if (!value->is_number_integer()) wrong_type(key, "an integer");
    out = value->get<int64_t>();
  }
  void get(const char* key, bool required, std::string& out) const {
    const Json* value = find(key, required);
    if (value == nullptr || value->is_null()) return;
    if (!value->is_string()) wrong_type(key, "a string");
    out = value->get<std::string>();
  }
  void get(const char* key, bool required, std::vector<double>& out) const {
    const Json* value = find(key, required);
    if (value == nullptr || value->is_null()) return;
    if (!value->is_array()) wrong_type(key, "an array of numbers");
    for (const Json& element : *value) {
      if (element.is_null()) {
        out.push_back(kUnknown);
      } else if (element.is_number()) {
        out.push_back(element.get<double>());
      } else {
        wrong_type(key, "an array of numbers");
      }
    }
  }

  void get(const char* key, bool required, std::vector<int64_t>& out) const {
    const Json* value = find(key, required);
    if (value == nullptr || value->is_null()) return;
    if (!value->is_array()) wrong_type(key, "an array of integers");
    for (const Json& element : *value) {
      if (!element.is_number_integer()) wrong_type(key, "an array of integers");
      out.push_back(element.get<int64_t>());
    }
  }

  void get(const char* key, bool required, std::vector<std::string>& out) const {
    const Json* value = find(key, required);
    if (value == nullptr || value->is_null()) return;
    if (!value->is_array()) wrong_type(key, "an array of strings");
    for (const Json& element : *value) {
      if (!element.is_string()) wrong_type(key, "an array of strings");
      out.push_back(element.get<std::string>());
    }
  }

  template <typename Record>
  Record read() const {
    Record record;
    std::apply(
        [&](const auto&... field) {
          (get(field.key, field.required, record.*(field.member)), ...);
        },
        fields(&record));
    return record;
  }

 private:
  const Json* find(const char* key, bool required) const {
    const auto it = object_.find(key);
    if (it != object_.end()) return &*it;
    check(!required, where_ + ": missing key \"" + key + "\"");
    return nullptr;
  }
  [[noreturn]] void wrong_type(const char* key, const char* expected) const {
    throw Error(where_ + ": key \"" + key + "\" must be " + expected + " (value " +
                object_.at(key).dump() + ")");
  }

  const Json& object_;
  const std::string& where_;
};

}  // namespace

Json to_json(const MetricsRecord& record) {
  return std::visit(
      [](const auto& r) {
        Json json = write(r);
        if constexpr (std::is_same_v<std::decay_t<decltype(r)>, ReplanRecord>) {
          json["event"] = r.switched ? kSwitched : kDeclined;
        } else if constexpr (std::is_same_v<std::decay_t<decltype(r)>, RestartRecord>) {
          json["event"] = kRestart;
        }
        return json;
      },
      record);
}

std::optional<MetricsRecord> parse_record(const Json& object, const std::string& where) {
  check(object.is_object(), where + ": expected a JSON object");
  const Reader in(object, where);
  if (in.has("event")) {
    std::string event;
    in.get("event", true, event);
    if (event == kRestart) return in.read<RestartRecord>();
    if (event != kSwitched && event != kDeclined) return std::nullopt;
    ReplanRecord r = in.read<ReplanRecord>();
    r.switched = event == kSwitched;
    return r;
  }
  if (in.has("loss") || in.has("tokens_per_s")) return in.read<StepRecord>();
  if (in.has("val_loss")) return in.read<EvalRecord>();
  return std::nullopt;
}

std::string describe(const ReplanRecord& r) {
  char text[640];
  if (!r.switched) {
    std::snprintf(text, sizeof text, "re-plan declined at step %lld: %s",
                  static_cast<long long>(r.step), r.reason.c_str());
    return text;
  }
  std::snprintf(text, sizeof text, "re-plan at step %lld: %s -> %s | predicted %.3f -> %.3f s/step",
                static_cast<long long>(r.step), r.old_plan.c_str(), r.new_plan.c_str(),
                r.predicted_old_s, r.predicted_new_s);
  std::string line = text;
  if (!std::isnan(r.migration_s)) {  // measured by an engine that moves state
    line += " | moved " + format_bytes(static_cast<double>(r.bytes_moved));
    std::snprintf(text, sizeof text, " in %.3f s", r.migration_s);
    line += text;
  }
  std::snprintf(text, sizeof text, " (planning %.3f s, %s search)", r.planning_s, r.search.c_str());
  line += text;
  if (r.migration_background_bytes > 0) {
    line += "; " + format_bytes(static_cast<double>(r.migration_background_bytes)) +
            " of Adam moments move in the background of the next step";
  }
  return line;
}

MetricsLog::MetricsLog(const std::filesystem::path& path) : path_(path) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("open", path, errno);
  try {
    if (const off_t torn = cut_torn_tail(fd_, path_); torn > 0) {
      std::fprintf(stderr,
                   "warning: %s ended in an incomplete line (%lld bytes, from a write that was "
                   "interrupted); removed it\n",
                   path_.c_str(), static_cast<long long>(torn));
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MetricsLog::~MetricsLog() {
  ::close(fd_);
}

void MetricsLog::write(const MetricsRecord& record) {
  const std::string line = to_json(record).dump() + "\n";
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  if (before < 0) fail("write", path_, errno);
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      // Cut the partial line back off: the file keeps whole records only.
      if (::ftruncate(fd_, before) != 0) {
        std::fprintf(stderr, "warning: %s: cannot remove a partly written line\n", path_.c_str());
      }
      fail("write", path_, error);
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace malleus::metrics
