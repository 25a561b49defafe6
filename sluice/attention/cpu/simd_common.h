// What the CPU kernels of every instruction set share.
#pragma once

#include <cstdint>

namespace sluice_simd {

using bf16 = uint16_t;  // raw bfloat16 bits

}  // namespace sluice_simd
