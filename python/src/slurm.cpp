// Slurm's host lists for Python (common/slurm_lists.h): malleus.torch's init_from_env reads the
// address of rank 0 from the node list with the same reader as `malleus launch`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/slurm_lists.h"

namespace py = pybind11;

namespace malleus::python {

void bind_slurm(py::module_& m) {
  m.def("expand_hostlist", &malleus::expand_hostlist, py::arg("hostlist"),
        py::arg("what") = "host list",
        "The host names of a Slurm host list, in its order: \"node[2-3],login\" -> ['node2', "
        "'node3', 'login']; malleus.Error naming `what` for a list Slurm would not read.");
}

}  // namespace malleus::python
