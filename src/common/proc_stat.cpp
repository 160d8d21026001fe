#include "common/proc_stat.h"

#include <fstream>
#include <sstream>

namespace malleus {

std::vector<std::string> proc_stat_fields(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::vector<std::string> fields;
  if (!std::getline(in, line)) return fields;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return fields;
  std::istringstream rest(line.substr(close + 1));
  for (std::string field; rest >> field;) fields.push_back(field);
  return fields;
}

}  // namespace malleus
