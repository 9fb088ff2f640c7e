/* The mover's direct copies (TORPOR_AGENT_MOVER_SINK=direct or direct-whole, mover_tune.c): the
 * GPU copies a chunk straight into (out of) its sink, a data file mapped shared or a region of
 * the agent's memory, registered with the driver (chunk by chunk, or whole once), instead of
 * through a pinned staging buffer and a second copy by the CPU. What the workers call
 * (mover_workers.c); mover.h: what they share.
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mover.h"

/* A data file is mapped read-only for a load (torpor may open it so). */
static unsigned direct_flags(const struct worker *w)
{
	return CU_MEMHOSTREGISTER_PORTABLE |
	       (!w->saving && !w->region ? CU_MEMHOSTREGISTER_READ_ONLY : 0);
}

void direct_close(struct worker *w)
{
	for (int i = 0; i < MAX_BUFFERS; i++)
		if (w->reg[i]) {
			real.cuMemHostUnregister(w->reg[i]);
			w->reg[i] = NULL;
		}
	if (w->map_registered)
		real.cuMemHostUnregister(w->map);
	if (w->map_owned)
		munmap(w->map, w->map_size);
	w->map = NULL;
	w->map_registered = w->map_owned = 0;
}

/* After region_get: the sink mapped for direct copies (the region, or the data file mapped
 * shared), all of it registered for DIRECT_WHOLE. Where that is refused the worker goes
 * staged, with one warning. */
void direct_open(struct worker *w)
{
	unsigned char *p;
	size_t size;
	CUresult rc;

	if (!tune.direct || stream_active())
		return;
	if (w->region) {
		p = w->region;
		size = plan.region_size[w->k];
	} else if (w->fd >= 0) {
		size = round_up(plan.file_size[w->k], HOST_PAGE);
		if (!size)
			return;
		if (w->saving && ftruncate(w->fd, plan.file_size[w->k]) < 0) {
			pr_warn("mover %d: sizing data file %d: %s: staged", w->k, w->k, strerror(errno));
			return;
		}
		p = mmap(NULL, size, w->saving ? PROT_READ | PROT_WRITE : PROT_READ,
			 MAP_SHARED | (tune.direct == DIRECT_WHOLE ? MAP_POPULATE : 0), w->fd, 0);
		if (p == MAP_FAILED) {
			pr_warn("mover %d: mapping data file %d: %s: staged", w->k, w->k,
				strerror(errno));
			return;
		}
		madvise(p, size, MADV_DONTFORK);
		w->map_owned = 1;
	} else {
		return;
	}
	w->map = p;
	w->map_size = size;
	if (tune.direct == DIRECT_WHOLE) {
		rc = real.cuMemHostRegister_v2(p, size, direct_flags(w));
		if (rc != CUDA_SUCCESS) {
			pr_warn("mover %d: registering its sink (%zu MiB): CUresult %d: staged", w->k,
				size >> 20, rc);
			direct_close(w);
			return;
		}
		w->map_registered = 1;
	}
	pr_debug("mover %d: straight %s its %s (%zu KiB), registered %s", w->k,
		 w->saving ? "into" : "from", w->region ? "region" : "data file", size >> 10,
		 w->map_registered ? "whole" : "chunk by chunk");
}

/* Does chunk c go straight between the GPU and the sink, in slot i? For DIRECT_CHUNK the
 * span of its parts that move is registered first (whole pages: a region's chunks start on
 * one, sinks_layout; a file's at FILE_ALIGN), until direct_end. A refusal sends this chunk
 * and the rest of this worker's staged, with one warning. */
int direct_begin(struct worker *w, const struct chunk *c, int i)
{
	size_t lo = (size_t)-1, hi = 0;
	CUresult rc;

	if (!w->map || w->direct_failed)
		return 0;
	if (w->map_registered)
		return 1;
	for (int q = 0; q < PARTS && part_len(c, q); q++) {
		const struct part *pt = &c->part[q];

		if (part_stays(pt, w->saving))
			continue;
		if (pt->sink_off < lo)
			lo = pt->sink_off;
		if (pt->sink_off + part_len(c, q) > hi)
			hi = pt->sink_off + part_len(c, q);
	}
	if (lo == (size_t)-1)
		return 1; /* nothing of it moves */
	lo = lo / HOST_PAGE * HOST_PAGE;
	hi = round_up(hi, HOST_PAGE);
	if (hi > w->map_size)
		hi = w->map_size;
	rc = real.cuMemHostRegister_v2(w->map + lo, hi - lo, direct_flags(w));
	if (rc != CUDA_SUCCESS) {
		pr_warn("mover %d: registering %zu KiB of its sink: CUresult %d: staged from here",
			w->k, (hi - lo) >> 10, rc);
		w->direct_failed = 1;
		return 0;
	}
	w->reg[i] = w->map + lo;
	return 1;
}

/* Slot i's copy is over: its registration goes. */
void direct_end(struct worker *w, int i)
{
	if (w->reg[i]) {
		real.cuMemHostUnregister(w->reg[i]);
		w->reg[i] = NULL;
	}
}

/* The sums of the parts of c that move and are summed, read from the sink (direct). */
void direct_sums(const struct worker *w, const struct chunk *c, uint64_t *sums)
{
	for (int q = 0; q < PARTS && part_len(c, q); q++) {
		const struct part *pt = &c->part[q];
		const unsigned char *at = w->map + pt->sink_off;
		struct sum s;

		if (part_stays(pt, w->saving) || !part_summed(pt))
			continue;
		sum_init(&s);
		for (size_t block = 0, len = part_len(c, q); block < len; block += SUB)
			sum_add(&s, at + block, len - block < SUB ? len - block : SUB);
		sums[q] = sum_end(&s);
	}
}
