// Telling a partition from a hang, from what the hosts' probes found in the phase that is over
// its limit (watchdog/probe.h). The rules, for each link between two hosts (from either side's
// probes):
//
// - *cut*: no probe has connected for `cut_after_s` (a link that is down, or drops every packet);
// - *failing*: its latest probe failed, not for `cut_after_s` yet: judged again shortly;
// - *lossy*: not failing now, but its probes failed in at least two spells, at least kLossyShare
//   of them, one in the last `cut_after_s` (a link that drops packets, or flaps: TCP's resends on
//   it are what hold the phase); treated as cut. A link that drops packets while every phase still
//   ends within its limit is never judged: the job trains through it, slower (the link probe rates
//   it: slow-links.md);
// - *healed*: probes failed, and connect again (a link that went down and came back, or lost a
//   probe now and then): not cut; the watchdog gives the phase more time, once. If the phase is
//   still held after that, with nobody else to blame, a healed link counts as lossy
//   (`healed_is_cut`): a link that drops packets is trained through while phases end within
//   their limits, and cut once it holds one past its limit.
//
// The hosts kept are the largest set of hosts with no cut or lossy link between any two of them,
// found by taking out, one at a time, the host with the most such links (ties: the one furthest
// from rank 0's host, so rank 0's host stays when two halves are even). The others are *cut off*.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "watchdog/probe.h"

namespace malleus::watchdog {

// What one host's leader reported of its probes (in its heartbeat): other host → Reach.
struct HostReport {
  std::string host;
  std::map<std::string, Reach> reach;
};

inline constexpr double kLossyShare = 0.1;

struct Partition {
  std::vector<std::string> kept, cut_off;  // host names, in the order given
  // Links by what their probes found: "h0 – h1: no probe connected for 5.2 s" (cut), "h0 – h1: 6
  // of 24 probes failed" (lossy), "h0 – h1: probes failing for 1.0 s", "h0 – h1" (healed).
  std::vector<std::string> cut, lossy, failing, healed;
  bool partitioned() const { return !cut_off.empty(); }
  // "host h1 is cut off (h0 – h1: no probe connected for 5.2 s)"; empty when nothing is cut off.
  std::string message() const;
};

// `hosts`: every host of the job, rank 0's first. `reports`: the reports of the hosts' leaders that
// are alive (a host without one is judged by the others' probes of it). `now`: Unix time.
Partition find_partition(const std::vector<std::string>& hosts,
                         const std::vector<HostReport>& reports, double now, double cut_after_s,
                         bool healed_is_cut = false);

}  // namespace malleus::watchdog
