#pragma once
/// kfa::dist umbrella: ring attention over MPI (the parts ring.hpp lists), Ulysses and hybrid sequence
/// parallelism (the parts ulysses.hpp lists), the MPI merge operation and the
/// collective error agreement. It brings the core's attention API (kfa/attention.hpp) but not all of kfa:
/// include kfa/kfa.hpp for the rest (KFA_VERSION_STRING, kfa::reference_attention, ...). It includes the
/// ring's and Ulysses' parts itself rather than ring.hpp and ulysses.hpp, so that it stands no higher in the include
/// graph than they do.
#include <kfa/distributed/merge_op.hpp>
#include <kfa/distributed/ring/backward.hpp>
#include <kfa/distributed/ring/buffers.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/distributed/ring/forward.hpp>
#include <kfa/distributed/ring/steps.hpp>
#include <kfa/distributed/ring/transport.hpp>
#include <kfa/distributed/ring/varlen.hpp>
#include <kfa/distributed/ulysses/attention.hpp>
#include <kfa/distributed/ulysses/exchange.hpp>
#include <kfa/distributed/ulysses/group.hpp>
#include <kfa/mpi/agreement.hpp>
#include <kfa/mpi/shard.hpp>
