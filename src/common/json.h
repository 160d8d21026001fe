// Strict reading of JSON: every reader of a config, plan, cluster, scenario, trace, manifest or
// metrics file goes through here, so none of them converts a value silently. A duplicate key, a
// number that is too large, an integer given as 2.5, a negative count for an unsigned field, an
// unknown key or a wrong type stops with a message that names the file and the key.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "common/error.h"

namespace malleus {

using Json = nlohmann::json;

// Parses text; `source` (a file name) is used in error messages. Refuses malformed text, numbers
// beyond double's range (1e999) and a key that appears twice in one object.
Json parse_json(const std::string& text, const std::string& source);
// Reads and parses a JSON file.
Json read_json_file(const std::string& path);

namespace json_detail {

template <typename T>
struct is_vector : std::false_type {};
template <typename T>
struct is_vector<std::vector<T>> : std::true_type {};

// A whole number as sign and magnitude, so that every int64 and uint64 value is exact.
struct WholeNumber {
  bool negative = false;
  uint64_t magnitude = 0;
};
// The whole number in `value` (a JSON integer, or a floating-point number without fraction such
// as 2.0 or 1e3); throws Error starting with `what` for 2.5, a string, a bool, ...
WholeNumber whole_number(const Json& value, const std::string& what);
// A finite number; throws Error starting with `what` otherwise.
double finite_number(const Json& value, const std::string& what);
[[noreturn]] void wrong_type(const Json& value, const std::string& what, const char* expected);
[[noreturn]] void out_of_range(const Json& value, const std::string& what,
                               const std::string& range);

}  // namespace json_detail

// Converts one JSON value to T without losing anything: integers must be whole numbers within
// T's range (no wrap-around, nothing negative for unsigned types), floating-point values finite
// and representable in T (1e39 is not a float; neither is 1e-50, which would become 0), strings
// and bools exactly those JSON types, vectors element by element. T = Json returns the value as
// is. Errors start with `what`, e.g. `train.json: key "steps"`.
template <typename T>
T json_to(const Json& value, const std::string& what) {
  using namespace json_detail;
  if constexpr (std::is_same_v<T, Json>) {
    return value;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!value.is_boolean()) wrong_type(value, what, "true or false");
    return value.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    const WholeNumber n = whole_number(value, what);
    const std::string range = std::to_string(std::numeric_limits<T>::min()) + " to " +
                              std::to_string(std::numeric_limits<T>::max());
    if (!n.negative) {
      if (n.magnitude > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
        out_of_range(value, what, range);
      }
      return static_cast<T>(n.magnitude);
    }
    if constexpr (std::is_unsigned_v<T>) {
      out_of_range(value, what, range);
    } else {
      // -magnitude >= min  <=>  magnitude - 1 <= max (magnitude >= 1 when negative).
      if (n.magnitude - 1 > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
        out_of_range(value, what, range);
      }
      return static_cast<T>(-static_cast<T>(n.magnitude - 1) - 1);
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    const double d = finite_number(value, what);
    if (std::fabs(d) > static_cast<double>(std::numeric_limits<T>::max()) ||
        (d != 0 && static_cast<T>(d) == 0)) {
      out_of_range(value, what,
                   sizeof(T) == 4 ? "a 32-bit float's range" : "a 64-bit float's range");
    }
    return static_cast<T>(d);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!value.is_string()) wrong_type(value, what, "a string");
    return value.get<std::string>();
  } else if constexpr (is_vector<T>::value) {
    if (!value.is_array()) wrong_type(value, what, "a list");
    T out;
    out.reserve(value.size());
    for (size_t i = 0; i < value.size(); ++i) {
      out.push_back(
          json_to<typename T::value_type>(value[i], what + "[" + std::to_string(i) + "]"));
    }
    return out;
  } else {
    static_assert(!sizeof(T), "json_to: unsupported type");
  }
}

// Reads the keys of one JSON object and checks, at the end, that no key was left unread.
class JsonReader {
 public:
  JsonReader(const Json& object, std::string source);

  template <typename T>
  T required(const std::string& key) {
    check(object_.contains(key), source_ + ": missing key \"" + key + "\"");
    return get<T>(key);
  }
  template <typename T>
  T optional(const std::string& key, const T& fallback) {
    return object_.contains(key) ? get<T>(key) : fallback;
  }
  bool has(const std::string& key) const { return object_.contains(key); }
  // Throws Error naming every key that was never read.
  void finish() const;
  const std::string& source() const { return source_; }

 private:
  template <typename T>
  T get(const std::string& key) {
    seen_.insert(key);
    return json_to<T>(object_.at(key), source_ + ": key \"" + key + "\"");
  }

  const Json& object_;
  std::string source_;
  std::set<std::string> seen_;
};

}  // namespace malleus
