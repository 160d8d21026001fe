// How malleus writes numbers for people: counts, bytes and durations, one way each, for the step
// line, the re-plan line, the report and the planning commands alike. (Machine-read output, JSON
// and JSONL, carries plain numbers.)
#pragma once

#include <string>

namespace malleus {

// A count (parameters, tokens, tokens per second) to three significant digits with a decimal
// suffix: "950", "12.3k", "1.2M", "3.4B", "-12.3k". "n/a" when not finite.
std::string format_count(double value);

// Bytes in binary units, two decimals above a KiB: "512 B", "1.50 KiB", "1.12 GiB", "2.00 TiB".
// "n/a" when not finite.
std::string format_bytes(double bytes);

// A duration: "250 ms" under a second, "12.34 s" under a minute, "2m03s" under an hour, "1h02m"
// beyond; negative ones with a minus sign ("-250 ms"). "n/a" when not finite.
std::string format_duration(double seconds);

// A number of things, the noun in the plural unless there is one: "1 rank", "3 ranks", "0 steps".
std::string format_counted(long long count, const std::string& noun);

}  // namespace malleus
