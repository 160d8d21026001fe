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

// ---- the schema: one field list per record kind ------------------------------------------------

template <typename Record, typename T>
struct Field {
  constexpr Field(const char* k, T Record::*m, bool r = false) : key(k), member(m), required(r) {}
  const char* key;
  T Record::*member;
  bool required;
};

constexpr auto fields(const StepRecord*) {
  using R = StepRecord;
  return std::tuple{
      Field<R, int64_t>{"step", &R::step, true},
      Field<R, double>{"loss", &R::loss},
      Field<R, double>{"lr", &R::lr},
      Field<R, double>{"grad_norm", &R::grad_norm},
      Field<R, double>{"tokens_per_s", &R::tokens_per_s},
      Field<R, double>{"step_time_s", &R::step_time_s},
      Field<R, double>{"eta_s", &R::eta_s},
      Field<R, int64_t>{"consumed_samples", &R::consumed_samples},
      Field<R, std::string>{"plan", &R::plan},
      Field<R, std::vector<double>>{"rates", &R::rates},
      Field<R, std::vector<double>>{"injected", &R::injected},
      Field<R, std::vector<double>>{"compute_s", &R::compute_s},
      Field<R, std::vector<double>>{"link_rates", &R::link_rates},
      Field<R, std::vector<double>>{"link_s", &R::link_s},
      Field<R, double>{"monitor_overhead_s", &R::monitor_overhead_s},
      Field<R, std::vector<double>>{"peak_memory_bytes", &R::peak_memory_bytes},
      Field<R, std::vector<double>>{"peak_parameters_bytes", &R::peak_parameters_bytes},
      Field<R, std::vector<double>>{"peak_gradients_bytes", &R::peak_gradients_bytes},
      Field<R, std::vector<double>>{"peak_optimizer_bytes", &R::peak_optimizer_bytes},
      Field<R, std::vector<double>>{"peak_activations_bytes", &R::peak_activations_bytes},
      Field<R, std::vector<double>>{"peak_workspace_bytes", &R::peak_workspace_bytes},
      Field<R, std::vector<double>>{"peak_communication_bytes", &R::peak_communication_bytes},
      Field<R, std::vector<double>>{"recompute_ahead_s", &R::recompute_ahead_s},
      Field<R, std::vector<double>>{"recompute_overlapped_s", &R::recompute_overlapped_s}};
}

constexpr auto fields(const EvalRecord*) {
  using R = EvalRecord;
  return std::tuple{Field<R, int64_t>{"step", &R::step, true},
                    Field<R, double>{"val_loss", &R::val_loss, true}};
}

constexpr auto fields(const ReplanRecord*) {
  using R = ReplanRecord;
  return std::tuple{
      Field<R, int64_t>{"step", &R::step, true},
      Field<R, std::vector<double>>{"rates", &R::rates},
      Field<R, std::vector<double>>{"link_rates", &R::link_rates},
      Field<R, std::string>{"old_plan", &R::old_plan},
      Field<R, std::string>{"new_plan", &R::new_plan},
      Field<R, std::string>{"reason", &R::reason},
      Field<R, std::string>{"search", &R::search},
      Field<R, double>{"predicted_old_s", &R::predicted_old_s},
      Field<R, double>{"predicted_new_s", &R::predicted_new_s},
      Field<R, double>{"predicted_gain_s", &R::predicted_gain_s},
      Field<R, double>{"predicted_migration_s", &R::predicted_migration_s},
      Field<R, int64_t>{"horizon_steps", &R::horizon_steps},
      Field<R, double>{"planning_s", &R::planning_s},
      Field<R, int64_t>{"bytes_moved", &R::bytes_moved},
      Field<R, double>{"migration_s", &R::migration_s},
      Field<R, int64_t>{"migration_peak_extra_bytes", &R::migration_peak_extra_bytes},
      Field<R, int64_t>{"migration_bucket_bytes", &R::migration_bucket_bytes},
      Field<R, int64_t>{"migration_background_bytes", &R::migration_background_bytes}};
}

constexpr auto fields(const RestartRecord*) {
  using R = RestartRecord;
  return std::tuple{Field<R, int64_t>{"step", &R::step, true},
                    Field<R, int64_t>{"restart", &R::restart, true},
                    Field<R, int64_t>{"failed_at_step", &R::failed_at_step},
                    Field<R, int64_t>{"steps_lost", &R::steps_lost},
                    Field<R, std::string>{"reason", &R::reason},
                    Field<R, std::string>{"detail", &R::detail},
                    Field<R, std::vector<int64_t>>{"lost_ranks", &R::lost_ranks},
                    Field<R, int64_t>{"ranks_before", &R::ranks_before},
                    Field<R, int64_t>{"ranks_after", &R::ranks_after},
                    Field<R, double>{"failed_at", &R::failed_at},
                    Field<R, std::vector<std::string>>{"cut_off_hosts", &R::cut_off_hosts},
                    Field<R, std::string>{"ended_by", &R::ended_by},
                    Field<R, std::vector<int64_t>>{"unended_ranks", &R::unended_ranks},
                    Field<R, std::string>{"unended", &R::unended}};
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
