/* The mover's workers: one thread a sink, each with tune.buffers pinned staging buffers and as
 * many streams a device (two by default; mover_tune.c), copying chunk after chunk between the GPU and its sink (a data file, a region of
 * the agent's memory, or the image store's ring: stream.c), summing every part on the way
 * (mover.c's top comment tells the whole story; mover.h: what they share). With
 * TORPOR_AGENT_MOVER_SINK=direct(-whole) the GPU copies straight into the sink, registered
 * with the driver (direct_*), and the staging buffers are only a fallback.
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#include "mover.h"

volatile int failed;
int fp_checking;

static pthread_mutex_t err_lock = PTHREAD_MUTEX_INITIALIZER;

void fail(struct worker *w, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(w->error, sizeof(w->error), fmt, ap);
	va_end(ap);
	pthread_mutex_lock(&err_lock);
	failed = 1;
	pthread_mutex_unlock(&err_lock);
	pr_err("%s", w->error);
}

int use_device(struct worker *w, CUdevice dev, CUstream *s)
{
	CUcontext ctx = track_context_of(dev);
	CUresult rc;

	if (dev < 0 || dev >= MAX_DEVICES || !ctx) {
		fail(w, "no context of device %d", dev);
		return -1;
	}
	if (w->current != ctx) {
		rc = real.cuCtxSetCurrent(ctx);
		if (rc != CUDA_SUCCESS) {
			fail(w, "cuCtxSetCurrent: CUresult %d", rc);
			return -1;
		}
		w->current = ctx;
	}
	for (int i = 0; i < tune.buffers; i++) {
		if (!w->stream[dev][i]) {
			rc = real.cuStreamCreate(&w->stream[dev][i], CU_STREAM_NON_BLOCKING);
			if (rc != CUDA_SUCCESS) {
				fail(w, "cuStreamCreate: CUresult %d", rc);
				return -1;
			}
		}
		s[i] = w->stream[dev][i];
	}
	return 0;
}

/* Does w stage a part at a time (tune.stage_part), or a chunk? A streamed load fills whole
 * chunks' buffers from the ring (stream.c): it stages chunks whatever the tuning. */
static int staged_by_part(const struct worker *w)
{
	return tune.stage_part && !(stream_active() && !w->saving);
}

static int staging_get(struct worker *w)
{
	size_t stage = staged_by_part(w) ? FILE_ALIGN : CHUNK, size = (size_t)tune.buffers * stage;
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CUresult rc;

	if (p == MAP_FAILED) {
		fail(w, "staging memory (%zu MiB): %s", size >> 20, strerror(errno));
		return -1;
	}
	madvise(p, size, MADV_HUGEPAGE);
	memset(p, 0, size); /* faulted in by this thread, in parallel with the others */
	for (int i = 0; i < tune.buffers; i++)
		w->buf[i] = (unsigned char *)p + (size_t)i * stage;
	w->buf_size = size;
	rc = real.cuMemHostRegister_v2(p, size, CU_MEMHOSTREGISTER_PORTABLE);
	if (rc != CUDA_SUCCESS) {
		fail(w, "cuMemHostRegister of the staging memory: CUresult %d", rc);
		return -1;
	}
	w->registered = 1;
	return 0;
}

static void staging_put(struct worker *w)
{
	if (w->registered)
		real.cuMemHostUnregister(w->buf[0]);
	if (w->buf[0])
		munmap(w->buf[0], w->buf_size);
	memset(w->buf, 0, sizeof(w->buf));
	w->registered = 0;
	for (int d = 0; d < MAX_DEVICES; d++)
		for (int i = 0; i < MAX_BUFFERS; i++)
			if (w->stream[d][i]) {
				real.cuStreamDestroy_v2(w->stream[d][i]);
				w->stream[d][i] = NULL;
			}
}

int copy_range(struct worker *w, unsigned char *host, CUdeviceptr dev, size_t len,
		      CUstream s, int out)
{
	CUresult rc = out ? real.cuMemcpyDtoHAsync_v2(host, dev, len, s)
			  : real.cuMemcpyHtoDAsync_v2(dev, host, len, s);

	if (rc != CUDA_SUCCESS) {
		fail(w, "%s of %zu bytes at 0x%llx: CUresult %d", out ? "copy out" : "copy in", len,
		     dev, rc);
		return -1;
	}
	return 0;
}

/* Where the byte at offset x of chunk c is on the host: in buf (staged), or (buf NULL: direct)
 * in the sink's mapping. A stretch of parts that move is contiguous in either: in a file each
 * part is at file_off + its offset, in a region the parts that move are packed and every part
 * but a chunk's last is FILE_ALIGN long (sinks_layout). */
static unsigned char *host_at(const struct worker *w, const struct chunk *c, unsigned char *buf,
			      size_t x)
{
	size_t q = x / FILE_ALIGN;

	return buf ? buf + x : w->map + c->part[q].sink_off + (x - q * FILE_ALIGN);
}

/* Every piece of chunk c between the host (buf, or NULL: straight from or into the sink) and
 * the GPU but the stretches in parts that stay behind (part_stays: zero parts either way,
 * skipped ones out of the GPU). */
static int copy_chunk(struct worker *w, const struct chunk *c, unsigned char *buf, CUstream s,
		      int out)
{
	for (size_t i = c->first; i < c->first + c->npieces; i++) {
		const struct piece *p = &plan.pieces[i];
		CUdeviceptr dev = plan.mv[p->mv].src + p->off;
		size_t run = p->at; /* start of the stretch to copy */

		for (size_t a = p->at; a < p->at + p->len;) {
			size_t end = (a / FILE_ALIGN + 1) * FILE_ALIGN;

			if (end > p->at + p->len)
				end = p->at + p->len;
			if (part_stays(&c->part[a / FILE_ALIGN], out)) {
				if (a > run && copy_range(w, host_at(w, c, buf, run), dev + (run - p->at),
							  a - run, s, out))
					return -1;
				run = end;
			}
			a = end;
		}
		if (p->at + p->len > run &&
		    copy_range(w, host_at(w, c, buf, run), dev + (run - p->at), p->at + p->len - run,
			       s, out))
			return -1;
	}
	return 0;
}

/* TORPOR_AGENT_FP_CHECK: the GPU's fingerprint of part q, copied out, against the CPU's from
 * the bytes that arrived (base: where the chunk's first byte would be, the part at its place)
 * (what the GPU tests run with). */
static int fp_check_part(struct worker *w, const struct chunk *c, int q, const unsigned char *base)
{
	if (!c->part[q].fingerprinted || part_stays(&c->part[q], 1) ||
	    XXH128_isEqual(part_fp_host(c, q, base), c->part[q].fp))
		return 0;
	fail(w, "fingerprint check: the GPU's fingerprint of %zu bytes at file %d offset %llu "
	     "differs from the CPU's", part_len(c, q), c->file,
	     c->file_off + (unsigned long long)q * FILE_ALIGN);
	return -1;
}

/* fp_check_part of every part of c, in buf or (NULL) in the sink */
static int fp_check(struct worker *w, const struct chunk *c, const unsigned char *buf)
{
	for (int q = 0; q < PARTS; q++)
		if (fp_check_part(w, c, q, buf ? buf : (const unsigned char *)
				  ((uintptr_t)host_at(w, c, NULL, (size_t)q * FILE_ALIGN) -
				   (uintptr_t)q * FILE_ALIGN)))
			return -1;
	return 0;
}

int wait_stream(struct worker *w, CUstream s)
{
	CUresult rc = real.cuStreamSynchronize(s);

	if (rc != CUDA_SUCCESS) {
		fail(w, "cuStreamSynchronize: CUresult %d", rc);
		return -1;
	}
	return 0;
}

/* -- the agent's memory as a sink ----------------------------------------------------------- */

/* Faults a fresh region in from this thread (the kernel zeroes its pages: in parallel with
 * the other workers). MADV_POPULATE_WRITE does it without a write from here; older kernels
 * get a write a page. */
static int populate(unsigned char *p, size_t size)
{
	if (madvise(p, size, MADV_POPULATE_WRITE) == 0)
		return 0;
	if (errno != EINVAL)
		return -1;
	for (size_t off = 0; off < size; off += 4096)
		p[off] = 0;
	return 0;
}

/* The region of sink k in the agent's memory (a save makes it, a load finds it). */
static int region_get(struct worker *w)
{
	size_t size = round_up(plan.file_size[w->k], REGION_ALIGN);
	unsigned char *p = plan.region[w->k];
	long long t0;

	if (!size) /* every part of this sink is zero: nothing to keep */
		return 0;
	if (!p) {
		p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
			 -1, 0);
		if (p == MAP_FAILED) {
			fail(w, "host memory for %zu MiB of GPU data: %s", size >> 20, strerror(errno));
			return -1;
		}
		/* No MADV_HUGEPAGE by default: on the H200 host the copy out was no faster with it
		 * (5.5 s against 5.0 s for 17.4 GB), and with THP defrag "madvise" every huge-page
		 * fault of such a region may stall in direct compaction (TORPOR_AGENT_MOVER_REGION_HUGE
		 * asks for them, to measure again). */
		if (tune.region_huge)
			madvise(p, size, MADV_HUGEPAGE);
		madvise(p, size, MADV_DONTFORK); /* a child must not inherit (copy) the program's GPU data */
		plan.region[w->k] = p;
		plan.region_size[w->k] = size;
		t0 = now_ms();
		if (populate(p, size)) {
			fail(w, "host memory for %zu MiB of GPU data: %s", size >> 20, strerror(errno));
			return -1;
		}
		w->populate_ms = now_ms() - t0;
	}
	w->region = p;
	return 0;
}

static void sync_streams(struct worker *w)
{
	for (int d = 0; d < MAX_DEVICES; d++)
		for (int i = 0; i < MAX_BUFFERS; i++)
			if (w->stream[d][i] && real.cuStreamSynchronize(w->stream[d][i]) != CUDA_SUCCESS &&
			    !failed)
				fail(w, "cuStreamSynchronize after the %s failed",
				     w->saving ? "copy out" : "reload");
}

/* n bytes between p and w's data file at off, whole (pwrite or pread again after a short one);
 * 0, or -1 with the worker failed. */
static int file_all(struct worker *w, unsigned char *p, size_t n, unsigned long long off)
{
	for (size_t done = 0; done < n;) {
		ssize_t r = w->saving ? pwrite(w->fd, p + done, n - done, off + done)
				      : pread(w->fd, p + done, n - done, off + done);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			fail(w, "%s data file %d: %s", w->saving ? "writing" : "reading", w->k,
			     strerror(errno));
			return -1;
		}
		if (r == 0) {
			w->damaged = !w->saving;
			fail(w, "data file %d ends at %llu: it is not the file this data was saved to",
			     w->k, off + done);
			return -1;
		}
		done += r;
	}
	return 0;
}

#define HUGE_PAGE (2UL << 20) /* the tmpfs's huge page: a save's write covers whole ones */

/* Part q of c between buf and the sink, SUB at a time (each block summed whole while it is in
 * the CPU's cache: the checksum's stripes fall the same way on both sides). A save into a
 * file writes whole huge pages (TORPOR_AGENT_MOVER_WRITE=part, the default): the part in one
 * pwrite, or 2 MiB at a time once summed (still in cache). The part is FILE_ALIGN-aligned in
 * its file, so every write covers whole huge pages of the suspend_dir's tmpfs, and the kernel
 * does not zero the rest of a new 2 MiB page that a 1 MiB write leaves (shmem_write_end
 * zeroes what a write leaves of a folio not yet up to date, and the next write overwrites it:
 * half a byte more written to memory for every byte saved). That holds where the kernel copies
 * a write a folio at a time (Linux 6.18, here and on the GPU host); one that copies page by
 * page zeroes a new huge page at its first 4 KiB whatever the write's size. */
static int part_io(struct worker *w, const struct chunk *c, unsigned char *buf, int q,
		   uint64_t *sum)
{
	size_t first = (size_t)q * FILE_ALIGN, last = first + part_len(c, q);
	unsigned long long sink = c->part[q].sink_off; /* the part's first byte in the sink */
	int summed = part_summed(&c->part[q]);
	int whole = w->saving && !w->region && tune.write_part;
	size_t pending = first; /* whole: written up to here */
	struct sum s;

	if (w->saving && stream_active())
		return part_stream(w, c, buf, q, sum);
	sum_init(&s);
	for (size_t block = first; block < last; block += SUB) {
		size_t n = last - block < SUB ? last - block : SUB;

		if (w->saving && summed)
			sum_add(&s, buf + block, n);
		if (w->region) { /* the agent's memory: the block is still in cache */
			unsigned char *at = w->region + sink + (block - first);

			w->saving ? memcpy(at, buf + block, n) : memcpy(buf + block, at, n);
		} else if (!whole) {
			if (file_all(w, buf + block, n, sink + (block - first)))
				return -1;
		} else if (block + n == last || (summed && block + n - pending >= HUGE_PAGE)) {
			if (file_all(w, buf + pending, block + n - pending, sink + (pending - first)))
				return -1;
			pending = block + n;
		}
		if (!w->saving && summed)
			sum_add(&s, buf + block, n);
	}
	*sum = summed ? sum_end(&s) : 0;
	return 0;
}


/* Writes (saving) or reads one chunk's bytes between buf and the sink, part by part (part_io:
 * how each is summed and written), and returns each part's checksum in sums. The parts that stay behind
 * (part_stays) are neither written nor read (nor summed). */
static int file_io(struct worker *w, const struct chunk *c, unsigned char *buf, uint64_t *sums)
{
	for (int q = 0; q < PARTS && (size_t)q * FILE_ALIGN < c->len; q++) {
		if (part_stays(&c->part[q], w->saving))
			continue;
		if (part_io(w, c, buf, q, &sums[q]))
			return -1;
	}
	return 0;
}


/* The bytes of c a save (out) or a load moves: all but those of the parts that stay behind. */
static size_t moved_len(const struct chunk *c, int out)
{
	size_t n = c->len;

	for (int q = 0; q < PARTS; q++)
		n -= part_stays(&c->part[q], out) ? part_len(c, q) : 0;
	return n;
}

static int staging_get(struct worker *w);

/* Staging buffers for a staged chunk (direct workers get them only when one falls back). */
static int staging_need(struct worker *w)
{
	return w->buf[0] ? 0 : staging_get(w);
}

/* The chunk is out, in its buffer or (buf NULL) in the sink: checked (fp_check), written,
 * summed. */
static int save_one(struct worker *w, struct chunk *c, const unsigned char *buf)
{
	uint64_t sums[PARTS] = { 0 };

	if (fp_checking && fp_check(w, c, buf))
		return -1;
	if (!buf)
		direct_sums(w, c, sums);
	else if (file_io(w, c, (unsigned char *)buf, sums))
		return -1;
	for (int q = 0; q < PARTS; q++)
		c->part[q].sum = sums[q];
	w->bytes += moved_len(c, 1);
	return 0;
}

/* Worker k moves the chunks j = k (mod nfiles): worker_count of them, its i-th being chunk
 * worker_chunk(k, i). The chunks are sorted by device (by_device), so taken in order every
 * worker would copy from the first GPU, then all from the second: one PCIe link busy at a
 * time. Instead worker k starts at its first chunk of device k mod ndevs and wraps around,
 * so the workers spread over every GPU from the start and move their memory at once. */
static size_t worker_count(int k)
{
	return (size_t)k < plan.nchunks ? (plan.nchunks - k + plan.nfiles - 1) / plan.nfiles : 0;
}

static size_t worker_chunk(int k, size_t i)
{
	size_t n = worker_count(k), first = 0;

	if (plan.ndevs > 1) {
		size_t at = plan.dev_first[k % plan.ndevs];  /* its first chunk at or after that */

		first = at > (size_t)k ? (at - k + plan.nfiles - 1) / plan.nfiles : 0;
		if (first >= n)
			first = 0;
	}
	return k + ((first + i) % n) * plan.nfiles;
}

/* Copies chunk after chunk into tune.buffers slots in turn (a staging buffer, or the sink
 * itself: direct), each with its stream: the oldest chunk is written while the newer ones
 * copy. */
static void *save_main(struct worker *w)
{
	struct chunk *held[MAX_BUFFERS] = { 0 }; /* the chunk in each slot, not yet written */
	CUstream used[MAX_BUFFERS] = { 0 };
	int direct[MAX_BUFFERS] = { 0 }, nb = tune.buffers;
	size_t n = worker_count(w->k);

	for (size_t i = 0; i < n + nb && !failed; i++) {
		int slot = (int)(i % nb);
		CUstream s[MAX_BUFFERS];
		struct chunk *c;

		if (held[slot]) { /* chunk i - nb: its copy over, written */
			if (wait_stream(w, used[slot]) ||
			    save_one(w, held[slot], direct[slot] ? NULL : w->buf[slot]))
				return NULL;
			direct_end(w, slot);
			held[slot] = NULL;
		}
		if (i >= n)
			continue;
		c = &plan.chunks[worker_chunk(w->k, i)];
		if (use_device(w, c->dev, s))
			return NULL;
		direct[slot] = direct_begin(w, c, slot);
		direct[slot] ? w->direct_chunks++ : w->staged_chunks++;
		if ((!direct[slot] && staging_need(w)) ||
		    copy_chunk(w, c, direct[slot] ? NULL : w->buf[slot], s[slot], 1))
			return NULL;
		held[slot] = c;
		used[slot] = s[slot];
	}
	return NULL;
}

/* A part read back from w's sink is not what was saved (chunk j, part q of c). */
static void sum_mismatch(struct worker *w, size_t j, const struct chunk *c, int q)
{
	w->damaged = !w->region;
	fail(w, "chunk %zu (%s %d, offset %llu, %zu bytes): checksum mismatch: %s", j,
	     w->region ? "memory region" : "file", c->file,
	     c->file_off + (unsigned long long)q * FILE_ALIGN, part_len(c, q),
	     w->region ? "the program overwrote its saved GPU data"
		       : "the file is damaged or not this program's");
}

/* Reads (and checks) chunk after chunk into tune.buffers slots in turn and copies each in;
 * a slot is reused once the copy from it, on the stream it went on, is over. */
static void *load_main(struct worker *w)
{
	CUstream used[MAX_BUFFERS] = { 0 };
	int nb = tune.buffers;

	for (size_t i = 0, n = worker_count(w->k); i < n && !failed; i++) {
		int slot = (int)(i % nb), direct, q;
		size_t j = worker_chunk(w->k, i);
		struct chunk *c = &plan.chunks[j];
		uint64_t sums[PARTS] = { 0 };
		CUstream s[MAX_BUFFERS];

		if (use_device(w, c->dev, s))
			break;
		/* the copy that used this slot nb chunks ago must be over (on its own device's
		 * stream: the chunks of a worker change device) */
		if (used[slot] && wait_stream(w, used[slot]))
			break;
		direct_end(w, slot);
		direct = direct_begin(w, c, slot);
		direct ? w->direct_chunks++ : w->staged_chunks++;
		if (direct)
			direct_sums(w, c, sums);
		else if (staging_need(w) || file_io(w, c, w->buf[slot], sums))
			break;
		/* skipped parts: their fingerprints, after the load; zero ones were not read; nor
		 * summed ones (gpu_check): their fingerprints too */
		for (q = 0; q < PARTS; q++)
			if (!c->part[q].skip && !c->part[q].zero && part_len(c, q) &&
			    part_summed(&c->part[q]) && sums[q] != c->part[q].sum)
				break;
		if (q < PARTS) {
			sum_mismatch(w, j, c, q);
			break;
		}
		if (copy_chunk(w, c, direct ? NULL : w->buf[slot], s[slot], 0))
			break;
		used[slot] = s[slot];
		w->bytes += moved_len(c, 0);
	}
	return NULL;
}

/* -- staging a part at a time (TORPOR_AGENT_MOVER_STAGE=part) --------------------------------
 * The pipeline's unit is a part that moves (FILE_ALIGN bytes), not a chunk: each staging buffer
 * is one part long, so what the workers have in flight between the DMA and the CPU's copy stays
 * in the CPU's cache (bench/host_bounds.c on the H200, 16 threads: pwrite 49.9 against 35.3 GB/s
 * on the way in, 34.7 against 29.2 out). The files' layout, the sums and the fingerprints are a
 * part's either way; only the copies' order and size change. */

struct unit {
	size_t i; /* the worker's i-th chunk (worker_chunk) */
	int q;    /* its part */
};

/* u moved on to the worker's next part that moves (out: a save) (u->q -1: the first); 0 when
 * none is left. */
static int unit_next(const struct worker *w, struct unit *u, int out)
{
	size_t n = worker_count(w->k);

	for (;;) {
		if (++u->q == PARTS)
			u->i++, u->q = 0;
		if (u->i >= n)
			return 0;
		const struct chunk *c = &plan.chunks[worker_chunk(w->k, u->i)];

		if (part_len(c, u->q) && !part_stays(&c->part[u->q], out))
			return 1;
	}
}

/* Part q of c between the GPU and buf (its first byte at buf): every piece's share of it. */
static int copy_part(struct worker *w, const struct chunk *c, int q, unsigned char *buf,
		     CUstream s, int out)
{
	size_t lo = (size_t)q * FILE_ALIGN, hi = lo + part_len(c, q);

	for (size_t i = c->first; i < c->first + c->npieces; i++) {
		const struct piece *p = &plan.pieces[i];
		size_t a = p->at > lo ? p->at : lo, b = p->at + p->len < hi ? p->at + p->len : hi;

		if (a < b && copy_range(w, buf + (a - lo), plan.mv[p->mv].src + p->off + (a - p->at),
					b - a, s, out))
			return -1;
	}
	return 0;
}

/* Where chunk c's first byte would be for part q staged at buf (part_io and the checks address
 * a part at its place in its chunk). */
static unsigned char *part_base(unsigned char *buf, int q)
{
	return (unsigned char *)((uintptr_t)buf - (uintptr_t)q * FILE_ALIGN);
}

/* save_main, a part at a time: the oldest part in flight is checked and written while the newer
 * ones copy. */
static void *save_parts_main(struct worker *w)
{
	struct chunk *held[MAX_BUFFERS] = { 0 };
	int hq[MAX_BUFFERS] = { 0 }, nb = tune.buffers, inflight = 0;
	CUstream used[MAX_BUFFERS] = { 0 };
	struct unit u = { 0, -1 };
	int more = unit_next(w, &u, 1);

	for (int slot = 0; (more || inflight) && !failed; slot = (slot + 1) % nb) {
		if (held[slot]) { /* the part nb ago: its copy over, written */
			struct chunk *c = held[slot];
			unsigned char *base = part_base(w->buf[slot], hq[slot]);
			uint64_t sum = 0;

			if (wait_stream(w, used[slot]) ||
			    (fp_checking && fp_check_part(w, c, hq[slot], base)) ||
			    part_io(w, c, base, hq[slot], &sum))
				return NULL;
			c->part[hq[slot]].sum = sum;
			w->bytes += part_len(c, hq[slot]);
			held[slot] = NULL;
			inflight--;
		}
		if (!more)
			continue;
		struct chunk *c = &plan.chunks[worker_chunk(w->k, u.i)];
		CUstream s[MAX_BUFFERS];

		if (use_device(w, c->dev, s) || copy_part(w, c, u.q, w->buf[slot], s[slot], 1))
			return NULL;
		held[slot] = c, hq[slot] = u.q, used[slot] = s[slot];
		inflight++;
		more = unit_next(w, &u, 1);
	}
	return NULL;
}

/* load_main, a part at a time: a slot is reused once the copy from it is over. */
static void *load_parts_main(struct worker *w)
{
	CUstream used[MAX_BUFFERS] = { 0 };
	struct unit u = { 0, -1 };

	for (int slot = 0; !failed && unit_next(w, &u, 0); slot = (slot + 1) % tune.buffers) {
		size_t j = worker_chunk(w->k, u.i);
		struct chunk *c = &plan.chunks[j];
		const struct part *pt = &c->part[u.q];
		CUstream s[MAX_BUFFERS];
		uint64_t sum = 0;

		if (use_device(w, c->dev, s) || (used[slot] && wait_stream(w, used[slot])) ||
		    part_io(w, c, part_base(w->buf[slot], u.q), u.q, &sum))
			break;
		/* skipped parts: their fingerprints, after the load (as load_main) */
		if (!pt->skip && part_summed(pt) && sum != pt->sum) {
			sum_mismatch(w, j, c, u.q);
			break;
		}
		if (copy_part(w, c, u.q, w->buf[slot], s[slot], 0))
			break;
		used[slot] = s[slot];
		w->bytes += part_len(c, u.q);
	}
	return NULL;
}

/* Into the agent's memory, every worker registers its staging buffers before any populates
 * its region. Measured on the H200 host (bench/host_paths.c, staged-anon): with threads
 * populating 1 GiB each while others registered 64 MiB, the registrations took 3.4 s and the
 * copies 5x longer than into tmpfs files (where nothing is populated up front); pinning moves
 * pages (long-term pins leave movable memory) and competes with the faults for the same
 * memory. Each worker arrives once, whatever happened to it; run_workers sets how many. */
static struct {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	int arrived, expected; /* expected -1: not all started yet */
} pinned = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, -1 };

static void pinned_wait(void)
{
	pthread_mutex_lock(&pinned.lock);
	pinned.arrived++;
	pthread_cond_broadcast(&pinned.cond);
	while (pinned.expected < 0 || pinned.arrived < pinned.expected)
		pthread_cond_wait(&pinned.cond, &pinned.lock);
	pthread_mutex_unlock(&pinned.lock);
}

static void pinned_expect(int n)
{
	pthread_mutex_lock(&pinned.lock);
	pinned.expected = n;
	pthread_cond_broadcast(&pinned.cond);
	pthread_mutex_unlock(&pinned.lock);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	CUstream s[MAX_BUFFERS];
	int ready = 0, active = (size_t)w->k < plan.nchunks; /* fewer chunks than sinks */
	long long t0 = now_ms();

	gate_agent_thread();
	/* a context current before the staging memory is registered (CUDA_ERROR_INVALID_CONTEXT
	 * otherwise: this thread is new) */
	if (active) {
		int dev = plan.chunks[worker_chunk(w->k, 0)].dev;

		pr_debug("mover %d: %zu chunks, from device %d's", w->k, worker_count(w->k), dev);
		if (use_device(w, dev, s) == 0) /* direct: staging only for a chunk that falls back */
			ready = (tune.direct && !stream_active()) || staging_get(w) == 0;
	}
	w->staging_ms = now_ms() - t0;
	if (plan.in_memory)
		pinned_wait();
	if (ready && (!plan.in_memory || region_get(w) == 0)) {
		t0 = now_ms();
		direct_open(w); /* mapped, and for DIRECT_WHOLE registered: the staging phase's */
		w->staging_ms += now_ms() - t0;
		if (w->saving)
			staged_by_part(w) ? save_parts_main(w) : save_main(w);
		else
			stream_active()	    ? load_stream_main(w)
			: staged_by_part(w) ? load_parts_main(w)
					    : load_main(w);
		if (tune.direct)
			pr_debug("mover %d: %zu chunks straight, %zu staged", w->k, w->direct_chunks,
				 w->staged_chunks);
	}
	if (active)
		sync_streams(w); /* nothing in flight once the staging memory goes */
	direct_close(w);
	staging_put(w);
	return NULL;
}

int run_workers(const int *fds, int nfds, int saving, struct move_result *r)
{
	struct worker *w = calloc(nfds, sizeof(*w));
	long long t0 = now_ms();
	sigset_t all, old;
	int started = 0, ret = 0;

	if (!w) {
		snprintf(r->error, sizeof(r->error), "out of memory");
		return -1;
	}
	failed = 0;
	pinned.arrived = 0;
	pinned.expected = -1;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (int k = 0; k < nfds; k++) {
		w[k].k = k;
		w[k].fd = fds ? fds[k] : -1;
		w[k].saving = saving;
		if (pthread_create(&w[k].thread, NULL, worker_main, &w[k])) {
			snprintf(w[k].error, sizeof(w[k].error), "cannot start a mover thread");
			failed = 1;
			break;
		}
		started++;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pinned_expect(started);
	for (int k = 0; k < started; k++)
		pthread_join(w[k].thread, NULL);
	for (int k = 0; k < nfds; k++) {
		r->bytes += w[k].bytes;
		if (w[k].populate_ms / 1000.0 > r->host_alloc_seconds)
			r->host_alloc_seconds = w[k].populate_ms / 1000.0;
		if (w[k].staging_ms / 1000.0 > r->staging_seconds)
			r->staging_seconds = w[k].staging_ms / 1000.0;
		if (w[k].error[0] && !ret) {
			snprintf(r->error, sizeof(r->error), "%s", w[k].error);
			r->damaged = w[k].damaged;
			ret = -1;
		}
	}
	if (failed && !ret) {
		snprintf(r->error, sizeof(r->error), "a mover thread failed");
		ret = -1;
	}
	free(w);
	r->copy_seconds = (now_ms() - t0) / 1000.0;
	return ret;
}

/* mover_after_fork's share: the locks as new (a thread of the parent may have held them). */
void workers_after_fork(void)
{
	pthread_mutex_init(&err_lock, NULL);
	pthread_mutex_init(&pinned.lock, NULL);
	pthread_cond_init(&pinned.cond, NULL);
}
