// argmax_row (argmax_shared.h): AVX2's 8 lanes.
#pragma once

#include "../avx2/argmax_row.h"
