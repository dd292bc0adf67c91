#pragma once
/// kfa/tuning.hpp: the one home of kfa's build-time overrides (set with -D...), for tests that run on one
/// machine what another machine would choose. Every tile size, stage count and warp count is a literal in its
/// family's tile table (the Shape structs under detail/), not an override. Without a -D, every override below
/// takes its default, which is what a build ships.

/// KFA_NATIVE_SMEM_CAP (bytes; 0: none): native_smem_max (detail/cuda/native.hpp) reports at most this much,
/// so that a device with more shared memory runs and tests what a device with less would choose (101,376 B:
/// sm_86/89; 166,912 B: sm_80). Every choice between kernels goes through native_smem_max.
#ifndef KFA_NATIVE_SMEM_CAP
#define KFA_NATIVE_SMEM_CAP 0
#endif
