// malleus._malleus: the C++ libraries for Python (the package malleus wraps it).
#include <pybind11/pybind11.h>

#include "common/error.h"

namespace malleus::python {
void bind_plan(pybind11::module_& m);
void bind_planning(pybind11::module_& m);
void bind_elastic(pybind11::module_& m);
void bind_watchdog(pybind11::module_& m);
void bind_slurm(pybind11::module_& m);
}  // namespace malleus::python

PYBIND11_MODULE(_malleus, m) {
  m.doc() = "malleus's planner, simulator, straggler loop and watchdog (C++).";
  // Bad input: a ValueError carrying the C++ message (it names the file, key or value).
  pybind11::register_exception<malleus::Error>(m, "Error", PyExc_ValueError);
  malleus::python::bind_plan(m);
  malleus::python::bind_planning(m);
  malleus::python::bind_elastic(m);
  malleus::python::bind_watchdog(m);
  malleus::python::bind_slurm(m);
}
