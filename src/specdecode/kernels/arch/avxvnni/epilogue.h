// The matmuls' epilogues here: one value at a time (epilogue_shared.h).
#pragma once

#include "../../epilogue_shared.h"
