/* The fingerprints of the mover's parts (fingerprint.c runs the kernel, fingerprint.h folds),
 * and the parts that read all zero.
 *
 * Before any save, one run of the kernel reads every part on the GPU (at memory speed: a few
 * ms a GiB) and flags the parts whose every word is zero: those are neither copied over PCIe
 * nor written (a hole in a file, no room in the agent's memory, no chunk in the store), and a
 * load re-creates them with cuMemsetD8Async (zeros_fill). A JAX program's arena, one
 * allocation mostly never written, then costs the time of its data, not of its size.
 *
 * With an index file (prepare ... fp), every part gets a fingerprint on the GPU before anything
 * moves (fingerprint.h), and a part whose fingerprint torpor named as known (the image store
 * holds that chunk) is neither copied nor written: its bytes in the file stay a hole, which
 * torpor fills from the store before the data is read back (a restore, or a rollback). The
 * index lists every fingerprinted part; a reload checks each fingerprint again on the GPU,
 * which is how the parts the store supplied are verified.
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mover.h"

/* The segments of every part (pieces cut at part boundaries) and each part's store length. */
int segs_build(void)
{
	size_t cap = plan.npieces + plan.nchunks * PARTS, n = 0;

	plan.segs = calloc(cap ? cap : 1, sizeof(*plan.segs));
	if (!plan.segs)
		return -ENOMEM;
	for (size_t j = 0; j < plan.nchunks; j++) {
		struct chunk *c = &plan.chunks[j];
		size_t i = c->first;

		for (int q = 0; q < PARTS; q++) {
			struct part *pt = &c->part[q];
			size_t start = (size_t)q * FILE_ALIGN, end = start + part_len(c, q);

			pt->seg = n;
			for (; end > start && i < c->first + c->npieces; i++) {
				const struct piece *p = &plan.pieces[i];
				size_t a = start > p->at ? start : p->at;
				size_t b = end < p->at + p->len ? end : p->at + p->len;

				if (b > a) {
					if (n == cap)
						return -ENOMEM; /* cannot happen: sized above */
					plan.segs[n++] = (struct seg){ plan.mv[p->mv].src + p->off + (a - p->at),
								       b - a, a };
				}
				if (p->at + p->len > end)
					break; /* the piece goes on in the next part */
			}
			pt->nseg = n - pt->seg;
			pt->store_len = part_store_len(c, q);
		}
	}
	plan.nsegs = n;
	return 0;
}

/* Can the kernel read seg (whole aligned 64-bit words)? */
static int seg_readable(const struct seg *g)
{
	return g->ptr % 8 == 0 && g->len % 8 == 0;
}

static int part_readable(const struct part *pt)
{
	for (size_t k = 0; k < pt->nseg; k++)
		if (!seg_readable(&plan.segs[pt->seg + k]))
			return 0;
	return pt->nseg > 0;
}

/* One run of the kernel over every segment, device by device: each segment's zero flag into
 * *nonzero, and with want_lanes its lanes (FP_LANES * 2 each) into *lanes. 0, or -1 with err
 * (nothing allocated then). */
static int scan_all(int want_lanes, uint64_t **lanes, uint32_t **nonzero, char *err,
		    size_t errsize)
{
	struct fp_seg *table = malloc(plan.nsegs * sizeof(*table) + 1);
	size_t j = 0;

	*lanes = want_lanes ? malloc(plan.nsegs * FP_LANES * 2 * sizeof(uint64_t) + 1) : NULL;
	*nonzero = malloc(plan.nsegs * sizeof(uint32_t) + 1);
	if (!table || !*nonzero || (want_lanes && !*lanes)) {
		snprintf(err, errsize, "out of memory for fingerprints");
		goto fail;
	}
	for (size_t k = 0; k < plan.nsegs; k++) /* an unreadable segment: nothing read */
		table[k] = (struct fp_seg){ plan.segs[k].ptr,
					    seg_readable(&plan.segs[k]) ? plan.segs[k].len / 8 : 0 };
	while (j < plan.nchunks) { /* the chunks of one device are together (by_device) */
		CUdevice dev = plan.chunks[j].dev;
		CUcontext ctx = track_context_of(dev);
		size_t from = plan.chunks[j].part[0].seg, to;

		while (j < plan.nchunks && plan.chunks[j].dev == dev)
			j++;
		to = plan.chunks[j - 1].part[PARTS - 1].seg + plan.chunks[j - 1].part[PARTS - 1].nseg;
		if (!ctx || real.cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
			snprintf(err, errsize, "no context of device %d", dev);
			goto fail;
		}
		if (fp_run(table + from, to - from, *lanes ? *lanes + from * FP_LANES * 2 : NULL,
			   *nonzero + from, err, errsize))
			goto fail;
	}
	free(table);
	return 0;
fail:
	free(table);
	free(*lanes);
	free(*nonzero);
	*lanes = NULL;
	*nonzero = NULL;
	return -1;
}

/* The GPU's lanes of every segment (fingerprints_verify), or NULL with err. */
static uint64_t *lanes_all(char *err, size_t errsize)
{
	uint64_t *lanes;
	uint32_t *nonzero;

	if (scan_all(1, &lanes, &nonzero, err, errsize))
		return NULL;
	free(nonzero);
	return lanes;
}

/* A part's fingerprint from its segments' lanes (lanes: its first segment's): its lengths,
 * each segment's, the lanes. */
static XXH128_hash_t part_fp(const struct chunk *c, int q, const uint64_t *lanes)
{
	const struct part *pt = &c->part[q];
	uint64_t head[3] = { part_len(c, q), pt->store_len, pt->nseg };
	XXH3_state_t st;

	XXH3_128bits_reset(&st);
	XXH3_128bits_update(&st, head, sizeof(head));
	for (size_t k = 0; k < pt->nseg; k++) {
		uint64_t words = plan.segs[pt->seg + k].len / 8;

		XXH3_128bits_update(&st, &words, sizeof(words));
		XXH3_128bits_update(&st, lanes + k * FP_LANES * 2, FP_LANES * 2 * sizeof(uint64_t));
	}
	return XXH3_128bits_digest(&st);
}

/* The same fingerprint from the part's bytes in host memory (chunk c's buffer): the CPU
 * reference, for TORPOR_AGENT_FP_CHECK. */
XXH128_hash_t part_fp_host(const struct chunk *c, int q, const unsigned char *buf)
{
	const struct part *pt = &c->part[q];
	uint64_t *lanes = malloc(pt->nseg * FP_LANES * 2 * sizeof(uint64_t) + 1);
	XXH128_hash_t fp = { 0, 0 };

	if (!lanes)
		return fp;
	for (size_t k = 0; k < pt->nseg; k++) {
		const struct seg *g = &plan.segs[pt->seg + k];

		for (unsigned t = 0; t < FP_LANES; t++)
			fp_lane((const uint64_t *)(buf + g->at), g->len / 8, t,
				lanes + (k * FP_LANES + t) * 2);
	}
	fp = part_fp(c, q, lanes);
	free(lanes);
	return fp;
}

static int by_bytes(const void *a, const void *b)
{
	return memcmp(a, b, sizeof(XXH128_canonical_t));
}

/* The fingerprints torpor knows (the store holds their chunks): 16 bytes each (XXH128's
 * canonical form), in any order. Sorted into *known. */
int known_read(int fd, XXH128_canonical_t **known, size_t *n, char *err, size_t errsize)
{
	struct stat st;
	size_t done = 0;
	unsigned char *p;

	*known = NULL;
	*n = 0;
	if (fd < 0)
		return 0;
	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size % 16 ||
	    st.st_size > (64LL << 20)) {
		snprintf(err, errsize, "the known-fingerprints file is not a regular file of 16-byte "
			 "records (at most 64 MiB)");
		return -1;
	}
	p = malloc(st.st_size + 1);
	if (!p) {
		snprintf(err, errsize, "out of memory");
		return -1;
	}
	while (done < (size_t)st.st_size) {
		ssize_t got = pread(fd, p + done, st.st_size - done, done);

		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0) {
			snprintf(err, errsize, "reading the known fingerprints: %s",
				 got ? strerror(errno) : "short file");
			free(p);
			return -1;
		}
		done += got;
	}
	*known = (XXH128_canonical_t *)p;
	*n = st.st_size / 16;
	qsort(*known, *n, sizeof(**known), by_bytes);
	return 0;
}

/* Is part q of c all zero (every segment read, and none had a word that is not)? */
static int part_zero(const struct part *pt, const uint32_t *nonzero)
{
	if (!part_readable(pt))
		return 0;
	for (size_t k = 0; k < pt->nseg; k++)
		if (nonzero[pt->seg + k])
			return 0;
	return 1;
}

/* One pass of the kernel over every part of the plan, before anything moves: with zeros, the
 * parts that read all zero are marked (never copied nor written; a load memsets them); with
 * fp (a file save with an index), every part is fingerprinted and those known holds are
 * skipped. Failing, nothing is marked, fingerprinted or skipped (all is copied): r->fp_error
 * and r->zero_error say why. */
void fingerprint_parts(const XXH128_canonical_t *known, size_t nknown, int fp, int zeros,
		       struct move_result *r)
{
	long long t0 = now_ms();
	uint64_t *lanes;
	uint32_t *nonzero;
	char err[160];

	if (!fp && !zeros)
		return;
	if (zeros && !real.cuMemsetD8Async) {
		snprintf(r->zero_error, sizeof(r->zero_error), "the driver lacks cuMemsetD8Async");
		zeros = 0;
		if (!fp)
			return;
	}
	if (!plan.segs && segs_build()) {
		snprintf(err, sizeof(err), "out of memory");
		goto fail;
	}
	if (scan_all(fp, &lanes, &nonzero, err, sizeof(err)))
		goto fail;
	for (size_t j = 0; j < plan.nchunks; j++) {
		struct chunk *c = &plan.chunks[j];

		for (int q = 0; q < PARTS; q++) {
			struct part *pt = &c->part[q];
			XXH128_canonical_t key;

			if (!part_readable(pt))
				continue;
			if (zeros && part_zero(pt, nonzero)) {
				pt->zero = 1;
				plan.zeros = 1;
				r->zero_parts++;
				r->zero_bytes += part_len(c, q);
			}
			if (!fp)
				continue;
			pt->fp = part_fp(c, q, lanes + pt->seg * FP_LANES * 2);
			pt->fingerprinted = 1;
			r->fp_parts++;
			XXH128_canonicalFromHash(&key, pt->fp);
			if (!pt->zero && nknown &&
			    bsearch(&key, known, nknown, sizeof(key), by_bytes)) {
				pt->skip = 1;
				r->fp_skipped++;
				r->fp_skipped_bytes += part_len(c, q);
			}
		}
	}
	free(lanes);
	free(nonzero);
	plan.fingerprinted = fp;
	r->fp_seconds = seconds_since(t0);
	return;
fail:
	pr_warn("no %s, every chunk is copied: %s", fp ? "fingerprints" : "zero parts", err);
	if (fp)
		snprintf(r->fp_error, sizeof(r->fp_error), "%s", err);
	if (zeros)
		snprintf(r->zero_error, sizeof(r->zero_error), "%s", err);
}

/* The fingerprint of part q of c as reloaded: from the GPU's lanes, or (lanes NULL) from its
 * bytes read back from its file into buf (CHUNK bytes, the part at its place in the chunk)
 * and folded on the CPU. 0, or -errno. */
static int reloaded_fp(const struct chunk *c, int q, const uint64_t *lanes, const int *fds,
		       unsigned char *buf, XXH128_hash_t *fp)
{
	size_t first = (size_t)q * FILE_ALIGN, n = part_len(c, q);

	if (lanes) {
		*fp = part_fp(c, q, lanes + c->part[q].seg * FP_LANES * 2);
		return 0;
	}
	if (!fds) { /* the agent's memory (gpu_check): the part where sinks_layout put it */
		if (!plan.region[c->file])
			return -EIO;
		memcpy(buf + first, plan.region[c->file] + c->part[q].sink_off, n);
		*fp = part_fp_host(c, q, buf);
		return 0;
	}
	for (size_t done = 0; done < n;) {
		ssize_t got = pread(fds[c->file], buf + first + done, n - done,
				    c->file_off + first + done);

		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			return got ? -errno : -EIO;
		done += got;
	}
	*fp = part_fp_host(c, q, buf);
	return 0;
}

/* After a reload: every fingerprinted part again, on the GPU; the parts the store supplied
 * (skipped) and those without a host sum (gpu_check) are checked this way only. When the GPU cannot run the kernel now (full after the
 * re-creation, say), those are checked on the CPU from their files instead (fds; slower),
 * or, streamed, taken as torpor checked them (their sha256), rather than leaving the program
 * held at a closed gate. 0, or -1 with r->error. */
int fingerprints_verify(const int *fds, struct move_result *r)
{
	size_t bad = 0, bad_skipped = 0, skipped = 0, unsummed = 0;
	unsigned char *buf = NULL;
	char err[160];
	uint64_t *lanes;
	int ret = 0;

	if (!plan.fingerprinted)
		return 0;
	for (size_t j = 0; j < plan.nchunks; j++)
		for (int q = 0; q < PARTS; q++) {
			const struct part *pt = &plan.chunks[j].part[q];

			skipped += pt->skip;
			unsummed += !pt->zero && !part_summed(pt);
		}
	lanes = lanes_all(err, sizeof(err));
	if (!lanes && unsummed) { /* gpu_check: from the sink, on the CPU, like the store's */
		buf = fds || plan.in_memory ? malloc(CHUNK) : NULL;
		if (!buf) {
			snprintf(r->error, sizeof(r->error), "the %zu reloaded parts checked on the GPU "
				 "cannot be checked: %s", unsummed, err);
			return -1;
		}
		pr_warn("no fingerprint kernel now (%s): %zu parts checked on the CPU", err,
			unsummed);
	} else if (!lanes) {
		if (!skipped) { /* every part was written, and its sum checked */
			pr_warn("fingerprints not checked: %s", err);
			return 0;
		}
		if (stream_active()) { /* no files to read them back from */
			pr_warn("fingerprints not checked (%s): the %zu parts the image store supplied "
				"came through its stream, each checked by torpor against the sha256 its "
				"snapshot names", err, skipped);
			return 0;
		}
		buf = fds ? malloc(CHUNK) : NULL;
		if (!buf) {
			snprintf(r->error, sizeof(r->error), "the %zu chunks the image store supplied "
				 "cannot be checked: %s", skipped, err);
			return -1;
		}
		pr_warn("no fingerprint kernel now (%s): the %zu parts the image store supplied are "
			"checked on the CPU", err, skipped);
	}
	for (size_t j = 0; j < plan.nchunks && !ret; j++) {
		struct chunk *c = &plan.chunks[j];

		for (int q = 0; q < PARTS && !ret; q++) {
			XXH128_hash_t fp;
			int rc;

			/* on the CPU: the parts nothing else checked (a zero part was made by a
			 * memset, from the agent's own memory) */
			if (!c->part[q].fingerprinted ||
			    (!lanes && ((!c->part[q].skip && part_summed(&c->part[q])) ||
					c->part[q].zero)))
				continue;
			rc = reloaded_fp(c, q, lanes, fds, buf, &fp);
			if (rc) {
				snprintf(r->error, sizeof(r->error), "reading data file %d again: %s",
					 c->file, strerror(-rc));
				ret = -1;
			} else if (!XXH128_isEqual(fp, c->part[q].fp)) {
				bad++;
				bad_skipped += c->part[q].skip;
			}
		}
	}
	free(lanes);
	free(buf);
	if (!ret && bad) {
		r->damaged = fds != NULL;
		if (bad_skipped)
			snprintf(r->error, sizeof(r->error), "%zu reloaded chunk(s) do not match "
				 "their fingerprints (%zu of them supplied by the image store: the data "
				 "files' holes were not filled from the store, or with other data)", bad,
				 bad_skipped);
		else
			snprintf(r->error, sizeof(r->error), "%zu reloaded chunk(s) do not match "
				 "their fingerprints: %s", bad, fds ? "the data files are damaged or not "
				 "this program's" : stream_active() ? "the image store's parts are not "
				 "this program's" : "the program overwrote its saved GPU data");
		ret = -1;
	}
	return ret;
}

int fingerprints_match(char *err, size_t errsize)
{
	size_t bad = 0, checked = 0;
	uint64_t *lanes;

	char why[96];

	if (!plan.fingerprinted) {
		snprintf(err, errsize, "cannot be checked: the parts have no fingerprints");
		return -1;
	}
	lanes = lanes_all(why, sizeof(why));
	if (!lanes) {
		snprintf(err, errsize, "cannot be checked on the GPU (%s)", why);
		return -1;
	}
	for (size_t j = 0; j < plan.nchunks; j++) {
		const struct chunk *c = &plan.chunks[j];

		for (int q = 0; q < PARTS; q++) {
			if (!c->part[q].fingerprinted)
				continue;
			checked++;
			bad += !XXH128_isEqual(part_fp(c, q, lanes + c->part[q].seg * FP_LANES * 2),
					       c->part[q].fp);
		}
	}
	free(lanes);
	if (bad) {
		snprintf(err, errsize, "is not what was saved (%zu of %zu parts do not match their "
			 "fingerprints)", bad, checked);
		return -1;
	}
	return 0;
}

/* The index torpor reads (agent/PROTOCOL.md): one line a fingerprinted part, its last field
 * 0 (copied), 1 (skipped: the store has it) or z (zero: neither copied nor stored). */
int index_write(int fd, char *err, size_t errsize)
{
	size_t cap = 64 + plan.nchunks * PARTS * 96, used = 0;
	char *text = malloc(cap);
	int ret = 0;

	if (!text) {
		snprintf(err, errsize, "out of memory");
		return -1;
	}
	used += snprintf(text, cap, "torpor-gpu-fingerprints 2\n");
	for (size_t j = 0; j < plan.nchunks; j++) {
		const struct chunk *c = &plan.chunks[j];

		for (int q = 0; q < PARTS; q++) {
			const struct part *pt = &c->part[q];
			XXH128_canonical_t key;

			if (!pt->fingerprinted)
				continue;
			XXH128_canonicalFromHash(&key, pt->fp);
			used += snprintf(text + used, cap - used, "%d %llu %zu %llu ", c->file,
					 c->file_off + (unsigned long long)q * FILE_ALIGN, part_len(c, q),
					 pt->store_len);
			for (int b = 0; b < 16; b++)
				used += snprintf(text + used, cap - used, "%02x", key.digest[b]);
			used += snprintf(text + used, cap - used, " %s\n",
					 pt->zero ? "z" : pt->skip ? "1" : "0");
		}
	}
	for (size_t done = 0; done < used;) {
		ssize_t n = pwrite(fd, text + done, used - done, done);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			snprintf(err, errsize, "writing the fingerprint index: %s",
				 n ? strerror(errno) : "nothing written");
			ret = -1;
			break;
		}
		done += n;
	}
	free(text);
	return ret;
}
