// The hang and partition watchdog for malleus.torch: the very class the C++ trainer runs
// (watchdog/watchdog.h). Its thread needs no GIL: it beats, probes, judges and, when the job hangs,
// ends the process itself (exit status 87) while Python waits in a collective.
#include <pybind11/stl.h>

#include "convert.h"
#include "watchdog/watchdog.h"

namespace malleus::python {

void bind_watchdog(py::module_& m) {
  py::class_<watchdog::Watchdog>(
      m, "Watchdog",
      "Ends this process (status 87), naming the ranks that did not arrive or the hosts cut off, "
      "when a phase outlasts max(floor_s, multiple x its median); heartbeats in "
      "<run_dir>/heartbeats, the diagnosis in <run_dir>/hang.json (docs/python.md).")
      .def(py::init([](const std::string& run_dir, int rank, int world_size, double floor_s,
                       double multiple, double beat_interval_s, double cut_after_s,
                       const std::string& network) {
             check(world_size >= 1 && rank >= 0 && rank < world_size,
                   "watchdog: rank " + std::to_string(rank) + " of world size " +
                       std::to_string(world_size) + " is not a rank of the job");
             check(floor_s > 0 && multiple >= 1 && beat_interval_s >= 0 && cut_after_s > 0,
                   "watchdog: floor_s and cut_after_s must be positive, multiple at least 1, "
                   "beat_interval_s not negative");
             return std::make_unique<watchdog::Watchdog>(
                 run_dir, rank, world_size,
                 watchdog::WatchdogOptions{.floor_s = floor_s,
                                           .multiple = multiple,
                                           .beat_interval_s = beat_interval_s,
                                           .cut_after_s = cut_after_s,
                                           .network = network});
           }),
           py::arg("run_dir"), py::arg("rank"), py::arg("world_size"), py::arg("floor_s") = 120.0,
           py::arg("multiple") = 10.0, py::arg("beat_interval_s") = 0.0,
           py::arg("cut_after_s") = 3.0, py::arg("network") = "")
      .def("enter", &watchdog::Watchdog::enter, py::arg("phase"), py::arg("step"),
           "This rank now works on `phase` (\"step\", \"eval\", \"checkpoint\", ...) of `step`.")
      .def("limit_s", &watchdog::Watchdog::limit_s, py::arg("phase"),
           "The limit `phase` runs under now: max(floor_s, multiple x its median so far).")
      .def_static(
          "clear", [](const std::string& run_dir) { watchdog::Watchdog::clear(run_dir); },
          py::arg("run_dir"),
          "Removes a previous job's heartbeats and hang report (one rank, before any starts).");
  m.attr("HANG_EXIT_CODE") = watchdog::kHangExitCode;
}

}  // namespace malleus::python
