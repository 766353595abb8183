// nanobind bindings for gpumem._C. Each concern lives in its own file; this one only binds.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_C, m) {
  m.doc() = "gpumem native core (private; use the gpumem Python modules)";
  m.attr("__version__") = "0.1.0";
}
