// Strict reading of JSON objects: configs reject unknown keys and wrong types with a message that
// names the file and the key, so a typo never silently falls back to a default.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "common/error.h"

namespace malleus {

using Json = nlohmann::json;

// Parses text; `source` (a file name) is used in error messages.
Json parse_json(const std::string& text, const std::string& source);
// Reads and parses a JSON file.
Json read_json_file(const std::string& path);

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
    try {
      return object_.at(key).get<T>();
    } catch (const nlohmann::json::exception&) {
      throw Error(source_ + ": key \"" + key + "\" has the wrong type (value " +
                  object_.at(key).dump() + ")");
    }
  }

  const Json& object_;
  std::string source_;
  std::set<std::string> seen_;
};

}  // namespace malleus
