// The attention paths on AVX-VNNI: AVX2's (no integer products in attention).
#pragma once

#include "../avx2/attention_paths.h"
