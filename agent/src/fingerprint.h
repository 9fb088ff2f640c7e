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
 *
 * The same pass finds the zeros (issue 20): each thread also ORs its words together, the block
 * ORs its threads' results (bar.red.or, one barrier) and thread 0 writes one flag a segment,
 * 1 where any word is not zero. That is exact, not a fingerprint's probability: a part all of
 * whose segments read zero is neither copied nor written, and is re-created by a memset. The
 * lanes are optional (out 0: only the flags, for a save that needs no fingerprints).
 */
#ifndef TORPOR_FINGERPRINT_H
#define TORPOR_FINGERPRINT_H

#include <stdint.h>

/* Each constant is written once, in hex digits, for the C fold and the PTX alike: the fake
 * driver runs the C fold, so only a GPU would notice the two disagreeing. */
#define FP_LANES 256
#define FP_P1_HEX 9E3779B185EBCA87
#define FP_P2_HEX C2B2AE3D27D4EB4F
#define FP_P3_HEX 165667B19E3779F9
#define FP_P4_HEX 85EBCA77C2B2AE63
#define FP_SEED1_HEX 60EA27EEADC0B5D6
#define FP_SEED2_HEX 2D358DCCAA6C78A5

#define FP_C_(hex) 0x##hex##ULL
#define FP_C(hex) FP_C_(hex)         /* the C constant */
#define FP_S_(x) #x
#define FP_S(x) FP_S_(x)             /* the text of a macro's value */
#define FP_PTX_C(hex) "0x" FP_S(hex) "U" /* the PTX constant */

#define FP_P1 FP_C(FP_P1_HEX)
#define FP_P2 FP_C(FP_P2_HEX)
#define FP_P3 FP_C(FP_P3_HEX)
#define FP_P4 FP_C(FP_P4_HEX)
#define FP_SEED1 FP_C(FP_SEED1_HEX)
#define FP_SEED2 FP_C(FP_SEED2_HEX)

/* One segment as the kernel reads it (16 bytes: the PTX's table stride): its device address
 * and its length in words. */
struct fp_seg {
	uint64_t ptr;
	uint64_t words;
};
_Static_assert(sizeof(struct fp_seg) == 16, "the PTX reads the segment table 16 bytes a row");

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

/* Any word of w[0..n) not zero? (The CPU's reference of the kernel's flag.) */
static inline int fp_nonzero(const uint64_t *w, uint64_t n)
{
	uint64_t z = 0;

	for (uint64_t i = 0; i < n; i++)
		z |= w[i];
	return z != 0;
}

/* The kernel: block b reads segment b; out[(b * FP_LANES + t) * 2 + {0,1}] (out 0: none),
 * nonzero[b] (32 bits): 1 when a word of the segment is not zero, else 0. */
#define FP_KERNEL "torpor_fp"
#define FP_PTX                                                                    \
	".version 6.0\n"                                                          \
	".target sm_50\n"                                                         \
	".address_size 64\n"                                                      \
	".visible .entry torpor_fp(.param .u64 segs, .param .u64 out, .param .u64 nonzero)\n" \
	"{\n"                                                                     \
	"  .reg .pred p, nz, nolanes;\n"                                          \
	"  .reg .b32 blk, tid, flag;\n"                                           \
	"  .reg .b64 rsegs, rout, rnz, ptr, n, i, a, b, w, x, y, z, at, p1, p2, p3, p4;\n" \
	"  ld.param.u64 rsegs, [segs];\n"                                          \
	"  ld.param.u64 rout, [out];\n"                                            \
	"  ld.param.u64 rnz, [nonzero];\n"                                         \
	"  setp.eq.u64 nolanes, rout, 0;\n"                                        \
	"  cvta.to.global.u64 rsegs, rsegs;\n"                                      \
	"  cvta.to.global.u64 rout, rout;\n"                                        \
	"  cvta.to.global.u64 rnz, rnz;\n"                                          \
	"  mov.u64 z, 0;\n"                                                         \
	"  mov.u32 blk, %ctaid.x;\n"                                              \
	"  mov.u32 tid, %tid.x;\n"                                                \
	"  mul.wide.u32 at, blk, 16;\n" /* sizeof(struct fp_seg) */               \
	"  add.s64 at, rsegs, at;\n"                                               \
	"  ld.global.u64 ptr, [at];\n"                                            \
	"  ld.global.u64 n, [at+8];\n"                                            \
	"  cvta.to.global.u64 ptr, ptr;\n"                                        \
	"  mov.u64 p1, " FP_PTX_C(FP_P1_HEX) ";\n"                                 \
	"  mov.u64 p2, " FP_PTX_C(FP_P2_HEX) ";\n"                                 \
	"  mov.u64 p3, " FP_PTX_C(FP_P3_HEX) ";\n"                                 \
	"  mov.u64 p4, " FP_PTX_C(FP_P4_HEX) ";\n"                                 \
	"  cvt.u64.u32 i, tid;\n"                                                 \
	"  add.u64 a, i, " FP_PTX_C(FP_SEED1_HEX) ";\n"                            \
	"  xor.b64 b, i, " FP_PTX_C(FP_SEED2_HEX) ";\n"                            \
	"  setp.ge.u64 p, i, n;\n"                                                \
	"  @p bra DONE;\n"                                                        \
	"LOOP:\n"                                                                 \
	"  shl.b64 at, i, 3;\n"                                                   \
	"  add.s64 at, ptr, at;\n"                                                \
	"  ld.global.nc.u64 w, [at];\n"                                           \
	"  or.b64 z, z, w;\n"                                                     \
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
	"  add.u64 i, i, " FP_S(FP_LANES) ";\n"                                    \
	"  setp.lt.u64 p, i, n;\n"                                                \
	"  @p bra LOOP;\n"                                                        \
	"DONE:\n" /* every thread of the block comes here: the barrier takes them all */ \
	"  setp.ne.u64 nz, z, 0;\n"                                               \
	"  bar.red.or.pred nz, 0, nz;\n"                                          \
	"  setp.ne.u32 p, tid, 0;\n"                                              \
	"  @p bra LANES;\n"                                                       \
	"  selp.u32 flag, 1, 0, nz;\n"                                            \
	"  mul.wide.u32 at, blk, 4;\n"                                            \
	"  add.s64 at, rnz, at;\n"                                                \
	"  st.global.u32 [at], flag;\n"                                           \
	"LANES:\n"                                                                \
	"  @nolanes bra END;\n"                                                   \
	"  mul.wide.u32 at, blk, " FP_S(FP_LANES) ";\n"                            \
	"  cvt.u64.u32 i, tid;\n"                                                 \
	"  add.u64 at, at, i;\n"                                                  \
	"  shl.b64 at, at, 4;\n"                                                  \
	"  add.s64 at, rout, at;\n"                                                \
	"  st.global.u64 [at], a;\n"                                              \
	"  st.global.u64 [at+8], b;\n"                                            \
	"END:\n"                                                                  \
	"  ret;\n"                                                                \
	"}\n"

#endif
