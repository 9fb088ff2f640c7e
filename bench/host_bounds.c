/* bench/host_bounds.c: what this host lets the agent's mover reach, measured in one run.
 *
 * Issue 20 asks the mover for 40 GB/s into host memory; it reaches 32-37 GB/s on the H200 VM,
 * where pinned copies run at 55 GB/s. The mover copies each byte twice on the host: the GPU's
 * DMA into a pinned staging buffer, then the CPU from that buffer into the sink (a file on a
 * huge-page tmpfs, or the agent's own memory). The ways around the CPU copy (the GPU straight
 * into the sink) lose on cuMemHostRegister (bench/host_paths.c: 3-9 GB/s). This program
 * measures each of those limits alone and together, T threads at once, so that the mover's
 * rate can be set against the host's instead of against PCIe alone:
 *
 *   pcie        pinned copies, no CPU work: the limit the issue names.
 *   copy        the CPU copy alone, from a pinned 32 MiB buffer a thread into each sink;
 *               then the same while the GPU copies out at full rate into other pinned memory
 *               (under_dma: the two compete for memory bandwidth, as in the mover).
 *   staged      the mover's shape: two pinned buffers a thread, the GPU filling one while
 *               the CPU empties the other into the sink (out), or the reverse (in); for each
 *               sink and staging size.
 *   register    cuMemHostRegister of each kind of host memory (4 KiB pages, transparent
 *               huge pages, hugetlbfs pages, a tmpfs file's mapping), T threads and one;
 *               then the GPU straight into it: what a copy without staging would cost.
 *
 * Sinks: pwrite (1 MiB pwrites into a file sized first, as the mover writes its data files),
 * map (memcpy into the file's mapping, populated first), map-nt (the same with non-temporal
 * stores: no read of the destination before it is written), anon (memcpy into populated
 * anonymous memory with transparent huge pages: a suspend into the agent's memory).
 *
 * Everything runs --rounds times (a VM's memory is slower at first use). Driver API only,
 * loaded at run time with the agent's own declarations, so it builds without the toolkit
 * (and runs on tests/fakes' libcuda for a smoke test):
 *
 *   gcc -O2 -pthread bench/host_bounds.c -ldl -o /tmp/host_bounds
 *   /tmp/host_bounds --gib 16 --threads 16 --dir /dev/shm/torpor-bounds > results/x.json
 *
 * --dir should be a tmpfs mounted like torpor's suspend_dir (huge=within_size); the JSON's
 * "dir_huge" says which it was. stdout: JSON; stderr: a line a measurement.
 */
#define _GNU_SOURCE
#include "../agent/src/cuda_types.h"
#define BENCH_NAME "host_bounds"
#define BENCH_FAIL 1
#include "driver_loader.h"

#include <dlfcn.h>
#include <emmintrin.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MAP_HUGETLB
#define MAP_HUGETLB 0x40000
#endif

#define MIB (1UL << 20)
#define BLOCK MIB /* the mover's pwrite before 2026-12-05, its pread (agent/src/mover.h SUB) */
#define PART_BYTES (4 * MIB) /* the mover's pwrite since (a part, agent/src/mover.h FILE_ALIGN) */
#define MAX_THREADS 64

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*StreamCreate)(CUstream *, unsigned);
	CUresult (*StreamDestroy)(CUstream);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*DtoH)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*HtoD)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*HostRegister)(void *, size_t, unsigned);
	CUresult (*HostUnregister)(void *);
} cu;

static CUcontext ctx;
static CUdeviceptr dev;      /* total bytes: each thread's share, then the DMA load's */
static size_t total, share;  /* share: a thread's, a multiple of 2 MiB */
static size_t load_bytes;    /* the background DMA's device range, after the threads' */
static int nthreads, rounds = 2;
static const char *dir = "/dev/shm";
static double reg_gib = 4;
static int first_out = 1;

#define CK(x) ck((x), #x, __LINE__)

static void ck(CUresult rc, const char *what, int line)
{
	if (rc != CUDA_SUCCESS) {
		fprintf(stderr, "host_bounds.c:%d: %s: CUresult %d\n", line, what, rc);
		exit(1);
	}
}

static void die(const char *what)
{
	fprintf(stderr, "host_bounds: %s: %s\n", what, strerror(errno));
	exit(1);
}

static void load_driver(void)
{
	void *lib = driver_open();

	cu.Init = sym(lib, "cuInit");
	cu.DeviceGet = sym(lib, "cuDeviceGet");
	cu.PrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain");
	cu.CtxSetCurrent = sym(lib, "cuCtxSetCurrent");
	cu.MemAlloc = sym(lib, "cuMemAlloc_v2");
	cu.StreamCreate = sym(lib, "cuStreamCreate");
	cu.StreamDestroy = sym(lib, "cuStreamDestroy_v2");
	cu.StreamSynchronize = sym(lib, "cuStreamSynchronize");
	cu.DtoH = sym(lib, "cuMemcpyDtoHAsync_v2");
	cu.HtoD = sym(lib, "cuMemcpyHtoDAsync_v2");
	cu.HostRegister = sym(lib, "cuMemHostRegister_v2");
	cu.HostUnregister = sym(lib, "cuMemHostUnregister");
}

/* -- JSON out --------------------------------------------------------------------------------- */

static void out(const char *fmt, ...)
{
	va_list ap;

	printf("%s    {", first_out ? "" : ",\n");
	first_out = 0;
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("}");
	fflush(stdout);
}

/* -- host memory ------------------------------------------------------------------------------ */

enum kind { K4K, KTHP, KHUGETLB, KTMPFS, NKINDS };
static const char *kind_name[NKINDS] = { "anon-4k", "anon-thp", "hugetlb", "tmpfs-map" };

struct mem {
	void *p;
	size_t n;
	int fd;
	char path[256];
};

/* A file of n bytes in dir: sparse (sized only, as the mover sizes its data files), or
 * allocated (fallocate) and mapped with every page present */
static void file_get(struct mem *m, size_t n, int tag, int allocated, int mapped)
{
	snprintf(m->path, sizeof(m->path), "%s/host-bounds-%d-%d.bin", dir, getpid(), tag);
	m->fd = open(m->path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (m->fd < 0 || (allocated ? fallocate(m->fd, 0, 0, n) : ftruncate(m->fd, n)))
		die(m->path);
	if (!mapped)
		return;
	m->p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | (allocated ? MAP_POPULATE : 0),
		    m->fd, 0);
	if (m->p == MAP_FAILED)
		die("mmap of the tmpfs file");
}

/* n bytes of kind, every page present; 0, or -1 (hugetlb: no huge pages to be had) */
static int mem_get(struct mem *m, enum kind k, size_t n, int tag)
{
	int flags = MAP_PRIVATE | MAP_ANONYMOUS;

	memset(m, 0, sizeof(*m));
	m->n = n, m->fd = -1;
	if (k == KTMPFS) {
		file_get(m, n, tag, 1, 1);
		return 0;
	}
	if (k == KHUGETLB)
		flags |= MAP_HUGETLB;
	m->p = mmap(NULL, n, PROT_READ | PROT_WRITE, flags, -1, 0);
	if (m->p == MAP_FAILED) {
		if (k == KHUGETLB)
			return -1;
		die("mmap");
	}
	madvise(m->p, n, k == KTHP ? MADV_HUGEPAGE : k == K4K ? MADV_NOHUGEPAGE : 0);
	if (madvise(m->p, n, MADV_POPULATE_WRITE)) {
		if (k == KHUGETLB) { /* the pool ran short: SIGBUS on touch otherwise */
			munmap(m->p, n);
			return -1;
		}
		die("MADV_POPULATE_WRITE");
	}
	return 0;
}

static void mem_put(struct mem *m)
{
	if (m->p && m->p != MAP_FAILED)
		munmap(m->p, m->n);
	if (m->fd >= 0) {
		close(m->fd);
		unlink(m->path);
	}
	m->p = NULL, m->fd = -1;
}

/* a pinned buffer (registered transparent huge pages, as the mover's staging) */
static void *pinned(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		die("mmap");
	madvise(p, n, MADV_HUGEPAGE);
	memset(p, 0x5a, n);
	CK(cu.HostRegister(p, n, 0));
	return p;
}

static void unpin(void *p, size_t n)
{
	CK(cu.HostUnregister(p));
	munmap(p, n);
}

/* dst <- src with non-temporal stores (n a multiple of 64, both 16-byte aligned) */
static void copy_nt(void *dst, const void *src, size_t n)
{
	__m128i *d = dst;
	const __m128i *s = src;

	for (size_t i = 0; i < n / 16; i += 4) {
		__m128i a = _mm_load_si128(s + i), b = _mm_load_si128(s + i + 1);
		__m128i c = _mm_load_si128(s + i + 2), e = _mm_load_si128(s + i + 3);

		_mm_stream_si128(d + i, a);
		_mm_stream_si128(d + i + 1, b);
		_mm_stream_si128(d + i + 2, c);
		_mm_stream_si128(d + i + 3, e);
	}
	_mm_sfence();
}

/* -- sinks ------------------------------------------------------------------------------------ */

/* pwrite   1 MiB pwrites into a sparse file (the mover's data files before 2026-12-05: sized,
 *          then written; the kernel allocates each page as the write comes, and zeroes what
 *          a write leaves of a new huge page: shmem_write_end)
 * pwrite-whole  one pwrite a part (4 MiB, huge-page aligned): every new huge page written
 *          whole, nothing zeroed (the mover's TORPOR_AGENT_MOVER_WRITE=part); read back as
 *          pwrite
 * map      memcpy into a file's shared mapping, allocated and populated before the clock
 * map-nt   the same with non-temporal stores (no read of the destination before the write)
 * map-nt-fault  non-temporal stores into the mapping of a sparse file: each page is
 *          allocated (and zeroed) by a fault during the copy, as a mover writing through a
 *          mapping without a pool of pages would meet it
 * anon     memcpy into populated anonymous memory with transparent huge pages */
enum sink { SPWRITE, SPWRITEW, SMAP, SMAPNT, SNTFAULT, SANON, NSINKS };
static const char *sink_name[NSINKS] = { "pwrite", "pwrite-whole", "map", "map-nt",
					  "map-nt-fault", "anon" };

struct sinkmem {
	enum sink s;
	struct mem m;   /* map, map-nt, anon: the memory; pwrite: m.fd is the file */
};

static void sink_open(struct sinkmem *k, enum sink s, int tag)
{
	k->s = s;
	if (s == SANON) {
		mem_get(&k->m, KTHP, share, tag);
		return;
	}
	memset(&k->m, 0, sizeof(k->m));
	k->m.n = share;
	file_get(&k->m, share, tag, s == SMAP || s == SMAPNT, s != SPWRITE && s != SPWRITEW);
}

/* n bytes at off of the sink from (out) or into (in) buf */
static void sink_io(struct sinkmem *k, int outward, unsigned char *buf, size_t off, size_t n)
{
	unsigned char *at = k->m.p ? (unsigned char *)k->m.p + off : NULL;

	/* pwrite-whole writes a part (4 MiB, the mover's) at a time, or the piece if smaller;
	 * both read back 1 MiB at a time, as the mover's load does */
	size_t block = k->s == SPWRITEW && outward ? (n < PART_BYTES ? n : PART_BYTES) : BLOCK;

	if (k->s != SPWRITE && k->s != SPWRITEW) {
		if (!outward)
			memcpy(buf, at, n);
		else if (k->s == SMAPNT || k->s == SNTFAULT)
			copy_nt(at, buf, n);
		else
			memcpy(at, buf, n);
		return;
	}
	for (size_t b = 0; b < n; b += block) {
		size_t len = n - b < block ? n - b : block;

		for (size_t done = 0; done < len;) {
			ssize_t r = outward ? pwrite(k->m.fd, buf + b + done, len - done, off + b + done)
					    : pread(k->m.fd, buf + b + done, len - done, off + b + done);

			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0)
				die(outward ? "pwrite" : "pread");
			done += r;
		}
	}
}

/* -- the background DMA (under_dma) ----------------------------------------------------------- */

static volatile int load_on, load_running;
static volatile size_t load_done; /* bytes the background DMA has completed so far */

static void *dma_load(void *arg)
{
	size_t piece = 64 * MIB;
	unsigned char *buf;
	CUdeviceptr base = dev + (size_t)nthreads * share;
	CUstream s[2];
	size_t o = 0;

	(void)arg;
	CK(cu.CtxSetCurrent(ctx));
	buf = pinned(2 * piece);
	CK(cu.StreamCreate(&s[0], 1));
	CK(cu.StreamCreate(&s[1], 1));
	CK(cu.DtoH(buf, base, piece, s[0]));
	for (int i = 1; load_on; i ^= 1) {
		CK(cu.DtoH(buf + i * piece, base + o, piece, s[i]));
		CK(cu.StreamSynchronize(s[i ^ 1])); /* the one before: done */
		__atomic_add_fetch(&load_done, piece, __ATOMIC_RELAXED);
		load_running = 1;
		o = o + 2 * piece > load_bytes ? 0 : o + piece;
	}
	CK(cu.StreamSynchronize(s[0]));
	CK(cu.StreamSynchronize(s[1]));
	cu.StreamDestroy(s[0]);
	cu.StreamDestroy(s[1]);
	unpin(buf, 2 * piece);
	return NULL;
}

/* -- the measurements ------------------------------------------------------------------------- */

enum what { PCIE, COPY, STAGED, REGISTER };

struct job {
	enum what what;
	int k, outward, under_dma;
	enum sink sink;
	enum kind kind;
	size_t stage;          /* staged: each of the two buffers' size */
	size_t bytes;          /* register: this thread's */
	double t_pop, t_reg, t_dma, t_unreg;
	double at[3][2];       /* register: when its register, DMA and unregister began and ended */
	int skipped;
};

static pthread_barrier_t ready;

static void pcie(struct job *j, CUstream s[2])
{
	size_t piece = 32 * MIB;
	unsigned char *buf = pinned(2 * piece);
	CUdeviceptr at = dev + (size_t)j->k * share;
	double t;

	pthread_barrier_wait(&ready);
	t = now();
	for (size_t o = 0, i = 0; o < share; o += piece, i ^= 1) {
		size_t n = share - o < piece ? share - o : piece;

		CK(cu.StreamSynchronize(s[i]));
		CK(j->outward ? cu.DtoH(buf + i * piece, at + o, n, s[i])
			      : cu.HtoD(at + o, buf + i * piece, n, s[i]));
	}
	CK(cu.StreamSynchronize(s[0]));
	CK(cu.StreamSynchronize(s[1]));
	j->t_dma = now() - t;
	unpin(buf, 2 * piece);
}

static void copy(struct job *j)
{
	size_t piece = 32 * MIB;
	unsigned char *buf = pinned(piece);
	struct sinkmem k;
	double t;

	sink_open(&k, j->sink, j->k);
	if (!j->outward) /* something to read back (a sparse file's holes read fast) */
		for (size_t o = 0; o < share; o += piece)
			sink_io(&k, 1, buf, o, share - o < piece ? share - o : piece);
	pthread_barrier_wait(&ready);
	t = now();
	for (size_t o = 0; o < share; o += piece)
		sink_io(&k, j->outward, buf, o, share - o < piece ? share - o : piece);
	j->t_dma = now() - t;
	mem_put(&k.m);
	unpin(buf, piece);
}

/* the mover's shape: the GPU fills (out) or empties (in) one buffer while the CPU works on the
 * other */
static void staged(struct job *j, CUstream s[2])
{
	size_t st = j->stage, pieces = (share + st - 1) / st;
	unsigned char *buf = pinned(2 * st);
	CUdeviceptr at = dev + (size_t)j->k * share;
	struct sinkmem k;
	double t;

#define LEN(p) (share - (p) * st < st ? share - (p) * st : st)
	sink_open(&k, j->sink, j->k);
	if (!j->outward) /* something to read back */
		for (size_t o = 0; o < share; o += st)
			sink_io(&k, 1, buf, o, LEN(o / st));
	pthread_barrier_wait(&ready);
	t = now();
	if (j->outward) {
		CK(cu.DtoH(buf, at, LEN(0), s[0]));
		for (size_t p = 0; p < pieces; p++) {
			int i = p & 1;

			if (p + 1 < pieces)
				CK(cu.DtoH(buf + (i ^ 1) * st, at + (p + 1) * st, LEN(p + 1), s[i ^ 1]));
			CK(cu.StreamSynchronize(s[i]));
			sink_io(&k, 1, buf + i * st, p * st, LEN(p));
		}
	} else {
		for (size_t p = 0; p < pieces; p++) {
			int i = p & 1;

			CK(cu.StreamSynchronize(s[i])); /* its buffer's last copy in is done */
			sink_io(&k, 0, buf + i * st, p * st, LEN(p));
			CK(cu.HtoD(at + p * st, buf + i * st, LEN(p), s[i]));
		}
	}
	CK(cu.StreamSynchronize(s[0]));
	CK(cu.StreamSynchronize(s[1]));
	j->t_dma = now() - t;
#undef LEN
	mem_put(&k.m);
	unpin(buf, 2 * st);
}

/* register j->bytes of j->kind, the GPU straight into it, unregister */
static void reg(struct job *j, CUstream s)
{
	struct mem m;
	CUdeviceptr at = dev + (size_t)j->k * share;
	double t = now();

	if (mem_get(&m, j->kind, j->bytes, 1000 + j->k)) {
		j->skipped = 1;
		pthread_barrier_wait(&ready);
		return;
	}
	j->t_pop = now() - t;
	pthread_barrier_wait(&ready);
	j->at[0][0] = now();
	CK(cu.HostRegister(m.p, m.n, 0));
	j->at[1][0] = j->at[0][1] = now();
	for (size_t o = 0; o < m.n; o += 64 * MIB)
		CK(cu.DtoH((char *)m.p + o, at + o, m.n - o < 64 * MIB ? m.n - o : 64 * MIB, s));
	CK(cu.StreamSynchronize(s));
	j->at[2][0] = j->at[1][1] = now();
	CK(cu.HostUnregister(m.p));
	j->at[2][1] = now();
	j->t_reg = j->at[0][1] - j->at[0][0];
	j->t_dma = j->at[1][1] - j->at[1][0];
	j->t_unreg = j->at[2][1] - j->at[2][0];
	mem_put(&m);
}

static void *run(void *arg)
{
	struct job *j = arg;
	CUstream s[2];

	CK(cu.CtxSetCurrent(ctx));
	CK(cu.StreamCreate(&s[0], 1));
	CK(cu.StreamCreate(&s[1], 1));
	switch (j->what) {
	case PCIE:
		pcie(j, s);
		break;
	case COPY:
		copy(j);
		break;
	case STAGED:
		staged(j, s);
		break;
	case REGISTER:
		reg(j, s[0]);
		break;
	}
	cu.StreamDestroy(s[0]);
	cu.StreamDestroy(s[1]);
	return NULL;
}

static int by_start(const void *a, const void *b)
{
	const double *x = a, *y = b;

	return (x[0] > y[0]) - (x[0] < y[0]);
}

/* how long at least one of the threads was in stage st (the union of their intervals): a stage
 * the driver serializes shows its rate while it runs, not the slowest thread's share of it */
static double busy(const struct job *jobs, int threads, int st)
{
	double iv[MAX_THREADS][2], sum = 0, from, to;

	for (int k = 0; k < threads; k++)
		iv[k][0] = jobs[k].at[st][0], iv[k][1] = jobs[k].at[st][1];
	qsort(iv, threads, sizeof(iv[0]), by_start);
	from = iv[0][0], to = iv[0][1];
	for (int k = 1; k < threads; k++) {
		if (iv[k][0] > to) {
			sum += to - from;
			from = iv[k][0];
		}
		if (iv[k][1] > to)
			to = iv[k][1];
	}
	return sum + (to - from);
}

/* T threads of proto at once (the clock runs from when all are set up to the last one done);
 * returns the wall time, the slowest thread's stages in *worst */
static double team(const struct job *proto, int threads, struct job *worst, double *dma_rate)
{
	struct job jobs[MAX_THREADS];
	pthread_t th[MAX_THREADS], loader;
	size_t dma0 = 0;
	double t;

	pthread_barrier_init(&ready, NULL, threads + 1);
	for (int k = 0; k < threads; k++) {
		jobs[k] = *proto;
		jobs[k].k = k;
		pthread_create(&th[k], NULL, run, &jobs[k]);
	}
	if (proto->under_dma) { /* the GPU at full rate before the clock starts */
		load_on = 1, load_running = 0;
		pthread_create(&loader, NULL, dma_load, NULL);
		while (!load_running)
			usleep(1000);
	}
	pthread_barrier_wait(&ready);
	dma0 = load_done; /* after the threads' set-up: the rate is the one while they copy */
	t = now();
	for (int k = 0; k < threads; k++)
		pthread_join(th[k], NULL);
	t = now() - t;
	if (proto->under_dma) {
		*dma_rate = (load_done - dma0) / t / 1e9;
		load_on = 0;
		pthread_join(loader, NULL);
	}
	pthread_barrier_destroy(&ready);
	*worst = jobs[0];
	for (int k = 1; k < threads; k++) {
		worst->skipped |= jobs[k].skipped;
		if (jobs[k].t_pop > worst->t_pop)
			worst->t_pop = jobs[k].t_pop;
	}
	if (proto->what == REGISTER && !worst->skipped) { /* threads stagger: time any one is in it */
		worst->t_reg = busy(jobs, threads, 0);
		worst->t_dma = busy(jobs, threads, 1);
		worst->t_unreg = busy(jobs, threads, 2);
	}
	return t;
}

static const char *dir_name(int outward)
{
	return outward ? "out" : "in";
}

static void measure_pcie(int round)
{
	for (int o = 1; o >= 0; o--) {
		struct job p = { .what = PCIE, .outward = o }, w;
		double t = team(&p, nthreads, &w, NULL);

		out("\"what\": \"pcie\", \"round\": %d, \"direction\": \"%s\", \"bytes\": %zu, "
		    "\"wall_s\": %.4f, \"gb_per_s\": %.2f", round, dir_name(o), total, t, total / t / 1e9);
		fprintf(stderr, "pcie      %-3s              round %d: %6.2f GB/s\n", dir_name(o), round,
			total / t / 1e9);
	}
}

static void measure_copy(int round)
{
	for (int u = 0; u <= 1; u++)
		for (int s = 0; s < NSINKS; s++)
			for (int o = 1; o >= 0; o--) {
				struct job p = { .what = COPY, .outward = o, .sink = s, .under_dma = u }, w;
				double t, dma = 0;

				if (!o && (s == SMAPNT || s == SNTFAULT))
					continue; /* reading back is the same memcpy as map */
				t = team(&p, nthreads, &w, &dma);
				out("\"what\": \"copy\", \"round\": %d, \"sink\": \"%s\", \"direction\": "
				    "\"%s\", \"under_dma\": %s, \"bytes\": %zu, \"wall_s\": %.4f, "
				    "\"gb_per_s\": %.2f, \"dma_gb_per_s\": %.2f", round, sink_name[s],
				    dir_name(o), u ? "true" : "false", total, t, total / t / 1e9, dma);
				fprintf(stderr, "copy      %-3s %-12s %-5s round %d: %6.2f GB/s%s", dir_name(o),
					sink_name[s], u ? "+dma" : "", round, total / t / 1e9,
					u ? "" : "\n");
				if (u)
					fprintf(stderr, " (the GPU meanwhile %.2f GB/s)\n", dma);
			}
}

static void measure_staged(int round, const size_t *stages, int nstages)
{
	for (int z = 0; z < nstages; z++)
		for (int s = 0; s < NSINKS; s++)
			for (int o = 1; o >= 0; o--) {
				struct job p = { .what = STAGED, .outward = o, .sink = s,
						 .stage = stages[z] }, w;
				double t;

				if (!o && (s == SMAPNT || s == SNTFAULT))
					continue;
				t = team(&p, nthreads, &w, NULL);
				out("\"what\": \"staged\", \"round\": %d, \"sink\": \"%s\", \"direction\": "
				    "\"%s\", \"stage_mib\": %zu, \"bytes\": %zu, \"wall_s\": %.4f, "
				    "\"gb_per_s\": %.2f", round, sink_name[s], dir_name(o), stages[z] / MIB,
				    total, t, total / t / 1e9);
				fprintf(stderr, "staged    %-3s %-12s %3zu MiB round %d: %6.2f GB/s\n",
					dir_name(o), sink_name[s], stages[z] / MIB, round, total / t / 1e9);
			}
}

static void measure_register(int round)
{
	size_t all = ((size_t)(reg_gib * (1UL << 30))) & ~(2 * MIB * nthreads - 1);
	int counts[2] = { nthreads, 1 };

	if (all > total)
		all = total & ~(2 * MIB * nthreads - 1);
	for (int kd = 0; kd < NKINDS; kd++)
		for (int c = 0; c < 2; c++) {
			int threads = counts[c];
			struct job p = { .what = REGISTER, .kind = kd, .bytes = all / threads }, w;
			double t;

			if (c == 1 && nthreads == 1)
				break;
			if (p.bytes > share) /* one thread: its own share of the device only */
				p.bytes = share;
			t = team(&p, threads, &w, NULL);
			if (w.skipped) {
				out("\"what\": \"register\", \"round\": %d, \"kind\": \"%s\", "
				    "\"threads\": %d, \"skipped\": \"no %s memory to be had (see "
				    "/proc/sys/vm/nr_hugepages)\"", round, kind_name[kd], threads,
				    kind_name[kd]);
				fprintf(stderr, "register  %-9s x%-2d round %d: skipped (no memory of "
					"that kind)\n", kind_name[kd], threads, round);
				continue;
			}
			size_t bytes = p.bytes * threads;

			out("\"what\": \"register\", \"round\": %d, \"kind\": \"%s\", \"threads\": %d, "
			    "\"bytes\": %zu, \"wall_s\": %.4f, \"populate_s\": %.4f, \"register_s\": "
			    "%.4f, \"dma_s\": %.4f, \"unregister_s\": %.4f, \"register_gb_per_s\": %.2f, "
			    "\"dma_gb_per_s\": %.2f, \"register_dma_unregister_gb_per_s\": %.2f", round,
			    kind_name[kd], threads, bytes, t, w.t_pop, w.t_reg, w.t_dma, w.t_unreg,
			    bytes / w.t_reg / 1e9, bytes / w.t_dma / 1e9, bytes / t / 1e9);
			fprintf(stderr, "register  %-9s x%-2d round %d: register %6.2f GB/s, then DMA "
				"%6.2f GB/s, all %6.2f GB/s (populate %.3f s, unregister %.3f s)\n",
				kind_name[kd], threads, round, bytes / w.t_reg / 1e9,
				bytes / w.t_dma / 1e9, bytes / t / 1e9, w.t_pop, w.t_unreg);
		}
}

static const char *dir_huge(void)
{
	static char opt[64];
	FILE *f = fopen("/proc/self/mountinfo", "r");
	char line[4096];
	size_t best = 0;

	strcpy(opt, "unknown");
	if (!f)
		return opt;
	while (fgets(line, sizeof(line), f)) {
		char mnt[1024], *sep = strstr(line, " - "), *h;
		size_t len;

		if (sscanf(line, "%*s %*s %*s %*s %1023s", mnt) != 1 || !sep)
			continue;
		len = strlen(mnt);
		if (strncmp(dir, mnt, len) || (dir[len] != '/' && dir[len] && len > 1) ||
		    len < best)
			continue;
		best = len;
		h = strstr(sep, "huge=");
		if (h)
			sscanf(h, "huge=%63[a-z_]", opt);
		else
			snprintf(opt, sizeof(opt), strstr(sep, " tmpfs ") ? "never" : "not a tmpfs");
	}
	fclose(f);
	return opt;
}

static void usage(void)
{
	fprintf(stderr, "usage: host_bounds [--gib G] [--threads T] [--dir D] [--rounds R] "
		"[--register-gib G] [--stages MiB,MiB] [--only pcie,copy,staged,register]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	double gib = 16;
	CUdevice d;
	size_t stages[8] = { 4 * MIB, 32 * MIB };
	int nstages = 2;
	const char *only = "pcie,copy,staged,register";
	unsigned char *fill;
	CUstream s;

	nthreads = 16;
	for (int i = 1; i < argc; i += 2) {
		if (i + 1 >= argc)
			usage();
		if (!strcmp(argv[i], "--gib"))
			gib = atof(argv[i + 1]);
		else if (!strcmp(argv[i], "--threads"))
			nthreads = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--dir"))
			dir = argv[i + 1];
		else if (!strcmp(argv[i], "--rounds"))
			rounds = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--register-gib"))
			reg_gib = atof(argv[i + 1]);
		else if (!strcmp(argv[i], "--only"))
			only = argv[i + 1];
		else if (!strcmp(argv[i], "--stages")) {
			char *p = argv[i + 1], *end;

			for (nstages = 0; *p && nstages < 8; p = *end ? end + 1 : end) {
				long v = strtol(p, &end, 10);

				if (v < 1 || v > 1024 || (*end && *end != ','))
					usage();
				stages[nstages++] = (size_t)v * MIB;
			}
		} else
			usage();
	}
	if (nthreads < 1 || nthreads > MAX_THREADS || gib <= 0 || rounds < 1 || reg_gib <= 0)
		usage();
	share = ((size_t)(gib * (1UL << 30)) / nthreads) & ~(2 * MIB - 1);
	if (!share)
		usage();
	total = share * nthreads;
	load_bytes = 2UL << 30;
	load_driver();
	CK(cu.Init(0));
	CK(cu.DeviceGet(&d, 0));
	CK(cu.PrimaryCtxRetain(&ctx, d));
	CK(cu.CtxSetCurrent(ctx));
	CK(cu.MemAlloc(&dev, total + load_bytes));
	fill = pinned(64 * MIB); /* the device's bytes: not zero, so nothing can take a shortcut */
	CK(cu.StreamCreate(&s, 1));
	for (size_t o = 0; o < total + load_bytes; o += 64 * MIB)
		CK(cu.HtoD(dev + o, fill, total + load_bytes - o < 64 * MIB ? total + load_bytes - o
									   : 64 * MIB, s));
	CK(cu.StreamSynchronize(s));
	cu.StreamDestroy(s);
	unpin(fill, 64 * MIB);

	printf("{\"benchmark\": \"host_bounds\", \"threads\": %d, \"bytes\": %zu, \"dir\": \"%s\", "
	       "\"dir_huge\": \"%s\", \"rounds\": %d, \"runs\": [\n", nthreads, total, dir, dir_huge(),
	       rounds);
	for (int round = 1; round <= rounds; round++) {
		if (strstr(only, "pcie"))
			measure_pcie(round);
		if (strstr(only, "copy"))
			measure_copy(round);
		if (strstr(only, "staged"))
			measure_staged(round, stages, nstages);
		if (strstr(only, "register"))
			measure_register(round);
	}
	printf("\n]}\n");
	return 0;
}
