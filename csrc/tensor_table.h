// The tensor table of a shard manifest decoded natively (see tensor_table.cpp).
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpumem::table {

// (start, stop) byte range of the top-level "tensors" value of a JSON object, or None.
nanobind::object find_tensors(const char* data, size_t size);

// (TensorEntry list, extents, chunk CRCs) of a "tensors" JSON array (the two columns as raw
// int64 bytes: see tensor_table.cpp), or None where the Python path must decide.
nanobind::object build_tensors(const char* data, size_t size, int64_t chunk, int64_t align,
                               nanobind::dict files, nanobind::dict itemsize,
                               std::vector<int64_t> mesh_ndims, bool sharded,
                               nanobind::handle entry_type, nanobind::handle box_type);

}  // namespace gpumem::table
