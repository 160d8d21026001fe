#include "watchdog/partition.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>

namespace malleus::watchdog {

namespace {

std::string one_decimal(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds);
  return text;
}

std::string joined(const std::vector<std::string>& words) {
  std::string text;
  for (const auto& w : words) text += (text.empty() ? "" : ", ") + w;
  return text;
}

// One link as one side's probes saw it.
struct Seen {
  bool failing = false;        // the latest probe failed
  double down_s = 0;           // ... and none connected for this long
  bool failed_lately = false;  // a probe failed in the last cut_after_s
  bool failed = false;         // a probe failed since probing began
  int64_t probes = 0, failures = 0, spells = 0;
};
std::optional<Seen> seen(const std::vector<HostReport>& reports, const std::string& from,
                         const std::string& to, double now, double cut_after_s) {
  for (const HostReport& r : reports) {
    if (r.host != from) continue;
    const auto it = r.reach.find(to);
    if (it == r.reach.end()) return std::nullopt;
    const Reach& x = it->second;
    Seen s;
    s.failing = x.last_fail > x.last_ok;
    s.down_s = s.failing ? now - std::max(x.last_ok, x.since) : 0;
    s.failed = x.last_fail > 0;
    s.failed_lately = s.failed && now - x.last_fail < cut_after_s;
    s.probes = x.probes;
    s.failures = x.failures;
    s.spells = x.spells;
    return s;
  }
  return std::nullopt;
}

enum class LinkState { kFine, kHealed, kFailing, kLossy, kCut };

// A link from both sides' probes (the worse view wins), and its words for the report.
LinkState judge_link(const std::optional<Seen>& a, const std::optional<Seen>& b, double cut_after_s,
                     std::string* words) {
  LinkState state = LinkState::kFine;
  for (const auto& s : {a, b}) {
    if (!s) continue;
    LinkState mine = LinkState::kFine;
    std::string why;
    if (s->failing && s->down_s >= cut_after_s) {
      mine = LinkState::kCut;
      why = "no probe connected for " + one_decimal(s->down_s) + " s";
    } else if (s->failing) {
      mine = LinkState::kFailing;
      why = "probes failing for " + one_decimal(s->down_s) + " s";
    } else if (s->failed_lately && s->spells >= 2 &&
               static_cast<double>(s->failures) >= kLossyShare * static_cast<double>(s->probes)) {
      mine = LinkState::kLossy;
      why = std::to_string(s->failures) + " of " + std::to_string(s->probes) +
            " probes failed, in " + std::to_string(s->spells) + " spells";
    } else if (s->failed) {
      mine = LinkState::kHealed;
      why = std::to_string(s->failures) + " of " + std::to_string(s->probes) +
            " probes failed, and the phase still waits";
    }
    if (mine > state) {
      state = mine;
      *words = why;
    }
  }
  return state;
}

}  // namespace

std::string Partition::message() const {
  if (cut_off.empty()) return "";
  std::vector<std::string> links = cut;
  links.insert(links.end(), lossy.begin(), lossy.end());
  return std::string(cut_off.size() == 1 ? "host " : "hosts ") + joined(cut_off) +
         (cut_off.size() == 1 ? " is" : " are") + " cut off (" + joined(links) + ")";
}

Partition find_partition(const std::vector<std::string>& hosts,
                         const std::vector<HostReport>& reports, double now, double cut_after_s,
                         bool healed_is_cut) {
  Partition p;
  const size_t n = hosts.size();
  std::vector<std::vector<bool>> cut(n, std::vector<bool>(n, false));
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) {
      std::string why;
      const LinkState state =
          judge_link(seen(reports, hosts[a], hosts[b], now, cut_after_s),
                     seen(reports, hosts[b], hosts[a], now, cut_after_s), cut_after_s, &why);
      const std::string link = hosts[a] + " – " + hosts[b];
      switch (state) {
        case LinkState::kCut:
          p.cut.push_back(link + ": " + why);
          break;
        case LinkState::kLossy:
          p.lossy.push_back(link + ": " + why);
          break;
        case LinkState::kFailing:
          p.failing.push_back(link + ": " + why);
          break;
        case LinkState::kHealed:
          if (healed_is_cut) {
            p.lossy.push_back(link + ": " + why);
          } else {
            p.healed.push_back(link);
          }
          break;
        case LinkState::kFine:
          break;
      }
      if (state == LinkState::kCut || state == LinkState::kLossy ||
          (healed_is_cut && state == LinkState::kHealed)) {
        cut[a][b] = cut[b][a] = true;
      }
    }
  }
  // Take out the host with the most cut (or lossy) links among those left until none is left
  // between them.
  std::vector<bool> out(n, false);
  for (;;) {
    size_t worst = n;
    int most = 0;
    for (size_t h = 0; h < n; ++h) {
      if (out[h]) continue;
      int links = 0;
      for (size_t o = 0; o < n; ++o) links += !out[o] && cut[h][o];
      if (links > 0 && links >= most) {  // ties: the later host
        most = links;
        worst = h;
      }
    }
    if (worst == n) break;
    out[worst] = true;
  }
  for (size_t h = 0; h < n; ++h) (out[h] ? p.cut_off : p.kept).push_back(hosts[h]);
  return p;
}

}  // namespace malleus::watchdog
