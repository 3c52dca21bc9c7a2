// argmax_row (argmax_shared.h): the portable folder's scalar scans.
#pragma once

#include "../portable/argmax_row.h"
