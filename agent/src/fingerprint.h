/* The GPU fingerprint of a piece of saved memory (fingerprint.c): what lets the image store
 * recognise, before anything crosses PCIe, that it holds a piece already (issue 5).
 *
 * A piece is 1 to a few segments of device memory, each a whole number of 64-bit words. Every
 * segment is read by FP_LANES threads, thread t taking words t, t + FP_LANES, ... (coalesced),
 * each folding them into two 64-bit accumulators; the piece's fingerprint is XXH3-128 (on the
 * CPU) of its lengths and of all the accumulators. This file holds the fold both as the CPU
 * reference (the fake driver runs it; TORPOR_AGENT_FP_CHECK compares the GPU against it) and
 * as PTX, which every driver compiles for its own GPU: no CUDA toolkit at build time.
 *
 * The fold is xxHash64's round on one accumulator and a second, differently rotated round on
 * the other: a change to any word changes its thread's two accumulators, which XXH3-128 then
 * mixes. Equal fingerprints are taken as equal data (as the store takes equal sha256), at 128
 * bits for memory the program wrote itself.
 */
#ifndef TORPOR_FINGERPRINT_H
#define TORPOR_FINGERPRINT_H

#include <stdint.h>

#define FP_LANES 256
#define FP_P1 0x9E3779B185EBCA87ULL
#define FP_P2 0xC2B2AE3D27D4EB4FULL
#define FP_P3 0x165667B19E3779F9ULL
#define FP_P4 0x85EBCA77C2B2AE63ULL
#define FP_SEED1 0x60EA27EEADC0B5D6ULL
#define FP_SEED2 0x2D358DCCAA6C78A5ULL

/* One segment as the kernel reads it: its device address and its length in words. */
struct fp_seg {
	uint64_t ptr;
	uint64_t words;
};

static inline uint64_t fp_rotl(uint64_t x, int r)
{
	return (x << r) | (x >> (64 - r));
}

/* Thread t's two accumulators over words w[0..n). */
static inline void fp_lane(const uint64_t *w, uint64_t n, unsigned t, uint64_t out[2])
{
	uint64_t a = FP_SEED1 + t, b = FP_SEED2 ^ t;

	for (uint64_t i = t; i < n; i += FP_LANES) {
		a = fp_rotl(a + w[i] * FP_P2, 31) * FP_P1;
		b = fp_rotl(b ^ (w[i] * FP_P3), 27) * FP_P1 + FP_P4;
	}
	out[0] = a;
	out[1] = b;
}

/* The kernel: block b reads segment b; out[(b * FP_LANES + t) * 2 + {0,1}]. */
#define FP_KERNEL "torpor_fp"
#define FP_PTX                                                                    \
	".version 6.0\n"                                                          \
	".target sm_50\n"                                                         \
	".address_size 64\n"                                                      \
	".visible .entry torpor_fp(.param .u64 segs, .param .u64 out)\n"          \
	"{\n"                                                                     \
	"  .reg .pred p;\n"                                                       \
	"  .reg .b32 blk, tid;\n"                                                 \
	"  .reg .b64 rsegs, rout, ptr, n, i, a, b, w, x, y, at, p1, p2, p3, p4;\n" \
	"  ld.param.u64 rsegs, [segs];\n"                                          \
	"  ld.param.u64 rout, [out];\n"                                            \
	"  cvta.to.global.u64 rsegs, rsegs;\n"                                      \
	"  cvta.to.global.u64 rout, rout;\n"                                        \
	"  mov.u32 blk, %ctaid.x;\n"                                              \
	"  mov.u32 tid, %tid.x;\n"                                                \
	"  mul.wide.u32 at, blk, 16;\n"                                           \
	"  add.s64 at, rsegs, at;\n"                                               \
	"  ld.global.u64 ptr, [at];\n"                                            \
	"  ld.global.u64 n, [at+8];\n"                                            \
	"  cvta.to.global.u64 ptr, ptr;\n"                                        \
	"  mov.u64 p1, 0x9E3779B185EBCA87U;\n"                                     \
	"  mov.u64 p2, 0xC2B2AE3D27D4EB4FU;\n"                                     \
	"  mov.u64 p3, 0x165667B19E3779F9U;\n"                                     \
	"  mov.u64 p4, 0x85EBCA77C2B2AE63U;\n"                                     \
	"  cvt.u64.u32 i, tid;\n"                                                 \
	"  add.u64 a, i, 0x60EA27EEADC0B5D6U;\n"                                   \
	"  xor.b64 b, i, 0x2D358DCCAA6C78A5U;\n"                                   \
	"  setp.ge.u64 p, i, n;\n"                                                \
	"  @p bra DONE;\n"                                                        \
	"LOOP:\n"                                                                 \
	"  shl.b64 at, i, 3;\n"                                                   \
	"  add.s64 at, ptr, at;\n"                                                \
	"  ld.global.nc.u64 w, [at];\n"                                           \
	"  mad.lo.u64 x, w, p2, a;\n"                                             \
	"  shl.b64 y, x, 31;\n"                                                   \
	"  shr.u64 x, x, 33;\n"                                                   \
	"  or.b64 x, x, y;\n"                                                     \
	"  mul.lo.u64 a, x, p1;\n"                                                \
	"  mul.lo.u64 x, w, p3;\n"                                                \
	"  xor.b64 x, x, b;\n"                                                    \
	"  shl.b64 y, x, 27;\n"                                                   \
	"  shr.u64 x, x, 37;\n"                                                   \
	"  or.b64 x, x, y;\n"                                                     \
	"  mad.lo.u64 b, x, p1, p4;\n"                                            \
	"  add.u64 i, i, 256;\n"                                                  \
	"  setp.lt.u64 p, i, n;\n"                                                \
	"  @p bra LOOP;\n"                                                        \
	"DONE:\n"                                                                 \
	"  mul.wide.u32 at, blk, 256;\n"                                          \
	"  cvt.u64.u32 i, tid;\n"                                                 \
	"  add.u64 at, at, i;\n"                                                  \
	"  shl.b64 at, at, 4;\n"                                                  \
	"  add.s64 at, rout, at;\n"                                                \
	"  st.global.u64 [at], a;\n"                                              \
	"  st.global.u64 [at+8], b;\n"                                            \
	"  ret;\n"                                                                \
	"}\n"

#endif
