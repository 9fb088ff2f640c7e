/* The deferred copy (`prepare ... defer`, agent/PROTOCOL.md "The deferred copy"): the save
 * leaves the copy to another process, so that it runs beside the driver's checkpoint and
 * CRIU's dump instead of before them.
 *
 * With held memory (mover.c, TORPOR_AGENT_VMM_EXPORT, on by default) the memory never leaves the GPU
 * through a leave-running checkpoint, but the data files must still have every byte before the
 * program runs again, and the copy out was the last PCIe copy inside the pause: 0.37 s at
 * 16 GiB at this host's bound, more than the driver's checkpoint of what is left. A process of
 * its own (torpor's copier, agent/copier/copier.c) can import the held descriptors and copy
 * while the program is locked, checkpointed and dumped: nothing in the program runs then.
 *
 * So a deferred save does everything a save does (the caches released, the gate closed, the
 * zero scan and the fingerprints, the files laid out and sized) except the copy: it exports
 * every movable allocation (all or nothing, as held memory always is), writes the plan of the
 * copy, which parts go where, to the plan file torpor gave, and releases the memory. Only a
 * save whose every part that moves is checked by its GPU fingerprint can be deferred: the
 * program's image (CRIU dumps it right after) must hold everything a later load checks, and
 * the host's sums would need the bytes. Anything short (no held memory, sums on the host, an
 * index or a stream into the image store, the agent's own memory, a device whose UUID the
 * driver will not say, a plan that cannot be written) and the save copies as it always did:
 * `"deferred":false` and `defer_error` say why.
 *
 * The plan is text, one record a line, for the copier, which takes nothing in it on trust (it
 * comes from the program's process):
 *
 *   torpor-copy-plan 1
 *   files <n>
 *   alloc <k> <bytes> <device UUID, 32 hex>     (k: the order of the held descriptors)
 *   part <file> <offset> <bytes>                (a part, whole: one pwrite at offset)
 *   seg <k> <offset in allocation k> <bytes>    (its bytes, in order, from the allocations)
 *   end
 */
#define LOG_PREFIX "defer: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_checkpoint_types.h" /* CUuuid */
#include "mover.h"

struct text {
	char *buf;
	size_t len, cap;
	int failed;
};

static void add(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(struct text *t, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (t->failed)
		return;
	for (;;) {
		va_start(ap, fmt);
		n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
		va_end(ap);
		if (n < 0) {
			t->failed = 1;
			return;
		}
		if ((size_t)n < t->cap - t->len) {
			t->len += (size_t)n;
			return;
		}
		{
			size_t cap = t->cap ? 2 * t->cap : 1 << 16;
			char *more = realloc(t->buf, cap);

			if (!more) {
				t->failed = 1;
				return;
			}
			t->buf = more, t->cap = cap;
		}
	}
}

/* The movable allocation (its index into plan.mv) that holds ptr on dev, or -1. plan.mv is
 * sorted by device, then address (mover.c's by_device). */
static long mv_of(CUdevice dev, CUdeviceptr ptr)
{
	size_t lo = 0, hi = plan.nmv;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		const struct movable *m = &plan.mv[mid];

		if (m->dev < dev || (m->dev == dev && m->src + m->size <= ptr))
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo < plan.nmv && plan.mv[lo].dev == dev && plan.mv[lo].src <= ptr &&
	    ptr < plan.mv[lo].src + plan.mv[lo].size)
		return (long)lo;
	return -1;
}

/* The plan's text, or -1 with why (plan.hold: the held descriptors' order, all of plan.mv). */
static int plan_text(struct text *t, char *why, size_t whysize)
{
	CUresult (*uuid)(CUuuid *, CUdevice) = driver_symbol("cuDeviceGetUuid_v2");
	static long k_of[HOLD_MAX]; /* the control thread's: a save's */

	if (!uuid)
		uuid = driver_symbol("cuDeviceGetUuid");
	if (!uuid) {
		snprintf(why, whysize, "the driver has no cuDeviceGetUuid");
		return -1;
	}
	for (int k = 0; k < plan.nhold; k++)
		k_of[plan.hold[k].mv] = k; /* plan.nhold == plan.nmv <= HOLD_MAX: checked */
	add(t, "torpor-copy-plan 1\nfiles %d\n", plan.nfiles);
	for (int k = 0; k < plan.nhold; k++) {
		const struct movable *m = &plan.mv[plan.hold[k].mv];
		CUuuid u;
		CUresult rc = uuid(&u, m->dev);

		if (rc != CUDA_SUCCESS) {
			snprintf(why, whysize, "the UUID of device %d: CUresult %d", m->dev, rc);
			return -1;
		}
		add(t, "alloc %d %zu ", k, m->size);
		for (int i = 0; i < 16; i++)
			add(t, "%02x", (unsigned char)u.bytes[i]);
		add(t, "\n");
	}
	for (size_t j = 0; j < plan.nchunks; j++) {
		const struct chunk *c = &plan.chunks[j];

		for (int q = 0; q < PARTS; q++) {
			const struct part *pt = &c->part[q];
			size_t len = part_len(c, q);

			if (!len || part_stays(pt, 1))
				continue;
			add(t, "part %d %llu %zu\n", c->file, pt->sink_off, len);
			for (size_t s = pt->seg; s < pt->seg + pt->nseg; s++) {
				const struct seg *g = &plan.segs[s];
				long m = mv_of(c->dev, g->ptr);

				if (m < 0) {
					snprintf(why, whysize, "a part's bytes at 0x%llx are in no "
						 "allocation", g->ptr);
					return -1;
				}
				add(t, "seg %ld %llu %zu\n", k_of[m], g->ptr - plan.mv[m].src, g->len);
			}
		}
	}
	add(t, "end\n");
	if (t->failed) {
		snprintf(why, whysize, "out of memory");
		return -1;
	}
	return 0;
}

static int write_all(int fd, const char *buf, size_t len)
{
	while (len) {
		ssize_t n = write(fd, buf, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		buf += n, len -= (size_t)n;
	}
	return 0;
}

int defer_save(int plan_fd, int in_memory, int index_fd, int ring_fd, struct move_result *r)
{
	struct text t = { 0 };
	char why[sizeof(r->defer_error)] = "";

	if (in_memory || index_fd >= 0 || ring_fd >= 0)
		snprintf(why, sizeof(why), "only a save into data files without the image store "
			 "can be deferred");
	else if (!plan.gpu_check)
		snprintf(why, sizeof(why), "the parts are not checked by their GPU fingerprints "
			 "(TORPOR_AGENT_MOVER_CHECK=host, or no fingerprint kernel)");
	else if (!vmm_hold_enabled())
		snprintf(why, sizeof(why), "no held memory (TORPOR_AGENT_VMM_EXPORT=0)");
	for (size_t j = 0; !why[0] && j < plan.nchunks; j++)
		for (int q = 0; !why[0] && q < PARTS; q++) {
			const struct part *pt = &plan.chunks[j].part[q];

			if (part_len(&plan.chunks[j], q) && !part_stays(pt, 1) && part_summed(pt))
				snprintf(why, sizeof(why), "a part without a GPU fingerprint");
		}
	if (!why[0] && plan.nchunks) {
		hold_export(r);
		if (r->held != (int)plan.nmv || plan.nhold != (int)plan.nmv)
			snprintf(why, sizeof(why), "its memory cannot be held: %s",
				 r->hold_error[0] ? r->hold_error : "the program's log says why");
	}
	if (!why[0] && !plan.nchunks)
		snprintf(why, sizeof(why), "nothing to copy");
	if (!why[0] && plan_text(&t, why, sizeof(why)) == 0 &&
	    (ftruncate(plan_fd, 0) < 0 || write_all(plan_fd, t.buf, t.len) < 0))
		snprintf(why, sizeof(why), "writing the plan: %s", strerror(errno));
	free(t.buf);
	if (why[0]) {
		hold_close(r);
		snprintf(r->defer_error, sizeof(r->defer_error), "%s", why);
		pr_info("the copy is not deferred: %s", why);
		return -1;
	}
	r->deferred = 1;
	r->bytes = host_bytes_needed();
	return 0;
}
