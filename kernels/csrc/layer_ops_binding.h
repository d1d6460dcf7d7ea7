// Torch binding of the decoder layer's small CUDA kernels (layer_ops_binding.cpp), added to the
// extension's module by paged_attention_cuda_binding.cpp.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace kvserve {

void register_layer_ops(pybind11::module_& module);

}  // namespace kvserve
