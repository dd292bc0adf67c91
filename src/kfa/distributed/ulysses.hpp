#pragma once
/// kfa::dist — all-to-all (DeepSpeed-Ulysses) sequence parallelism and its hybrid with the ring (USP,
/// TransformerEngine's "a2a+p2p"): one sequence sharded over P ranks in a ring layout, heads spread over
/// groups of U ranks by an all-to-all, the ring across the P / U groups.
///
/// Ulysses sends 4·N·H·d/P elements per rank in the forward whatever P is, but needs U to divide the query
/// heads; the ring sends K/V around P − 1 times and takes any P. The hybrid keeps the all-to-all inside a
/// node (groups are consecutive ranks; Ulysses::groups_within_nodes says whether MPI placed them so) and
/// the ring across nodes.
///
/// The parts, each including the ones it stands on:
///   ulysses/group.hpp      the Ulysses communicators (groups, ring) and the HeadPlan of a group's members
///   ulysses/exchange.hpp   one tensor's all-to-all inside a group: sequence shards ↔ head shards
///   ulysses/attention.hpp  ulysses_attention_forward, ulysses_attention_backward, UlyssesStats
#include <kfa/distributed/ulysses/attention.hpp>
#include <kfa/distributed/ulysses/exchange.hpp>
#include <kfa/distributed/ulysses/group.hpp>
