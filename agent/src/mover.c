/* The mover: the program's movable GPU memory (vmm.c) out to host memory or files and back,
 * at PCIe speed.
 *
 * Save: the movable allocations are cut into pieces and packed into chunks, one for each
 * CHUNK-aligned window of device addresses that holds any (a 2 MiB allocation does not cost a
 * write of its own); chunk j goes to sink j % nsinks, appended. In a file, each chunk starts
 * at a multiple of FILE_ALIGN (the gap is a hole: no bytes written), so that the image store,
 * which cuts files into FILE_ALIGN pieces, sees a chunk's bytes the same way wherever it
 * lands: what a chunk holds depends on its window alone, so an allocation that appears or
 * goes away changes one chunk, not every chunk after it (packed back to back, one allocator
 * segment freed between two checkpoints shifted every later chunk, and the store kept
 * nothing after it). One worker thread a sink. A 64-bit checksum of every chunk is kept in
 * the agent's memory (it travels with the process image: CRIU restores it with the rest of
 * the agent).
 * Once every chunk is out, the physical memory of every movable allocation is released
 * (vmm_drop); the addresses stay.
 *
 * Load: every dropped allocation is re-created at its addresses (vmm_recreate), then each
 * worker brings its sink's chunks back, checking each checksum.
 *
 * A sink is a data file, or (a prepare without files: a suspend) a region of the agent's own
 * anonymous memory, one a worker, populated by its worker (the kernel zeroes its pages in
 * parallel) and kept until the load unmaps it. Either way each worker has two pinned staging
 * buffers and a stream for each: while one buffer is summed and written to (read from) its
 * sink, the GPU copies the next chunk into (out of) the other. Copying straight between the
 * GPU and a registered region or a registered tmpfs mapping was measured slower on the H200
 * host (bench/host_paths.c: registering 16 GB took 1.9-2.6 s and unregistering it 1.2-2.4 s,
 * 4.5 s for tmpfs pages; the staged copy into /dev/shm moved the same 16 GB in 0.7 s).
 *
 * Staging buffers are anonymous memory with transparent huge pages, touched by their worker
 * and registered with the driver: that is faster to set up than cuMemHostAlloc (measured on
 * an H200 host: 4 GiB registered in 0.07 s after a 0.1 s parallel touch, against 1.6 s for
 * cuMemHostAlloc), and it is unmapped once the move is over, so the process image stays as
 * small as it was.
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#include "fingerprint.h"

#define CHUNK (32UL << 20)  /* bytes a chunk: a write, a checksum */
#define SUB (1UL << 20)     /* written and summed this much at a time (stays in cache) */
#define MAX_FILES 16       /* sinks: files, or regions of the agent's memory */
#define REGION_ALIGN (2UL << 20)
#define FILE_ALIGN (4UL << 20) /* the image store's chunk (store.CHUNK_SIZE): see the top */
#define MAX_DEVICES 64
#define PARTS ((int)(CHUNK / FILE_ALIGN)) /* a chunk's parts: one a store chunk, summed one by one */

struct piece {
	size_t mv;       /* index into plan.mv */
	size_t off, len; /* inside the allocation */
	size_t at;       /* inside the chunk */
};

/* A part: FILE_ALIGN bytes of a chunk (the last one shorter), at a multiple of FILE_ALIGN in
 * its file: exactly the bytes of one chunk of the image store. */
struct part {
	uint64_t sum;          /* XXH3 of its bytes, as written (not for a skipped part) */
	XXH128_hash_t fp;      /* its GPU fingerprint (fingerprinted) */
	unsigned long long store_len; /* the store chunk it is: its bytes and the hole after */
	size_t seg, nseg;      /* its segments, into plan.segs */
	unsigned char fingerprinted, skip; /* skip: the store has it: neither copied nor written */
	unsigned char received; /* a streamed load: its bytes came (set once, atomically) */
};

struct chunk {
	int file;
	unsigned long long file_off;
	size_t len;
	struct part part[PARTS];
	size_t first, npieces; /* into plan.pieces */
	CUdevice dev;
	unsigned long long window; /* the device addresses it holds: [window, window + 1) * CHUNK */
};

/* One stretch of device memory inside a part (a part may span allocations). */
struct seg {
	CUdeviceptr ptr;
	size_t len, at; /* at: its offset in the chunk */
};

/* What was saved: kept from a save until its load succeeds. */
static struct {
	struct movable *mv;
	size_t nmv;
	struct piece *pieces;
	size_t npieces;
	struct chunk *chunks;
	size_t nchunks;
	int nfiles;
	unsigned long long bytes, file_size[MAX_FILES];
	size_t dev_first[MAX_DEVICES]; /* the first chunk of each device the chunks hold, in order */
	int ndevs;
	int pending;   /* saved and (some) dropped: a load is owed */
	int in_memory; /* the sinks are regions of the agent's memory, not files */
	unsigned char *region[MAX_FILES];
	size_t region_size[MAX_FILES];
	struct seg *segs; /* fingerprinted: the segments of every part */
	size_t nsegs;
	int fingerprinted; /* the parts have fingerprints (some may not: see part) */
} plan;

/* -- the stream: the image store's ring (agent/PROTOCOL.md, "Streaming") ----------------------
 * A save into the store, or a load out of it, goes through a ring of FILE_ALIGN slots in
 * memory torpor shares (a memfd) and one SOCK_SEQPACKET socket. Saving, a worker takes a free
 * slot (torpor sends its number), copies a part into it from its staging buffer and sends a
 * record; torpor stores the part as a chunk and sends the slot back. Loading, torpor fills
 * slots from the store and sends their records; a worker copies the part into its staging
 * buffer, sends the slot back and copies the part to the GPU. Nothing but the ring holds the
 * data on the host, so the data files stay holes. The socket, not a pipe: a torpor that went
 * away is EOF or EPIPE (MSG_NOSIGNAL), never a SIGPIPE in the program. */

struct stream_rec {
	uint32_t slot, file;
	uint64_t offset, length, store_len;
};

#define STREAM_END 0xFFFFFFFFu /* a record: no more parts (save); a slot number: commit */
#define STREAM_MAX_SLOTS 4096

static struct {
	int sock;              /* -1: no stream */
	unsigned char *ring;
	size_t nslots;
	long long timeout_ms;  /* waiting for torpor */
} stream = { -1, NULL, 0, 600000 };

static int stream_open(int ring_fd, int sock_fd, char *err, size_t errsize)
{
	struct stat st;
	int type = 0;
	socklen_t len = sizeof(type);
	void *p;

	if (fstat(ring_fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
	    st.st_size % FILE_ALIGN || st.st_size / FILE_ALIGN > STREAM_MAX_SLOTS) {
		snprintf(err, errsize, "the stream's ring is not a file of 1 to %d slots of %lu "
			 "bytes", STREAM_MAX_SLOTS, FILE_ALIGN);
		return -1;
	}
	if (getsockopt(sock_fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0 || type != SOCK_SEQPACKET) {
		snprintf(err, errsize, "the stream's socket is not a SOCK_SEQPACKET socket");
		return -1;
	}
	p = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
	if (p == MAP_FAILED) {
		snprintf(err, errsize, "mapping the stream's ring: %s", strerror(errno));
		return -1;
	}
	madvise(p, st.st_size, MADV_DONTFORK);
	stream.ring = p;
	stream.nslots = st.st_size / FILE_ALIGN;
	stream.sock = sock_fd;
	return 0;
}

static void stream_close(void)
{
	if (stream.ring)
		munmap(stream.ring, stream.nslots * FILE_ALIGN);
	stream.ring = NULL;
	stream.nslots = 0;
	stream.sock = -1; /* the fd is the command's: control.c closes it */
}

void mover_stream_timeout(long long ms)
{
	stream.timeout_ms = ms > 0 ? ms : 1;
}

static volatile int failed; /* any worker failed: the others stop */

/* One message from torpor into buf (exactly size bytes): 1, 0 at EOF (torpor is done, or
 * gone), -1 with err, -2 when a mover thread failed (it says why). Several threads may wait
 * on the socket: whoever reads a message has it, the others wait on. Gives up after the
 * timeout. */
static int stream_recv(void *buf, size_t size, char *err, size_t errsize)
{
	long long deadline = now_ms() + stream.timeout_ms;

	for (;;) {
		struct pollfd pfd = { stream.sock, POLLIN, 0 };
		ssize_t n;

		if (failed)
			return -2; /* that thread says why */
		if (now_ms() > deadline) {
			snprintf(err, errsize, "torpor's image store sent nothing for %lld s",
				 stream.timeout_ms / 1000);
			return -1;
		}
		if (poll(&pfd, 1, 200) < 0 && errno != EINTR) {
			snprintf(err, errsize, "waiting for the image store: %s", strerror(errno));
			return -1;
		}
		n = recv(stream.sock, buf, size, MSG_DONTWAIT | MSG_TRUNC);
		if (n == (ssize_t)size)
			return 1;
		if (n == 0)
			return 0;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
			continue;
		snprintf(err, errsize, "the image store's stream: %s",
			 n < 0 ? strerror(errno) : "a message of the wrong size");
		return -1;
	}
}

static int stream_send(const void *buf, size_t size, char *err, size_t errsize)
{
	for (;;) {
		ssize_t n = send(stream.sock, buf, size, MSG_NOSIGNAL);

		if (n == (ssize_t)size)
			return 0;
		if (n < 0 && errno == EINTR)
			continue;
		snprintf(err, errsize, "the image store's stream: %s",
			 n < 0 ? (errno == EPIPE || errno == ECONNRESET ? "torpor went away"
								   : strerror(errno))
			       : "short send");
		return -1;
	}
}

/* -- the checksum: XXH3, 64 bits (libxxhash, header-only: nothing to link) --------------------
 * Every chunk is summed on its way out and checked on its way back, by the worker that moves
 * it, block by block while the block is in cache. XXH3 runs at 11-12 GB/s a thread where the
 * hand-written xxHash64 round used before ran at 5 (measured on a 2-core Xeon VM, 1 MiB
 * blocks): at 16 workers moving 17 GB that was 0.2 s of every save and every load. */

struct sum {
	XXH3_state_t st;
};

static void sum_init(struct sum *s)
{
	XXH3_64bits_reset(&s->st);
}

static void sum_add(struct sum *s, const void *data, size_t len)
{
	XXH3_64bits_update(&s->st, data, len);
}

static uint64_t sum_end(const struct sum *s)
{
	return XXH3_64bits_digest(&s->st);
}

/* -- the plan ----------------------------------------------------------------------------------- */

struct unmap_job {
	unsigned char *region[MAX_FILES];
	size_t size[MAX_FILES];
};

static void unmap_all(struct unmap_job *j)
{
	for (int k = 0; k < MAX_FILES; k++)
		if (j->region[k])
			munmap(j->region[k], j->size[k]);
}

static void *unmap_main(void *arg)
{
	unmap_all(arg);
	free(arg);
	return NULL;
}

/* The regions go in a thread of their own: giving back tens of GB of pages takes seconds
 * (1.8 s for 68 GB measured on the H200 host), and the program may run meanwhile. */
static void regions_free(void)
{
	struct unmap_job *j = calloc(1, sizeof(*j));
	pthread_attr_t attr;
	pthread_t t;
	sigset_t all, old;
	int any = 0, started = 0;

	for (int k = 0; k < MAX_FILES; k++) {
		any |= plan.region[k] != NULL;
		if (j) {
			j->region[k] = plan.region[k];
			j->size[k] = plan.region_size[k];
		} else if (plan.region[k]) {
			munmap(plan.region[k], plan.region_size[k]);
		}
		plan.region[k] = NULL;
	}
	if (!j)
		return;
	if (any) {
		sigfillset(&all);
		pthread_sigmask(SIG_SETMASK, &all, &old); /* none of the program's handlers runs there */
		pthread_attr_init(&attr);
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		started = pthread_create(&t, &attr, unmap_main, j) == 0;
		pthread_attr_destroy(&attr);
		pthread_sigmask(SIG_SETMASK, &old, NULL);
	}
	if (!started) {
		unmap_all(j);
		free(j);
	}
}

static void plan_free(void)
{
	regions_free();
	free(plan.mv);
	free(plan.pieces);
	free(plan.chunks);
	free(plan.segs);
	memset(&plan, 0, sizeof(plan));
}

static int by_device(const void *a, const void *b)
{
	const struct movable *x = a, *y = b;

	return x->dev != y->dev ? (x->dev < y->dev ? -1 : 1) : (x->src < y->src ? -1 : x->src > y->src);
}

static double seconds_since(long long t0)
{
	return (now_ms() - t0) / 1000.0;
}

static size_t round_up(size_t n, size_t to)
{
	return (n + to - 1) / to * to;
}

/* Pieces packed into chunks, one a CHUNK-aligned window of one device's addresses; chunk j to
 * file j % nfiles, at an offset aligned to `align` (files: FILE_ALIGN, regions: 1). */
static int plan_build(int nfiles, size_t align)
{
	size_t cap_p, cap_c;
	unsigned long long off[MAX_FILES] = { 0 };

	plan.mv = vmm_movables(&plan.nmv, &plan.bytes);
	if (!plan.mv && plan.nmv)
		return -ENOMEM;
	qsort(plan.mv, plan.nmv, sizeof(*plan.mv), by_device);
	/* a chunk per window an allocation touches: its whole windows, and one at either end */
	cap_c = plan.bytes / CHUNK + 2 * plan.nmv + 1;
	cap_p = cap_c + plan.nmv;
	plan.chunks = calloc(cap_c, sizeof(*plan.chunks));
	plan.pieces = calloc(cap_p, sizeof(*plan.pieces));
	if (!plan.chunks || !plan.pieces)
		return -ENOMEM;
	plan.nfiles = nfiles;
	for (size_t m = 0; m < plan.nmv; m++) {
		for (size_t done = 0; done < plan.mv[m].size;) {
			struct chunk *c = plan.nchunks ? &plan.chunks[plan.nchunks - 1] : NULL;
			CUdeviceptr at = plan.mv[m].src + done;
			size_t len = plan.mv[m].size - done, room = CHUNK - at % CHUNK;

			if (!c || c->dev != plan.mv[m].dev || c->window != at / CHUNK) {
				if (plan.nchunks == cap_c || plan.npieces == cap_p)
					return -ENOMEM; /* cannot happen: sized above */
				c = &plan.chunks[plan.nchunks];
				c->file = plan.nchunks % nfiles;
				c->first = plan.npieces;
				c->dev = plan.mv[m].dev;
				c->window = at / CHUNK;
				plan.nchunks++;
			}
			if (plan.npieces == cap_p)
				return -ENOMEM;
			if (len > room)
				len = room;
			plan.pieces[plan.npieces++] = (struct piece){ m, done, len, c->len };
			c->npieces++;
			c->len += len;
			done += len;
		}
	}
	for (size_t j = 0; j < plan.nchunks; j++) {
		struct chunk *c = &plan.chunks[j];

		c->file_off = round_up(off[c->file], align);
		off[c->file] = c->file_off + c->len;
		if ((j == 0 || c->dev != plan.chunks[j - 1].dev) && plan.ndevs < MAX_DEVICES)
			plan.dev_first[plan.ndevs++] = j;
	}
	memcpy(plan.file_size, off, sizeof(off));
	return 0;
}

/* -- fingerprints ----------------------------------------------------------------------------
 * With an index file (prepare ... fp), every part gets a fingerprint on the GPU before anything
 * moves (fingerprint.h), and a part whose fingerprint torpor named as known (the image store
 * holds that chunk) is neither copied nor written: its bytes in the file stay a hole, which
 * torpor fills from the store before the data is read back (a restore, or a rollback). The
 * index lists every fingerprinted part; a reload checks each fingerprint again on the GPU,
 * which is how the parts the store supplied are verified. */

static size_t part_len(const struct chunk *c, int q)
{
	size_t start = (size_t)q * FILE_ALIGN;

	if (start >= c->len)
		return 0;
	return c->len - start < FILE_ALIGN ? c->len - start : FILE_ALIGN;
}

/* The store chunk part q of c is: its bytes and the hole after them, up to the next part's
 * offset or the end of the file. */
static unsigned long long part_store_len(const struct chunk *c, int q)
{
	unsigned long long at = c->file_off + (unsigned long long)q * FILE_ALIGN;

	return plan.file_size[c->file] - at < FILE_ALIGN ? plan.file_size[c->file] - at : FILE_ALIGN;
}

/* The segments of every part (pieces cut at part boundaries) and each part's store length. */
static int segs_build(void)
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

/* The GPU's lanes of every segment (FP_LANES * 2 each), device by device; NULL with err. */
static uint64_t *lanes_all(char *err, size_t errsize)
{
	uint64_t *lanes = malloc(plan.nsegs * FP_LANES * 2 * sizeof(uint64_t) + 1);
	struct fp_seg *table = malloc(plan.nsegs * sizeof(*table) + 1);
	size_t j = 0;

	if (!lanes || !table) {
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
		if (fp_run(table + from, to - from, lanes + from * FP_LANES * 2, err, errsize))
			goto fail;
	}
	free(table);
	return lanes;
fail:
	free(table);
	free(lanes);
	return NULL;
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
static XXH128_hash_t part_fp_host(const struct chunk *c, int q, const unsigned char *buf)
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
static int known_read(int fd, XXH128_canonical_t **known, size_t *n, char *err, size_t errsize)
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

/* Fingerprints every part of the plan (a file save) on the GPU and marks the parts known
 * holds as skipped. Failing, no part is fingerprinted or skipped (all are copied): r->fp_error
 * says why. */
static void fingerprint_parts(const XXH128_canonical_t *known, size_t nknown,
			      struct move_result *r)
{
	long long t0 = now_ms();
	uint64_t *lanes;

	if (segs_build()) {
		snprintf(r->fp_error, sizeof(r->fp_error), "out of memory");
		return;
	}
	lanes = lanes_all(r->fp_error, sizeof(r->fp_error));
	if (!lanes) {
		pr_warn("no fingerprints, every chunk is copied: %s", r->fp_error);
		return;
	}
	for (size_t j = 0; j < plan.nchunks; j++) {
		struct chunk *c = &plan.chunks[j];

		for (int q = 0; q < PARTS; q++) {
			struct part *pt = &c->part[q];
			XXH128_canonical_t key;

			if (!part_readable(pt))
				continue;
			pt->fp = part_fp(c, q, lanes + pt->seg * FP_LANES * 2);
			pt->fingerprinted = 1;
			r->fp_parts++;
			XXH128_canonicalFromHash(&key, pt->fp);
			if (nknown && bsearch(&key, known, nknown, sizeof(key), by_bytes)) {
				pt->skip = 1;
				r->fp_skipped++;
				r->fp_skipped_bytes += part_len(c, q);
			}
		}
	}
	free(lanes);
	plan.fingerprinted = 1;
	r->fp_seconds = seconds_since(t0);
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
 * (skipped) are checked this way only. When the GPU cannot run the kernel now (full after the
 * re-creation, say), those are checked on the CPU from their files instead (fds; slower),
 * or, streamed, taken as torpor checked them (their sha256), rather than leaving the program
 * held at a closed gate. 0, or -1 with r->error. */
static int fingerprints_verify(const int *fds, struct move_result *r)
{
	size_t bad = 0, bad_skipped = 0, skipped = 0;
	unsigned char *buf = NULL;
	char err[160];
	uint64_t *lanes;
	int ret = 0;

	if (!plan.fingerprinted)
		return 0;
	for (size_t j = 0; j < plan.nchunks; j++)
		for (int q = 0; q < PARTS; q++)
			skipped += plan.chunks[j].part[q].skip;
	lanes = lanes_all(err, sizeof(err));
	if (!lanes) {
		if (!skipped) { /* every part was written, and its sum checked */
			pr_warn("fingerprints not checked: %s", err);
			return 0;
		}
		if (stream.sock >= 0) { /* no files to read them back from */
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

			if (!c->part[q].fingerprinted || (!lanes && !c->part[q].skip))
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
		snprintf(r->error, sizeof(r->error), "%zu reloaded chunk(s) do not match their "
			 "fingerprints (%zu of them supplied by the image store: %s)", bad, bad_skipped,
			 bad_skipped ? "the data files' holes were not filled from the store, or with "
				       "other data" : "none");
		ret = -1;
	}
	return ret;
}

/* The index torpor reads (agent/PROTOCOL.md): one line a fingerprinted part. */
static int index_write(int fd, char *err, size_t errsize)
{
	size_t cap = 64 + plan.nchunks * PARTS * 96, used = 0;
	char *text = malloc(cap);
	int ret = 0;

	if (!text) {
		snprintf(err, errsize, "out of memory");
		return -1;
	}
	used += snprintf(text, cap, "torpor-gpu-fingerprints 1\n");
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
			used += snprintf(text + used, cap - used, " %d\n", pt->skip);
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

/* -- the workers ------------------------------------------------------------------------------ */

struct worker {
	pthread_t thread;
	int k, fd, saving; /* fd: -1 for a region of the agent's memory */
	unsigned char *buf[2];
	size_t buf_size;
	int registered;
	unsigned char *region; /* fd -1: the sink, in the agent's memory */
	long long populate_ms, staging_ms;
	CUstream stream[MAX_DEVICES][2];
	CUcontext current;
	unsigned long long bytes;
	char error[200];
};

static pthread_mutex_t err_lock = PTHREAD_MUTEX_INITIALIZER;

static void fail(struct worker *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(struct worker *w, const char *fmt, ...)
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

static int use_device(struct worker *w, CUdevice dev, CUstream *s)
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
	for (int i = 0; i < 2; i++) {
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

static int staging_get(struct worker *w)
{
	size_t size = 2 * CHUNK;
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CUresult rc;

	if (p == MAP_FAILED) {
		fail(w, "staging memory (%zu MiB): %s", size >> 20, strerror(errno));
		return -1;
	}
	madvise(p, size, MADV_HUGEPAGE);
	memset(p, 0, size); /* faulted in by this thread, in parallel with the others */
	w->buf[0] = p;
	w->buf[1] = (unsigned char *)p + CHUNK;
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
	w->buf[0] = w->buf[1] = NULL;
	w->registered = 0;
	for (int d = 0; d < MAX_DEVICES; d++)
		for (int i = 0; i < 2; i++)
			if (w->stream[d][i]) {
				real.cuStreamDestroy_v2(w->stream[d][i]);
				w->stream[d][i] = NULL;
			}
}

static int copy_range(struct worker *w, unsigned char *host, CUdeviceptr dev, size_t len,
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

/* Every piece of chunk c between buf and the GPU; out of the GPU, the stretches in skipped
 * parts stay behind (the store has them). */
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
			if (out && c->part[a / FILE_ALIGN].skip) {
				if (a > run && copy_range(w, buf + run, dev + (run - p->at), a - run, s, out))
					return -1;
				run = end;
			}
			a = end;
		}
		if (p->at + p->len > run &&
		    copy_range(w, buf + run, dev + (run - p->at), p->at + p->len - run, s, out))
			return -1;
	}
	return 0;
}

/* TORPOR_AGENT_FP_CHECK: the GPU's fingerprint of every part copied out against the CPU's,
 * from the bytes that arrived (what the GPU tests run with). */
static int fp_check(struct worker *w, const struct chunk *c, const unsigned char *buf)
{
	for (int q = 0; q < PARTS; q++)
		if (c->part[q].fingerprinted && !c->part[q].skip &&
		    !XXH128_isEqual(part_fp_host(c, q, buf), c->part[q].fp)) {
			fail(w, "fingerprint check: the GPU's fingerprint of %zu bytes at file %d "
			     "offset %llu differs from the CPU's", part_len(c, q), c->file,
			     c->file_off + (unsigned long long)q * FILE_ALIGN);
			return -1;
		}
	return 0;
}

static int wait_stream(struct worker *w, CUstream s)
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

	if (!p) {
		p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
			 -1, 0);
		if (p == MAP_FAILED) {
			fail(w, "host memory for %zu MiB of GPU data: %s", size >> 20, strerror(errno));
			return -1;
		}
		/* No MADV_HUGEPAGE: on the H200 host the copy out was no faster with it (5.5 s
		 * against 5.0 s for 17.4 GB), and with THP defrag "madvise" every huge-page fault
		 * of such a region may stall in direct compaction. */
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
		for (int i = 0; i < 2; i++)
			if (w->stream[d][i] && real.cuStreamSynchronize(w->stream[d][i]) != CUDA_SUCCESS &&
			    !failed)
				fail(w, "cuStreamSynchronize after the %s failed",
				     w->saving ? "copy out" : "reload");
}

/* One part of chunk c from buf into a slot of the stream's ring, summed on the way, and its
 * record to torpor (a save into the image store). */
static int part_stream(struct worker *w, const struct chunk *c, const unsigned char *buf, int q,
		       uint64_t *sum)
{
	size_t first = (size_t)q * FILE_ALIGN, last = first + part_len(c, q);
	struct stream_rec rec = { 0, (uint32_t)c->file, c->file_off + first, last - first,
				  part_store_len(c, q) };
	unsigned char *slot;
	uint32_t free_slot;
	struct sum s;
	char err[160];
	int rc = stream_recv(&free_slot, sizeof(free_slot), err, sizeof(err));

	if (rc == -2)
		return -1;
	if (rc <= 0 || free_slot >= stream.nslots) {
		fail(w, "%s", rc < 0 ? err : rc == 0 ? "the image store stopped taking GPU data"
						       : "the image store sent a bad slot");
		return -1;
	}
	rec.slot = free_slot;
	slot = stream.ring + (size_t)free_slot * FILE_ALIGN;
	sum_init(&s);
	for (size_t block = first; block < last; block += SUB) {
		size_t n = last - block < SUB ? last - block : SUB;

		sum_add(&s, buf + block, n);
		memcpy(slot + (block - first), buf + block, n); /* the block is still in cache */
	}
	*sum = sum_end(&s);
	if (stream_send(&rec, sizeof(rec), err, sizeof(err))) {
		fail(w, "%s", err);
		return -1;
	}
	return 0;
}

/* One part of chunk c between buf and the sink (file_io) */
static int part_io(struct worker *w, const struct chunk *c, unsigned char *buf, int q,
		   uint64_t *sum)
{
	size_t first = (size_t)q * FILE_ALIGN, last = first + part_len(c, q);
	struct sum s;

	if (w->saving && stream.sock >= 0)
		return part_stream(w, c, buf, q, sum);
	sum_init(&s);
	for (size_t block = first; block < last; block += SUB) {
		size_t n = last - block < SUB ? last - block : SUB;

		if (w->saving)
			sum_add(&s, buf + block, n);
		if (w->region) { /* the agent's memory: the block is still in cache */
			unsigned char *at = w->region + c->file_off + block;

			w->saving ? memcpy(at, buf + block, n) : memcpy(buf + block, at, n);
			if (!w->saving)
				sum_add(&s, buf + block, n);
			continue;
		}
		for (size_t done = 0; done < n;) {
			ssize_t r = w->saving ? pwrite(w->fd, buf + block + done, n - done,
						       c->file_off + block + done)
					      : pread(w->fd, buf + block + done, n - done,
						      c->file_off + block + done);

			if (r < 0 && errno == EINTR)
				continue;
			if (r < 0) {
				fail(w, "%s data file %d: %s", w->saving ? "writing" : "reading",
				     w->k, strerror(errno));
				return -1;
			}
			if (r == 0) {
				fail(w, "data file %d ends at %llu: it is not the file this data was "
				     "saved to", w->k, c->file_off + block + done);
				return -1;
			}
			done += r;
		}
		if (!w->saving)
			sum_add(&s, buf + block, n);
	}
	*sum = sum_end(&s);
	return 0;
}


/* Writes (saving) or reads one chunk's bytes between buf and the sink, part by part and SUB
 * at a time in a part (each block summed whole: the checksum's stripes must fall the same way
 * on both sides), and returns each part's checksum in sums. Saving, skipped parts are not
 * written (nor summed). */
static int file_io(struct worker *w, const struct chunk *c, unsigned char *buf, uint64_t *sums)
{
	for (int q = 0; q < PARTS && (size_t)q * FILE_ALIGN < c->len; q++) {
		if (w->saving && c->part[q].skip)
			continue;
		if (part_io(w, c, buf, q, &sums[q]))
			return -1;
	}
	return 0;
}

static int fp_checking; /* TORPOR_AGENT_FP_CHECK, read at each save */

/* The bytes of c a save moves: all but its skipped parts'. */
static size_t moved_len(const struct chunk *c)
{
	size_t n = c->len;

	for (int q = 0; q < PARTS; q++)
		n -= c->part[q].skip ? part_len(c, q) : 0;
	return n;
}

/* The previous chunk is in its buffer: checked (fp_check), written, summed. */
static int save_one(struct worker *w, struct chunk *c, const unsigned char *buf)
{
	uint64_t sums[PARTS] = { 0 };

	if ((fp_checking && fp_check(w, c, buf)) || file_io(w, c, (unsigned char *)buf, sums))
		return -1;
	for (int q = 0; q < PARTS; q++)
		c->part[q].sum = sums[q];
	w->bytes += moved_len(c);
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

/* Copies chunk after chunk into the two buffers in turn; the previous chunk is written while
 * the next one copies. */
static void *save_main(struct worker *w)
{
	struct chunk *prev = NULL;
	CUstream prev_s = NULL;
	int cur = 0;

	for (size_t i = 0, n = worker_count(w->k); i < n && !failed; i++) {
		struct chunk *c = &plan.chunks[worker_chunk(w->k, i)];
		CUstream s[2];

		if (use_device(w, c->dev, s) || copy_chunk(w, c, w->buf[cur], s[cur], 1))
			return NULL;
		if (prev && (wait_stream(w, prev_s) || save_one(w, prev, w->buf[cur ^ 1])))
			return NULL;
		prev = c;
		prev_s = s[cur];
		cur ^= 1;
	}
	if (prev && !failed && !wait_stream(w, prev_s))
		save_one(w, prev, w->buf[cur ^ 1]);
	return NULL;
}

static void *load_main(struct worker *w)
{
	CUstream s[2];
	int cur = 0;

	for (size_t i = 0, n = worker_count(w->k); i < n && !failed; i++) {
		size_t j = worker_chunk(w->k, i);
		struct chunk *c = &plan.chunks[j];
		uint64_t sums[PARTS] = { 0 };
		int q;

		if (use_device(w, c->dev, s))
			break;
		/* the copy that used this buffer two chunks ago must be over */
		if (wait_stream(w, s[cur]) || file_io(w, c, w->buf[cur], sums))
			break;
		for (q = 0; q < PARTS; q++) /* skipped parts: their fingerprints, after the load */
			if (!c->part[q].skip && part_len(c, q) && sums[q] != c->part[q].sum)
				break;
		if (q < PARTS) {
			fail(w, "chunk %zu (%s %d, offset %llu, %zu bytes): checksum mismatch: %s", j,
			     w->region ? "memory region" : "file", c->file,
			     c->file_off + (unsigned long long)q * FILE_ALIGN, part_len(c, q),
			     w->region ? "the program overwrote its saved GPU data"
				       : "the file is damaged or not this program's");
			break;
		}
		if (copy_chunk(w, c, w->buf[cur], s[cur], 0))
			break;
		w->bytes += c->len;
		cur ^= 1;
	}
	return NULL;
}

/* The chunk and part a streamed record names, or NULL: chunks of file f are f, f + nfiles,
 * ... at rising offsets. */
static struct chunk *chunk_of(const struct stream_rec *rec, int *q)
{
	size_t lo = 0, hi;

	if (rec->file >= (uint32_t)plan.nfiles || rec->offset % FILE_ALIGN)
		return NULL;
	hi = (plan.nchunks + plan.nfiles - 1 - rec->file) / plan.nfiles; /* the file's chunks */
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		struct chunk *c = &plan.chunks[rec->file + mid * plan.nfiles];

		if (rec->offset < c->file_off) {
			hi = mid;
		} else if (rec->offset >= c->file_off + c->len) {
			lo = mid + 1;
		} else {
			/* the store chunk whole (the part, then its hole), or the part alone */
			*q = (int)((rec->offset - c->file_off) / FILE_ALIGN);
			return rec->length >= part_len(c, *q) && rec->length <= rec->store_len &&
				       rec->store_len == part_store_len(c, *q) ? c : NULL;
		}
	}
	return NULL;
}

/* A streamed load: parts come from torpor in any order, each into the half of the staging
 * buffer the GPU is done with, checked, its slot sent back, then its segments copied to the
 * GPU. Ends at EOF (torpor sent every part). */
static void *load_stream_main(struct worker *w)
{
	CUstream used[2] = { NULL, NULL }, s[2];
	int cur = 0;
	char err[160];

	for (;;) {
		struct stream_rec rec;
		struct chunk *c;
		struct part *pt;
		unsigned char *slot, *at;
		struct sum sum;
		size_t len;
		int q = 0, rc = stream_recv(&rec, sizeof(rec), err, sizeof(err));

		if (rc <= 0) {
			if (rc == -1)
				fail(w, "%s", err);
			break;
		}
		c = rec.slot < stream.nslots ? chunk_of(&rec, &q) : NULL;
		if (!c) {
			fail(w, "the image store sent a part that is not this program's (file %u, "
			     "offset %llu, %llu bytes, slot %u)", rec.file,
			     (unsigned long long)rec.offset, (unsigned long long)rec.length, rec.slot);
			break;
		}
		pt = &c->part[q];
		if (__atomic_exchange_n(&pt->received, 1, __ATOMIC_RELAXED)) {
			fail(w, "the image store sent the part at file %u offset %llu twice", rec.file,
			     (unsigned long long)rec.offset);
			break;
		}
		if (use_device(w, c->dev, s) || (used[cur] && wait_stream(w, used[cur])))
			break;
		slot = stream.ring + (size_t)rec.slot * FILE_ALIGN;
		at = w->buf[cur] + (size_t)q * FILE_ALIGN; /* the part where it is in its chunk */
		len = part_len(c, q);
		sum_init(&sum);
		for (size_t block = 0; block < len; block += SUB) {
			size_t n = len - block < SUB ? len - block : SUB;

			memcpy(at + block, slot + block, n);
			sum_add(&sum, at + block, n);
		}
		if (stream_send(&rec.slot, sizeof(rec.slot), err, sizeof(err))) {
			fail(w, "%s", err);
			break;
		}
		/* skipped parts have no sum: their fingerprints are checked after the load */
		if (!pt->skip && sum_end(&sum) != pt->sum) {
			fail(w, "the part at file %u offset %llu (%zu bytes) from the image store does "
			     "not match its checksum", rec.file, (unsigned long long)rec.offset, len);
			break;
		}
		for (size_t k = 0; k < pt->nseg; k++) {
			const struct seg *g = &plan.segs[pt->seg + k];

			if (copy_range(w, w->buf[cur] + g->at, g->ptr, g->len, s[cur], 0))
				return NULL;
		}
		used[cur] = s[cur];
		w->bytes += len;
		cur ^= 1;
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
	CUstream s[2];
	int ready = 0, active = (size_t)w->k < plan.nchunks; /* fewer chunks than sinks */
	long long t0 = now_ms();

	gate_agent_thread();
	/* a context current before the staging memory is registered (CUDA_ERROR_INVALID_CONTEXT
	 * otherwise: this thread is new) */
	if (active) {
		int dev = plan.chunks[worker_chunk(w->k, 0)].dev;

		pr_debug("mover %d: %zu chunks, from device %d's", w->k, worker_count(w->k), dev);
		if (use_device(w, dev, s) == 0)
			ready = staging_get(w) == 0;
	}
	w->staging_ms = now_ms() - t0;
	if (plan.in_memory)
		pinned_wait();
	if (ready && (!plan.in_memory || region_get(w) == 0))
		w->saving ? save_main(w) : stream.sock >= 0 ? load_stream_main(w) : load_main(w);
	if (active)
		sync_streams(w); /* nothing in flight once the staging memory goes */
	staging_put(w);
	return NULL;
}

/* Runs one worker a sink (fds: NULL for the agent's memory); 0, or -1 with the first error in
 * r->error. */
static int run_workers(const int *fds, int nfds, int saving, struct move_result *r)
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

int mover_pending(void)
{
	return plan.pending;
}

/* Workers for a save into the agent's memory: one a CPU the program may run on, at most
 * MAX_FILES. */
static int memory_sinks(void)
{
	cpu_set_t set;
	int n = 0;

	if (sched_getaffinity(0, sizeof(set), &set) == 0)
		n = CPU_COUNT(&set);
	if (n < 1)
		n = (int)sysconf(_SC_NPROCESSORS_ONLN);
	return n < 1 ? 1 : n > MAX_FILES ? MAX_FILES : n;
}

/* The end of a streamed save: torpor is told every part is out, and answers once it has
 * made them durable in the store (it sends STREAM_END; the slots it frees meanwhile are
 * ignored). Until then nothing may be released. */
static int stream_commit(struct move_result *r)
{
	struct stream_rec end = { STREAM_END, 0, 0, 0, 0 };
	char err[160];

	if (stream_send(&end, sizeof(end), err, sizeof(err))) {
		snprintf(r->error, sizeof(r->error), "%s", err);
		return -1;
	}
	for (;;) {
		uint32_t v;
		int rc = stream_recv(&v, sizeof(v), err, sizeof(err));

		if (rc == 1 && v == STREAM_END)
			return 0;
		if (rc == 1 && v < stream.nslots)
			continue;
		snprintf(r->error, sizeof(r->error), "the image store did not take the GPU data: %s",
			 rc == 1 ? "a bad answer" : rc == 0 ? "torpor closed the stream" : err);
		return -1;
	}
}

int mover_save(const int *fds, int nfds, int known_fd, int index_fd, int ring_fd, int sock_fd,
	       struct move_result *r)
{
	long long t0 = now_ms(), t1;
	size_t dropped = 0, nknown = 0;
	XXH128_canonical_t *known = NULL;
	int ret, in_memory = nfds == 0;
	const char *check = getenv("TORPOR_AGENT_FP_CHECK");

	memset(r, 0, sizeof(*r));
	if (plan.pending) {
		snprintf(r->error, sizeof(r->error), "already prepared");
		return -1;
	}
	if (nfds < 0 || nfds > MAX_FILES) {
		snprintf(r->error, sizeof(r->error), "give 0 to %d data files", MAX_FILES);
		return -1;
	}
	for (int k = 0; k < nfds; k++) {
		struct stat st;

		if (fstat(fds[k], &st) < 0 || !S_ISREG(st.st_mode)) {
			snprintf(r->error, sizeof(r->error), "data file %d is not a regular file", k);
			return -1;
		}
	}
	if (index_fd >= 0 && in_memory) {
		snprintf(r->error, sizeof(r->error), "fingerprints are for data files only");
		return -1;
	}
	if (ring_fd >= 0 && (in_memory || index_fd < 0)) {
		snprintf(r->error, sizeof(r->error), "a stream into the image store needs the data "
			 "files and the fingerprints");
		return -1;
	}
	if (known_read(known_fd, &known, &nknown, r->error, sizeof(r->error)))
		return -1;
	if (ring_fd >= 0 && stream_open(ring_fd, sock_fd, r->error, sizeof(r->error))) {
		free(known);
		return -1;
	}
	plan_free();
	if (plan_build(in_memory ? memory_sinks() : nfds, in_memory ? 1 : FILE_ALIGN)) {
		plan_free();
		stream_close();
		free(known);
		snprintf(r->error, sizeof(r->error), "out of memory");
		return -1;
	}
	plan.in_memory = in_memory;
	fp_checking = check && *check && strcmp(check, "0");
	if (index_fd >= 0)
		fingerprint_parts(known, nknown, r);
	free(known);
	ret = plan.nchunks ? run_workers(in_memory ? NULL : fds, plan.nfiles, 1, r) : 0;
	/* a file ending in skipped parts (or a hole) still has its full size */
	for (int k = 0; !ret && !in_memory && k < nfds; k++)
		if (ftruncate(fds[k], plan.file_size[k]) < 0) {
			snprintf(r->error, sizeof(r->error), "sizing data file %d: %s", k,
				 strerror(errno));
			ret = -1;
		}
	/* the index before anything is released: without it the skipped parts are lost */
	if (!ret && index_fd >= 0)
		ret = index_write(index_fd, r->error, sizeof(r->error));
	/* streamed: nothing is released before the store has made the parts durable */
	if (!ret && stream.sock >= 0)
		ret = stream_commit(r);
	r->streamed = stream.sock >= 0;
	stream_close();
	if (ret) {
		plan_free(); /* the agent's regions too: nothing was released */
		return -1;
	}
	/* every byte is out: release the GPU memory */
	t1 = now_ms();
	for (size_t m = 0; m < plan.nmv; m++) {
		if (vmm_drop(plan.mv[m].phys) != CUDA_SUCCESS) {
			snprintf(r->error, sizeof(r->error), "releasing GPU memory failed after %zu of "
				 "%zu allocations", dropped, plan.nmv);
			plan.pending = 1; /* the caller reloads: the copy is complete */
			return -1;
		}
		dropped++;
	}
	plan.pending = 1;
	r->vmm_seconds = seconds_since(t1);
	r->chunks = plan.nchunks;
	r->allocations = plan.nmv;
	r->nfiles = in_memory ? 0 : nfds;
	r->in_memory = in_memory;
	if (!in_memory)
		memcpy(r->file_size, plan.file_size, sizeof(r->file_size));
	r->seconds = seconds_since(t0);
	pr_info("saved %llu bytes (%zu allocations, %zu chunks, %d %s) in %.3f s", r->bytes,
		plan.nmv, plan.nchunks, plan.nfiles, in_memory ? "regions of host memory" : "files",
		r->seconds);
	return 0;
}

int mover_in_memory(void)
{
	return plan.pending && plan.in_memory;
}

unsigned long long mover_host_bytes(void)
{
	unsigned long long n = 0;

	for (int k = 0; k < MAX_FILES; k++)
		n += plan.region[k] ? plan.region_size[k] : 0;
	return n;
}

static int mover_load_from(const int *fds, int nfds, struct move_result *r);

int mover_load(const int *fds, int nfds, int ring_fd, int sock_fd, struct move_result *r)
{
	long long t0 = now_ms();
	int ret;

	memset(r, 0, sizeof(*r));
	if (!plan.pending) {
		snprintf(r->error, sizeof(r->error), "nothing to resume");
		return -1;
	}
	if (ring_fd >= 0) {
		if (plan.in_memory || nfds) {
			snprintf(r->error, sizeof(r->error), "a stream from the image store replaces the "
				 "data files, and is for GPU data saved to files");
			return -1;
		}
		if (!plan.segs && segs_build()) {
			snprintf(r->error, sizeof(r->error), "out of memory");
			return -1;
		}
		if (stream_open(ring_fd, sock_fd, r->error, sizeof(r->error)))
			return -1;
		for (size_t j = 0; j < plan.nchunks; j++)
			for (int q = 0; q < PARTS; q++)
				plan.chunks[j].part[q].received = 0;
	} else if (plan.in_memory && nfds) {
		snprintf(r->error, sizeof(r->error), "the GPU data is in the agent's memory: resume "
			 "without files");
		return -1;
	}
	ret = mover_load_from(fds, nfds, r);
	r->streamed = stream.sock >= 0;
	stream_close();
	if (ret)
		return -1;
	r->seconds = seconds_since(t0);
	pr_info("reloaded %llu bytes%s in %.3f s", r->bytes,
		r->streamed ? " from the image store's stream" : "", r->seconds);
	plan_free();
	return 0;
}

/* Every part of every chunk came (a streamed load)? 0, or -1 with r->error. */
static int stream_complete(struct move_result *r)
{
	size_t missing = 0;

	for (size_t j = 0; j < plan.nchunks; j++)
		for (int q = 0; q < PARTS; q++)
			missing += part_len(&plan.chunks[j], q) && !plan.chunks[j].part[q].received;
	if (missing)
		snprintf(r->error, sizeof(r->error), "the image store's stream ended %zu part(s) "
			 "short", missing);
	return missing ? -1 : 0;
}

/* mover_load from files (fds), the agent's memory (none), or the open stream. */
static int mover_load_from(const int *fds, int nfds, struct move_result *r)
{
	long long t1;
	int streamed = stream.sock >= 0;

	if (!streamed && !plan.in_memory && nfds != plan.nfiles) {
		snprintf(r->error, sizeof(r->error), "%d data files given, %d were saved to", nfds,
			 plan.nfiles);
		return -1;
	}
	for (int k = 0; k < nfds; k++) {
		struct stat st;

		if (fstat(fds[k], &st) < 0 || !S_ISREG(st.st_mode) ||
		    (unsigned long long)st.st_size < plan.file_size[k]) {
			snprintf(r->error, sizeof(r->error), "data file %d is missing or shorter than "
				 "the %llu bytes saved to it", k, plan.file_size[k]);
			return -1;
		}
	}
	t1 = now_ms();
	for (size_t m = 0; m < plan.nmv; m++) {
		CUcontext ctx = track_context_of(plan.mv[m].dev);
		CUresult rc;

		if (ctx)
			real.cuCtxSetCurrent(ctx);
		rc = vmm_recreate(plan.mv[m].phys);
		if (rc != CUDA_SUCCESS) {
			snprintf(r->error, sizeof(r->error), "re-creating %zu bytes of GPU memory on "
				 "device %d: CUresult %d%s", plan.mv[m].size, plan.mv[m].dev, rc,
				 rc == CUDA_ERROR_OUT_OF_MEMORY ? " (out of memory: the GPU has no room)"
								: "");
			return -1;
		}
	}
	r->vmm_seconds = seconds_since(t1);
	if (plan.nchunks && run_workers(plan.in_memory || streamed ? NULL : fds, plan.nfiles, 0, r))
		return -1;
	if (streamed && stream_complete(r))
		return -1;
	if (fingerprints_verify(plan.in_memory || streamed ? NULL : fds, r))
		return -1;
	for (size_t m = 0; m < plan.nmv; m++)
		vmm_reloaded(plan.mv[m].phys);
	r->chunks = plan.nchunks;
	r->allocations = plan.nmv;
	r->nfiles = nfds;
	return 0;
}

/* The child of fork() has no GPU memory of its own to reload (CUDA does not survive fork):
 * it starts with nothing saved (the parent's tables are leaked, not freed: another thread may
 * have been using them). */
void mover_after_fork(void)
{
	memset(&plan, 0, sizeof(plan));
	pthread_mutex_init(&err_lock, NULL);
	pthread_mutex_init(&pinned.lock, NULL);
	pthread_cond_init(&pinned.cond, NULL);
}
