/* The mover's zero parts (issue 20): where the parts that move go in their sinks, and the zero
 * parts made again on the GPU at a load.
 *
 * fingerprint_parts.c finds them: one run of the fingerprint kernel before a save flags every
 * 4 MiB part whose every word is zero (fingerprint.h). Such a part is neither copied over PCIe
 * nor written: a hole in a data file, no room in the agent's memory (sinks_layout packs only
 * the parts that move), no chunk in the image store (the index marks it z; stream.c takes a
 * zeros record for it at a streamed load). The agent knows its zero parts from its own memory,
 * which CRIU restores with the program: nothing read back names them, so nothing read back
 * can make the agent memset what held data. A load memsets them right after the memory is
 * re-created (zeros_fill), before the rest is reloaded.
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <stdio.h>

#include "mover.h"

/* Each part's place in its sink. In a file, its place in the chunk (FILE_ALIGN-aligned: one
 * store chunk), a hole when it stays behind; in the agent's memory the parts that move are
 * packed one after the other, and a zero part takes no room: a program whose memory is mostly
 * untouched (JAX's arena) costs the host only its data. */
void sinks_layout(void)
{
	unsigned long long off[MAX_FILES] = { 0 };

	for (size_t j = 0; j < plan.nchunks; j++) {
		struct chunk *c = &plan.chunks[j];

		/* copied straight into a region, each chunk's parts are registered on their own:
		 * no page may hold two chunks' bytes (TORPOR_AGENT_MOVER_SINK=direct) */
		if (plan.in_memory && tune.direct)
			off[c->file] = round_up(off[c->file], HOST_PAGE);
		for (int q = 0; q < PARTS && part_len(c, q); q++) {
			struct part *pt = &c->part[q];

			if (!plan.in_memory) {
				pt->sink_off = c->file_off + (unsigned long long)q * FILE_ALIGN;
			} else if (!pt->zero) {
				pt->sink_off = off[c->file];
				off[c->file] += part_len(c, q);
			}
		}
	}
	if (plan.in_memory)
		memcpy(plan.file_size, off, sizeof(off));
}

/* A stretch of device memory to memset: the segments of consecutive zero parts, merged where
 * they touch. */
struct zero_run {
	CUdevice dev;
	CUdeviceptr ptr;
	size_t len;
};

static CUresult zero_flush(struct zero_run *z, CUstream *s)
{
	CUresult rc = z->len ? real.cuMemsetD8Async(z->ptr, 0, z->len, s[z->dev]) : CUDA_SUCCESS;

	z->len = 0;
	return rc;
}

/* The zero parts back on the GPU: one cuMemsetD8Async a stretch of device addresses (a 64 GiB
 * arena is a few memsets, not 16,000), on one stream a device (its context current), then
 * waited for. */
int zeros_fill(struct move_result *r)
{
	CUstream s[MAX_DEVICES] = { 0 };
	struct zero_run z = { -1, 0, 0 };
	CUresult rc = CUDA_SUCCESS;
	int ret = 0;

	if (!plan.zeros)
		return 0;
	if (!real.cuMemsetD8Async || !plan.segs) {
		snprintf(r->error, sizeof(r->error), "zero parts to re-create, and %s",
			 plan.segs ? "the driver lacks cuMemsetD8Async" : "no segments");
		return -1;
	}
	for (size_t j = 0; j < plan.nchunks; j++) {
		const struct chunk *c = &plan.chunks[j];

		for (int q = 0; q < PARTS && part_len(c, q); q++) {
			const struct part *pt = &c->part[q];

			if (!pt->zero)
				continue;
			if (c->dev != z.dev) { /* the chunks of one device are together */
				CUcontext ctx = track_context_of(c->dev);

				if ((rc = zero_flush(&z, s)) != CUDA_SUCCESS)
					goto done;
				if (c->dev < 0 || c->dev >= MAX_DEVICES || !ctx) {
					rc = CUDA_ERROR_INVALID_CONTEXT;
					goto done;
				}
				if ((rc = real.cuCtxSetCurrent(ctx)) != CUDA_SUCCESS ||
				    (!s[c->dev] && (rc = real.cuStreamCreate(&s[c->dev],
							CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS))
					goto done;
				z.dev = c->dev;
			}
			for (size_t k = 0; k < pt->nseg; k++) {
				const struct seg *g = &plan.segs[pt->seg + k];

				if (z.len && g->ptr == z.ptr + z.len) {
					z.len += g->len; /* it goes on where the last one ended */
					continue;
				}
				if ((rc = zero_flush(&z, s)) != CUDA_SUCCESS)
					goto done;
				z.ptr = g->ptr;
				z.len = g->len;
			}
			r->zero_parts++;
			r->zero_bytes += part_len(c, q);
		}
	}
	rc = zero_flush(&z, s);
done:
	if (rc != CUDA_SUCCESS) {
		snprintf(r->error, sizeof(r->error), "re-creating the zero parts (cuMemsetD8Async): "
			 "CUresult %d", rc);
		ret = -1;
	}
	for (int d = 0; d < MAX_DEVICES; d++) {
		if (!s[d])
			continue;
		rc = real.cuStreamSynchronize(s[d]);
		if (rc != CUDA_SUCCESS && !ret) {
			snprintf(r->error, sizeof(r->error), "re-creating the zero parts: "
				 "cuStreamSynchronize: CUresult %d", rc);
			ret = -1;
		}
		real.cuStreamDestroy_v2(s[d]);
	}
	return ret;
}
