#include "common/json.h"

#include <vector>

#include "common/files.h"

namespace malleus {

namespace {

// A short rendering of a value for messages; long strings and arrays are cut.
std::string shown(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

}  // namespace

Json parse_json(const std::string& text, const std::string& source) {
  // nlohmann keeps the last of two equal keys; the parser callback sees every key, so a repeat
  // inside one object is caught here, with one set of keys per object being parsed.
  std::vector<std::set<std::string>> open_objects;
  const Json::parser_callback_t refuse_duplicates = [&](int, Json::parse_event_t event,
                                                        Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        check(open_objects.empty() || open_objects.back().insert(key).second,
              source + ": key \"" + key + "\" appears twice in one object");
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text, refuse_duplicates);
  } catch (const nlohmann::json::out_of_range& e) {
    // e.g. 1e999: the number does not fit a double.
    throw Error(source + ": number out of range (" + e.what() + ")");
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": malformed JSON (" + e.what() + ")");
  }
}

Json read_json_file(const std::string& path) {
  return parse_json(read_file(path), path);
}

namespace json_detail {

void wrong_type(const Json& value, const std::string& what, const char* expected) {
  throw Error(what + " has the wrong type (value " + shown(value) + "; expected " + expected + ")");
}

void out_of_range(const Json& value, const std::string& what, const std::string& range) {
  throw Error(what + " is out of range (value " + shown(value) + "; expected " + range + ")");
}

WholeNumber whole_number(const Json& value, const std::string& what) {
  if (value.is_number_unsigned()) return {false, value.get<uint64_t>()};
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    // The magnitude of INT64_MIN does not fit int64, so negate in uint64.
    return v < 0 ? WholeNumber{true, uint64_t{0} - static_cast<uint64_t>(v)}
                 : WholeNumber{false, static_cast<uint64_t>(v)};
  }
  if (!value.is_number_float()) wrong_type(value, what, "a whole number");
  const double d = value.get<double>();
  if (!std::isfinite(d) || d != std::floor(d)) {
    throw Error(what + " must be a whole number (value " + shown(value) + ")");
  }
  // 2^64 is exactly representable; anything at or above it cannot be a 64-bit integer.
  if (std::fabs(d) >= 18446744073709551616.0) {
    out_of_range(value, what, "a 64-bit integer");
  }
  return {d < 0, static_cast<uint64_t>(std::fabs(d))};
}

double finite_number(const Json& value, const std::string& what) {
  if (!value.is_number()) wrong_type(value, what, "a number");
  const double d = value.get<double>();
  if (!std::isfinite(d)) out_of_range(value, what, "a finite number");
  return d;
}

}  // namespace json_detail

JsonReader::JsonReader(const Json& object, std::string source)
    : object_(object), source_(std::move(source)) {
  check(object_.is_object(), source_ + ": expected a JSON object");
}

void JsonReader::finish() const {
  std::string unknown;
  for (const auto& [key, value] : object_.items()) {
    if (!seen_.count(key)) unknown += (unknown.empty() ? "\"" : ", \"") + key + "\"";
  }
  check(unknown.empty(), source_ + ": unknown key(s) " + unknown);
}

}  // namespace malleus
