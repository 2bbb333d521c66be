// Shared-memory ring transport for same-node pipeline stages (CPU tensors).
// The transport owner (issue 3) grows this into the full ring; this file exists from the start so
// that `pip install` always builds the extension and a missing compiler fails loudly.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_shm_ring, m) {
    m.doc() = "POSIX shared-memory ring buffers for MegatronDPP's stage-to-stage transport";
    m.attr("ABI_VERSION") = 1;
}
