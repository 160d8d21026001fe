#include "common/json.h"

#include "common/files.h"

namespace malleus {

Json parse_json(const std::string& text, const std::string& source) {
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(source + ": malformed JSON (" + e.what() + ")");
  }
}

Json read_json_file(const std::string& path) {
  return parse_json(read_file(path), path);
}

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
