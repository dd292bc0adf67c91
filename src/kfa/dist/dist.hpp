#pragma once
/// kfa::dist umbrella: ring attention over MPI and the MPI merge operation.
#include <kfa/dist/merge_op.hpp>
#include <kfa/dist/ring.hpp>
#include <kfa/dist/shard.hpp>
