// Slurm's compact lists, as its environment gives them to a job: host lists
// (SLURM_JOB_NODELIST="gpu[01-04,07],login1") and count lists (SLURM_TASKS_PER_NODE="2(x3),1").
// Read the way `scontrol show hostnames` reads them, so the supervisor (launch/slurm.h) and
// malleus.torch's init_from_env (through the Python module) agree on which host is which.
#pragma once

#include <string>
#include <vector>

namespace malleus {

// The host names of a Slurm host list, in its order (duplicates kept, empty items skipped):
// "node[2-3,10],login" -> node2 node3 node10 login. A range whose first bound has a leading zero
// keeps its width ("n[08-10]" -> n08 n09 n10). Throws Error naming `what` (the variable it came
// from) and the text for anything else: an unclosed or empty bracket, a range that runs
// backwards or holds more than 65,536 hosts, text after a bracket, a space, a second bracket
// in one name (Slurm's multi-dimensional names; `scontrol show hostnames` expands those).
std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what);

// The numbers of a Slurm count list: "2(x3),1" -> 2 2 2 1. Each item is a whole number,
// optionally followed by "(xK)" repeating it K times. Throws Error naming `what` and the text
// for anything else.
std::vector<int> expand_counts(const std::string& list, const std::string& what);

}  // namespace malleus
