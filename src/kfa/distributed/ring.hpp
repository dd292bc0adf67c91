#pragma once
/// kfa::dist — ring attention over MPI: one sequence sharded over the ranks of a communicator.
///
/// Each rank holds a shard of Q, K, V (and O, LSE, dO, dQ, dK, dV). K/V shards travel around the ring with
/// nonblocking point-to-point messages, double-buffered so the next shard's transfer overlaps the compute
/// on the current one. Every step's partial (O, LSE) for the local queries merges into the running result
/// with kfa::merge_lse — the same combine rule the kernel applies per tile — in fp32 (fp64 for double).
/// In the backward pass dQ stays local while the dK/dV accumulators travel with K/V and come home.
/// Masks use global token positions, so causal and sliding windows are exact for any shard sizes.
///
/// Transport (RingTransport; reported by Ring::transport() and RingStats::transport): host memory goes to
/// MPI directly. Device memory goes through NCCL where the build has it (Kokkos CUDA + NCCL found by CMake:
/// ncclSend/ncclRecv on a stream of its own, ordered against the caller's execution-space instance with
/// events, the communicator bootstrapped through the ring's MPI_Comm), else to MPI directly where MPI is
/// GPU-aware, else through host staging buffers (pinned where the backend has pinned memory) kept in the
/// Ring between calls. MPI messages are split into chunks of at most Ring::max_message_bytes() (default
/// 1 GiB), so no message meets MPI's 2^31 count limit (NCCL counts are 64-bit). Nothing is sent at P = 1.
/// A failure on any rank in the middle of a ring is agreed at the end of the step: every rank completes the
/// step's transfers (no request is left posted into freed memory) and throws the same kfa::Error.
///
/// The parts, each including the ones it stands on:
///   ring/communicator.hpp  the Ring and the transports' names
///   ring/buffers.hpp       work buffers kept by the Ring, copies and slices over them
///   ring/steps.hpp         statistics, collective checks, the end-of-step agreement, visible blocks
///   ring/transport.hpp     one transfer per step: MPI in chunks, NCCL, host staging
///   ring/forward.hpp       ring_attention_forward
///   ring/backward.hpp      ring_attention_backward
///   ring/varlen.hpp        ring_attention_forward_varlen, ring_attention_backward_varlen (packed sequences)
#include <kfa/distributed/ring/backward.hpp>
#include <kfa/distributed/ring/buffers.hpp>
#include <kfa/distributed/ring/communicator.hpp>
#include <kfa/distributed/ring/forward.hpp>
#include <kfa/distributed/ring/steps.hpp>
#include <kfa/distributed/ring/transport.hpp>
#include <kfa/distributed/ring/varlen.hpp>
