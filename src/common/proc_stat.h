// A process's or thread's /proc stat line, split: what the watchdog's hang report, the memory
// copies' owner checks, the stale-temporary cleanup and the supervisor's process tree read.
#pragma once

#include <string>
#include <vector>

namespace malleus {

// The fields of the stat file at `path` (/proc/<pid>/stat, /proc/self/task/<tid>/stat) after the
// command name, which may hold spaces and parentheses: [0] is the state (field 3 in proc(5)),
// [1] the parent pid, [11] and [12] user and system time in clock ticks, [19] the start time
// (field 22). Empty when the file cannot be read (the process or thread has ended).
std::vector<std::string> proc_stat_fields(const std::string& path);

}  // namespace malleus
