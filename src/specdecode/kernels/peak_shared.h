// What every instruction set's int8 peak chains share (arch/<folder>/peak_chains.h; peak.cpp
// times them).
//
// Each arch folder's peak_chains.h defines, for its instruction sets:
//   PRODUCTS: the int8 products of one instruction of its int8 multiply-add;
//   chains(iterations, seed): CHAINS independent accumulators each through `iterations` of
//   those instructions, their sum returned (so the loops stay).
#pragma once

#include "core.h"
#include "isa.h"

#include <cstdint>

namespace specdecode {
namespace {

// independent accumulators a thread: 12 cover a 4-5 cycle latency at two instructions a cycle
constexpr int CHAINS = 12;

}  // namespace
}  // namespace specdecode
