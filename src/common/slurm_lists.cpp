#include "common/slurm_lists.h"

#include <cstdint>

#include "common/error.h"

namespace malleus {

namespace {

constexpr uint64_t kMaxRange = 65536;          // hosts in one range, as Slurm allows
constexpr size_t kMaxHosts = size_t{1} << 20;  // hosts in a whole list

bool all_digits(const std::string& text) {
  if (text.empty() || text.size() > 18) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// Items of a list, split at the commas outside brackets.
std::vector<std::string> items(const std::string& list) {
  std::vector<std::string> out;
  std::string item;
  int depth = 0;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      out.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  out.push_back(item);
  return out;
}

// Appends prefix + every number of "lo-hi,lo,..." (the inside of one bracket).
void expand_ranges(const std::string& prefix, const std::string& ranges, const std::string& bad,
                   std::vector<std::string>& hosts) {
  size_t start = 0;
  while (start <= ranges.size()) {
    size_t end = ranges.find(',', start);
    if (end == std::string::npos) end = ranges.size();
    const std::string range = ranges.substr(start, end - start);
    const size_t dash = range.find('-');
    const std::string lo = range.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
    check(all_digits(lo) && all_digits(hi), bad + ": \"" + range + "\" is not a number or a range");
    const uint64_t first = std::stoull(lo), last = std::stoull(hi);
    check(first <= last, bad + ": the range \"" + range + "\" runs backwards");
    check(last - first < kMaxRange, bad + ": the range \"" + range + "\" holds more than " +
                                        std::to_string(kMaxRange) + " hosts");
    // A first bound with a leading zero sets the width ("08-10": 08 09 10), as Slurm reads it.
    const size_t width = lo.size() > 1 && lo[0] == '0' ? lo.size() : 0;
    for (uint64_t n = first; n <= last; ++n) {
      std::string digits = std::to_string(n);
      if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
      hosts.push_back(prefix + digits);
      check(hosts.size() <= kMaxHosts, bad + ": more than " + std::to_string(kMaxHosts) + " hosts");
    }
    start = end + 1;
  }
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what) {
  const std::string bad = what + " \"" + list + "\"";
  check(list.find_first_of(" \t\n\r") == std::string::npos, bad + ": a host list has no spaces");
  std::vector<std::string> hosts;
  for (const std::string& item : items(list)) {
    if (item.empty()) continue;
    const size_t open = item.find('[');
    if (open == std::string::npos) {
      check(item.find(']') == std::string::npos, bad + ": \"" + item + "\" has no '['");
      hosts.push_back(item);
      continue;
    }
    const size_t close = item.find(']', open);
    check(close != std::string::npos, bad + ": \"" + item + "\" has no closing ']'");
    check(item.find('[', open + 1) > close && item.find('[', close) == std::string::npos,
          bad + ": \"" + item +
              "\" has more than one bracket (multi-dimensional names are not read: expand the "
              "list with scontrol show hostnames)");
    check(close + 1 == item.size(),
          bad + ": \"" + item + "\" goes on after its ']' (Slurm reads no suffix there)");
    expand_ranges(item.substr(0, open), item.substr(open + 1, close - open - 1), bad, hosts);
  }
  check(!hosts.empty(), bad + ": no hosts");
  return hosts;
}

std::vector<int> expand_counts(const std::string& list, const std::string& what) {
  const std::string bad = what + " \"" + list + "\"";
  std::vector<int> counts;
  for (const std::string& item : items(list)) {
    const size_t paren = item.find('(');
    const std::string number = item.substr(0, paren);
    check(all_digits(number) && number.size() <= 9,
          bad + ": \"" + item + "\" is not a count (N or N(xK))");
    uint64_t repeat = 1;
    if (paren != std::string::npos) {
      const std::string times = item.substr(paren);  // "(xK)"
      const std::string k = times.size() > 3 ? times.substr(2, times.size() - 3) : "";
      check(times.rfind("(x", 0) == 0 && times.back() == ')' && all_digits(k) && k.size() <= 7,
            bad + ": \"" + item + "\" is not a count (N or N(xK))");
      repeat = std::stoull(k);
    }
    check(counts.size() + repeat <= kMaxHosts,
          bad + ": more than " + std::to_string(kMaxHosts) + " counts");
    counts.insert(counts.end(), repeat, std::stoi(number));
  }
  return counts;
}

}  // namespace malleus
