// The weight stream (cpu_stream.cpp), as the products see it.
#pragma once

#include <cstdint>

namespace tandem_cpu {

// A product over `rows` rows of x by the weight whose codes start at `codes` begins: the
// open weight stream, if it holds that weight and the step is short, reads ahead of it.
void weight_reached(const void* codes, int64_t rows);

}  // namespace tandem_cpu
