/* The mover's parts, private to the agent: the plan of a save (mover.c), the threads that copy
 * (mover_workers.c), the image store's ring (stream.c) and the parts' fingerprints
 * (fingerprint_parts.c), the zero parts (zeros.c). mover.c's top comment tells the whole story. Include after agent.h.
 */
#ifndef TORPOR_MOVER_H
#define TORPOR_MOVER_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#include "fingerprint.h"

#define CHUNK (32UL << 20)  /* bytes a chunk: a write, a checksum */
#define SUB (1UL << 20)     /* written and summed this much at a time (stays in cache) */
#define MAX_FILES 16       /* sinks: files, or regions of the agent's memory */
#define REGION_ALIGN (2UL << 20)
#define FILE_ALIGN (4UL << 20) /* the image store's chunk (store.CHUNK_SIZE): see mover.c's top */
#define MAX_DEVICES 64
#define PARTS ((int)(CHUNK / FILE_ALIGN)) /* a chunk's parts: one a store chunk, summed one by one */
#define MAX_BUFFERS 8      /* staging buffers (and streams) a worker, at most (mover_tune.c) */
#define HOST_PAGE 4096UL   /* what a registration of the sink is aligned to */

/* -- the mover's tuning (mover_tune.c): environment variables read once at the agent's start;
 * a bad value is ignored with a warning. The defaults are the mover as measured best so far. */

enum { DIRECT_OFF, DIRECT_CHUNK, DIRECT_WHOLE };

struct mover_tune {
	int buffers;     /* TORPOR_AGENT_MOVER_BUFFERS: pinned staging buffers (and streams) a
			  * worker, 2-8 (2): chunks in flight at once a worker */
	int workers;     /* TORPOR_AGENT_MOVER_WORKERS: workers of a save into the agent's memory,
			  * 1-16 (0: one a CPU); files: one a file, as torpor gives them */
	int direct;      /* TORPOR_AGENT_MOVER_SINK: staged (DIRECT_OFF), direct (each chunk's
			  * place in the sink registered and copied to straight), direct-whole
			  * (the whole sink registered once, MAP_POPULATE) */
	int gpu_check;   /* TORPOR_AGENT_MOVER_CHECK=gpu: no checksum on the host; every part is
			  * fingerprinted on the GPU before the copy and checked on the GPU after
			  * the reload (saves without an index or a stream only) */
	int region_huge; /* TORPOR_AGENT_MOVER_REGION_HUGE=1: the agent's memory regions with
			  * transparent huge pages (MADV_HUGEPAGE) */
	int presize;     /* TORPOR_AGENT_MOVER_PRESIZE=0: data files sized after they are
			  * written, not before (the mover before issue 20: measured against) */
	int stage_part;  /* TORPOR_AGENT_MOVER_STAGE=part (default): staging buffers a part
			  * (FILE_ALIGN) long, the copies a part at a time, not a chunk (staged
			  * sinks only: 0 with a direct one) */
	int write_part;  /* TORPOR_AGENT_MOVER_WRITE=part (default): a saved part goes to its
			  * file in one pwrite, not SUB at a time (block) */
};
extern struct mover_tune tune;

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
	unsigned char zero;     /* it read all zero on the GPU: neither copied nor written, and
				 * re-created by a memset (zeros.c) */
	unsigned long long sink_off; /* where its bytes are in its sink: in a file its place
				      * (a hole when zero or skipped); in the agent's memory the
				      * parts that move are packed, the zero ones take no room */
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

/* What was saved: kept from a save until its load succeeds (mover.c owns it). */
struct mover_plan {
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
	int zeros;         /* some parts are zero: a load memsets them (zeros_fill) */
	int gpu_check;     /* tune.gpu_check took: the fingerprinted parts have no host sums */
	int deferred;      /* defer.c: the files have no data until torpor's copier has run */
	/* held memory: the descriptor the save exported for each movable allocation (mv, in the
	 * order they were given out) and its file's identity, which the real driver's share (all
	 * /dev/nvidiactl): a load takes back only such a file, in that order, and keeps the
	 * memory only where every fingerprinted part matches (fingerprints_match) */
	struct held_id {
		size_t mv;
		dev_t dev;
		ino_t ino;
	} hold[HOLD_MAX];
	int nhold;
};
extern struct mover_plan plan;

/* -- the checksum: XXH3, 64 bits (libxxhash, header-only: nothing to link) --------------------
 * Every chunk is summed on its way out and checked on its way back, by the worker that moves
 * it, block by block while the block is in cache. XXH3 runs at 11-12 GB/s a thread where the
 * hand-written xxHash64 round used before ran at 5 (measured on a 2-core Xeon VM, 1 MiB
 * blocks): at 16 workers moving 17 GB that was 0.2 s of every save and every load. */

struct sum {
	XXH3_state_t st;
};

static inline void sum_init(struct sum *s)
{
	XXH3_64bits_reset(&s->st);
}

static inline void sum_add(struct sum *s, const void *data, size_t len)
{
	XXH3_64bits_update(&s->st, data, len);
}

static inline uint64_t sum_end(const struct sum *s)
{
	return XXH3_64bits_digest(&s->st);
}

/* Is part pt summed on the host (not when its fingerprint checks it on the GPU: gpu_check)? */
static inline int part_summed(const struct part *pt)
{
	return !(plan.gpu_check && pt->fingerprinted);
}

/* -- small helpers ---------------------------------------------------------------------------- */

static inline double seconds_since(long long t0)
{
	return (now_ms() - t0) / 1000.0;
}

static inline size_t round_up(size_t n, size_t to)
{
	return (n + to - 1) / to * to;
}

/* The bytes of part q of c (0: the chunk ends before it). */
static inline size_t part_len(const struct chunk *c, int q)
{
	size_t start = (size_t)q * FILE_ALIGN;

	if (start >= c->len)
		return 0;
	return c->len - start < FILE_ALIGN ? c->len - start : FILE_ALIGN;
}

/* The store chunk part q of c is: its bytes and the hole after them, up to the next part's
 * offset or the end of the file. */
static inline unsigned long long part_store_len(const struct chunk *c, int q)
{
	unsigned long long at = c->file_off + (unsigned long long)q * FILE_ALIGN;

	return plan.file_size[c->file] - at < FILE_ALIGN ? plan.file_size[c->file] - at : FILE_ALIGN;
}

/* -- held memory and the deferred copy (mover.c, defer.c) ------------------------------------- */

/* The host memory a save's sinks take: every part that is copied out. */
unsigned long long host_bytes_needed(void);
/* Every movable allocation exported to a descriptor (r->hold_fds, plan.hold), or none. */
void hold_export(struct move_result *r);
/* Closes r's held descriptors: nothing is held. */
void hold_close(struct move_result *r);
/* After the layout and the files sized: held, the copy's plan written to plan_fd, nothing
 * copied (0, r->deferred); or -1 with why in r->defer_error, nothing held, for a save that
 * copies as always. */
int defer_save(int plan_fd, int in_memory, int index_fd, int ring_fd, struct move_result *r);

/* -- the workers (mover_workers.c) ------------------------------------------------------------ */

struct worker {
	pthread_t thread;
	int k, fd, saving; /* fd: -1 for a region of the agent's memory */
	unsigned char *buf[MAX_BUFFERS]; /* tune.buffers of them (staged chunks) */
	size_t buf_size;
	int registered;
	unsigned char *region; /* fd -1: the sink, in the agent's memory */
	/* tune.direct: the sink mapped (the region, or the file mapped shared), registered whole
	 * (DIRECT_WHOLE) or chunk by chunk (reg: each slot's registration, NULL: none) */
	unsigned char *map;
	size_t map_size;
	int map_owned, map_registered, direct_failed;
	size_t direct_chunks, staged_chunks; /* how its chunks went (logged) */
	void *reg[MAX_BUFFERS];
	long long populate_ms, staging_ms;
	CUstream stream[MAX_DEVICES][MAX_BUFFERS];
	CUcontext current;
	unsigned long long bytes;
	int damaged; /* error: a data file read back is not what was saved to it */
	char error[200];
};

extern volatile int failed; /* any worker failed: the others stop */
extern int fp_checking;     /* TORPOR_AGENT_FP_CHECK, read at each save */

/* Runs one worker a sink (fds: NULL for the agent's memory); 0, or -1 with the first error in
 * r->error. */
int run_workers(const int *fds, int nfds, int saving, struct move_result *r);
void workers_after_fork(void);
/* For a worker: its error (the first one stops the others), its device's context and
 * tune.buffers streams (s: MAX_BUFFERS), a copy between host and GPU (out: to the host), the end of a stream's copies.
 * 0, or -1 once fail() said why. */
void fail(struct worker *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int use_device(struct worker *w, CUdevice dev, CUstream *s);
int copy_range(struct worker *w, unsigned char *host, CUdeviceptr dev, size_t len, CUstream s,
	       int out);
int wait_stream(struct worker *w, CUstream s);

/* -- straight between the GPU and the sink (mover_direct.c; tune.direct) ------------------------ */

/* After region_get: the sink mapped (and for direct-whole registered); a refusal leaves the
 * worker staged, with one warning. direct_close undoes it, with every slot's registration. */
void direct_open(struct worker *w);
void direct_close(struct worker *w);
/* Does chunk c go straight, in slot i (its span registered for direct, until direct_end)? */
int direct_begin(struct worker *w, const struct chunk *c, int i);
void direct_end(struct worker *w, int i);
/* The host sums of c's parts that move, read from the sink. */
void direct_sums(const struct worker *w, const struct chunk *c, uint64_t *sums);

/* -- the image store's ring (stream.c; agent/PROTOCOL.md, "Streaming") ----------------------- */

/* Maps the ring and takes the socket for one save or load; 0, or -1 with err. */
int stream_open(int ring_fd, int sock_fd, char *err, size_t errsize);
void stream_close(void);
/* Is a stream open (this save or load goes through the ring, not the files)? */
int stream_active(void);
/* A worker's side: one part of a saved chunk out through the ring (its sum in *sum), or every
 * part torpor sends in (a streamed load, until EOF). */
int part_stream(struct worker *w, const struct chunk *c, const unsigned char *buf, int q,
		uint64_t *sum);
void *load_stream_main(struct worker *w);
/* The end of a save (torpor made the parts durable) and of a load (every part came);
 * 0, or -1 with r->error. */
int stream_commit(struct move_result *r);
int stream_complete(struct move_result *r);

/* -- the parts' fingerprints (fingerprint_parts.c) ------------------------------------------- */

/* Does part q of c stay behind on a save (out) or a load? Zero parts never move; skipped ones
 * (the store has them) are not copied out, but are read back once torpor filled them. */
static inline int part_stays(const struct part *pt, int out)
{
	return pt->zero || (out && pt->skip);
}

/* The segments of every part (pieces cut at part boundaries) and each part's store length. */
int segs_build(void);
/* The sorted fingerprints torpor knows (fd -1: none); 0, or -1 with err. */
int known_read(int fd, XXH128_canonical_t **known, size_t *n, char *err, size_t errsize);
/* One pass of the kernel over every part: zeros (zeros: marks the parts that read all zero)
 * and fingerprints (fp: every part fingerprinted, those in known skipped); failing, none of
 * either, r->fp_error and r->zero_error say why. */
void fingerprint_parts(const XXH128_canonical_t *known, size_t nknown, int fp, int zeros,
		       struct move_result *r);

/* -- the zero parts (zeros.c) ----------------------------------------------------------------- */

/* Each part's place in its sink (part.sink_off), the sinks' sizes with it: after the scan. */
void sinks_layout(void);
/* A load's first step after the re-creation: every zero part memset on the GPU (async on a
 * stream a device, waited for). 0, or -1 with r->error. */
int zeros_fill(struct move_result *r);
/* The CPU's fingerprint of part q of c from its bytes in buf (TORPOR_AGENT_FP_CHECK). */
XXH128_hash_t part_fp_host(const struct chunk *c, int q, const unsigned char *buf);
/* After a reload: every fingerprint checked again; 0, or -1 with r->error. */
int fingerprints_verify(const int *fds, struct move_result *r);
/* Held memory taken back (hold_import): every fingerprinted part read on the GPU matches the
 * save's fingerprint. 0, or -1 with err (no kernel now, or a mismatch). */
int fingerprints_match(char *err, size_t errsize);
/* The index torpor reads: one line a fingerprinted part; 0, or -1 with err. */
int index_write(int fd, char *err, size_t errsize);

#endif
