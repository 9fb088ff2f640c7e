/* bench/host_paths.c: the ways GPU memory can reach host RAM, measured side by side.
 *
 * What the agent's mover (agent/src/mover.c) can do with a program's GPU memory on its way to
 * host RAM, each way timed per stage, T threads at once, each with its own share and stream:
 *
 *   anon     the program's own anonymous memory (transparent huge pages): populate
 *            (MADV_POPULATE_WRITE), cuMemHostRegister, DMA out, checksum, unregister; back:
 *            register, DMA in, unregister. What a suspend can keep in the process.
 *   tmpfs    a file per thread in /dev/shm: fallocate, mmap shared, register, DMA out,
 *            unregister; back: mmap read-only, register read-only, DMA in. What a checkpoint
 *            into host memory can do without a staging copy.
 *   staged   two pinned 32 MiB staging buffers per thread, pwrite into a /dev/shm file (what
 *            the mover does for files: the yardstick); back: pread + DMA.
 *   staged-anon  the same buffers, memcpy into the thread's anonymous memory, populated first
 *            (MADV_POPULATE_WRITE): what the mover does for a prepare without files.
 *
 * Every way runs twice (the first use of host memory on a VM is slower: its RAM grows as it is
 * used); the JSON has both rounds. Build and run on the GPU host:
 *
 *   gcc -O2 -pthread -I/usr/local/cuda/include bench/host_paths.c -lcuda -o /tmp/host_paths
 *   /tmp/host_paths --gib 16 --threads 16 --dir /dev/shm > host_paths.json
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define PIECE (64UL << 20)
#define STAGE (32UL << 20)

#define CK(x)                                                                                  \
	do {                                                                                   \
		CUresult rc_ = (x);                                                            \
		if (rc_ != CUDA_SUCCESS) {                                                     \
			fprintf(stderr, "%s:%d: %s: CUresult %d\n", __FILE__, __LINE__, #x, rc_); \
			exit(1);                                                               \
		}                                                                              \
	} while (0)

static CUcontext ctx;
static CUdeviceptr dev;
static size_t total, share;
static int nthreads;
static const char *dir = "/dev/shm";

enum { POP, REG, DMA, SUM, UNREG, NSTAGE };
static const char *stage_name[NSTAGE] = { "populate", "register", "dma", "checksum", "unregister" };

struct job {
	int k, way, out;
	void *host;
	int fd;
	double t[NSTAGE];
	uint64_t sum;
};

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t checksum(const void *p, size_t n)
{
	const uint64_t *w = p;
	uint64_t a = 0, b = 0, c = 0, d = 0;

	for (size_t i = 0; i + 4 <= n / 8; i += 4) {
		a = (a + w[i] * 0xC2B2AE3D27D4EB4FULL) * 0x9E3779B185EBCA87ULL;
		b = (b + w[i + 1] * 0xC2B2AE3D27D4EB4FULL) * 0x9E3779B185EBCA87ULL;
		c = (c + w[i + 2] * 0xC2B2AE3D27D4EB4FULL) * 0x9E3779B185EBCA87ULL;
		d = (d + w[i + 3] * 0xC2B2AE3D27D4EB4FULL) * 0x9E3779B185EBCA87ULL;
	}
	return a ^ b ^ c ^ d;
}

static void dma(struct job *j, CUstream s, void *host, size_t off, size_t n)
{
	if (j->out)
		CK(cuMemcpyDtoHAsync(host, dev + off, n, s));
	else
		CK(cuMemcpyHtoDAsync(dev + off, host, n, s));
}

/* anon (way 0) and tmpfs (way 1): DMA straight to/from the mapping */
static void direct(struct job *j, CUstream s)
{
	size_t off = (size_t)j->k * share;
	double t;
	unsigned flags = 0;

	if (j->way == 1) {
		char path[256];

		snprintf(path, sizeof(path), "%s/host-paths-%d-%d.bin", dir, getpid(), j->k);
		if (j->out) {
			j->fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
			t = now();
			if (j->fd < 0 || fallocate(j->fd, 0, 0, share))
				perror("fallocate"), exit(1);
			j->t[POP] = now() - t;
			j->host = mmap(NULL, share, PROT_READ | PROT_WRITE, MAP_SHARED, j->fd, 0);
		} else {
			j->fd = open(path, O_RDONLY);
			j->host = mmap(NULL, share, PROT_READ, MAP_SHARED | MAP_POPULATE, j->fd, 0);
			flags = CU_MEMHOSTREGISTER_READ_ONLY;
		}
		if (j->host == MAP_FAILED)
			perror("mmap"), exit(1);
	} else if (j->out) {
		j->host = mmap(NULL, share, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		madvise(j->host, share, MADV_HUGEPAGE);
		t = now();
		if (madvise(j->host, share, MADV_POPULATE_WRITE))
			perror("MADV_POPULATE_WRITE"), exit(1);
		j->t[POP] = now() - t;
	}
	t = now();
	CK(cuMemHostRegister(j->host, share, flags));
	j->t[REG] = now() - t;
	t = now();
	for (size_t o = 0; o < share; o += PIECE)
		dma(j, s, (char *)j->host + o, off + o, share - o < PIECE ? share - o : PIECE);
	CK(cuStreamSynchronize(s));
	j->t[DMA] = now() - t;
	t = now();
	j->sum = checksum(j->host, share);
	j->t[SUM] = now() - t;
	t = now();
	CK(cuMemHostUnregister(j->host));
	j->t[UNREG] = now() - t;
	if (j->way == 1 || !j->out) {
		munmap(j->host, share);
		if (j->way == 1) {
			if (!j->out) {
				char path[256];

				snprintf(path, sizeof(path), "%s/host-paths-%d-%d.bin", dir, getpid(), j->k);
				unlink(path);
			}
			close(j->fd);
		}
	}
}

/* staged (way 2): two pinned buffers, pwrite/pread; staged-anon (way 3): memcpy to/from
 * the thread's populated anonymous memory */
static void staged(struct job *j, CUstream s2[2])
{
	size_t off = (size_t)j->k * share;
	char path[256];
	void *buf = mmap(NULL, 2 * STAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	double t = now();
	int anon = j->way == 3;

	if (anon && j->out) {
		j->host = mmap(NULL, share, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (j->host == MAP_FAILED || madvise(j->host, share, MADV_POPULATE_WRITE))
			perror("anonymous memory"), exit(1);
		j->t[POP] = now() - t;
		t = now();
	}
	snprintf(path, sizeof(path), "%s/host-paths-st-%d-%d.bin", dir, getpid(), j->k);
	j->fd = anon ? -1 : open(path, j->out ? O_RDWR | O_CREAT | O_TRUNC : O_RDONLY, 0600);
	if (!anon && j->fd < 0)
		perror("open"), exit(1);
	madvise(buf, 2 * STAGE, MADV_HUGEPAGE);
	memset(buf, 0, 2 * STAGE);
	CK(cuMemHostRegister(buf, 2 * STAGE, 0));
	j->t[REG] = now() - t;
	t = now();
	for (size_t o = 0, i = 0; o < share; o += STAGE, i ^= 1) {
		char *b = (char *)buf + i * STAGE;
		size_t n = share - o < STAGE ? share - o : STAGE;

		CK(cuStreamSynchronize(s2[i]));
		if (j->out) {
			dma(j, s2[i], b, off + o, n);
			CK(cuStreamSynchronize(s2[i]));
			if (anon)
				memcpy((char *)j->host + o, b, n);
			else if (pwrite(j->fd, b, n, o) != (ssize_t)n)
				perror("pwrite"), exit(1);
		} else {
			if (anon)
				memcpy(b, (char *)j->host + o, n);
			else if (pread(j->fd, b, n, o) != (ssize_t)n)
				perror("pread"), exit(1);
			dma(j, s2[i], b, off + o, n);
		}
	}
	CK(cuStreamSynchronize(s2[0]));
	CK(cuStreamSynchronize(s2[1]));
	j->t[DMA] = now() - t;
	CK(cuMemHostUnregister(buf));
	munmap(buf, 2 * STAGE);
	if (anon) {
		if (!j->out)
			munmap(j->host, share);
		return;
	}
	close(j->fd);
	if (!j->out)
		unlink(path);
}

static void *run(void *arg)
{
	struct job *j = arg;
	CUstream s[2];

	CK(cuCtxSetCurrent(ctx));
	CK(cuStreamCreate(&s[0], CU_STREAM_NON_BLOCKING));
	CK(cuStreamCreate(&s[1], CU_STREAM_NON_BLOCKING));
	if (j->way >= 2)
		staged(j, s);
	else
		direct(j, s[0]);
	cuStreamDestroy(s[0]);
	cuStreamDestroy(s[1]);
	return NULL;
}

static void one(struct job *jobs, int way, int out, int round, int first)
{
	pthread_t th[256];
	double t = now(), worst[NSTAGE] = { 0 };
	static const char *ways[] = { "anon", "tmpfs", "staged", "staged-anon" };

	for (int k = 0; k < nthreads; k++) {
		jobs[k].k = k, jobs[k].way = way, jobs[k].out = out;
		memset(jobs[k].t, 0, sizeof(jobs[k].t));
		pthread_create(&th[k], NULL, run, &jobs[k]);
	}
	for (int k = 0; k < nthreads; k++)
		pthread_join(th[k], NULL);
	t = now() - t;
	for (int k = 0; k < nthreads; k++)
		for (int i = 0; i < NSTAGE; i++)
			if (jobs[k].t[i] > worst[i])
				worst[i] = jobs[k].t[i];
	printf("%s  {\"way\": \"%s\", \"direction\": \"%s\", \"round\": %d, \"bytes\": %zu, "
	       "\"wall_s\": %.4f, \"gb_per_s\": %.2f, \"slowest_thread_s\": {",
	       first ? "" : ",\n", ways[way], out ? "out" : "in", round, total, t, total / t / 1e9);
	for (int i = 0; i < NSTAGE; i++)
		printf("%s\"%s\": %.4f", i ? ", " : "", stage_name[i], worst[i]);
	printf("}}");
	fflush(stdout);
	fprintf(stderr, "%-11s %-3s round %d: %6.3f s  %6.2f GB/s  (populate %.3f register %.3f "
		"dma %.3f checksum %.3f unregister %.3f)\n", ways[way], out ? "out" : "in", round,
		t, total / t / 1e9, worst[POP], worst[REG], worst[DMA], worst[SUM], worst[UNREG]);
}

int main(int argc, char **argv)
{
	double gib = 16;
	CUdevice d;
	struct job *jobs;
	int first = 1, first_way = 0;

	nthreads = 16;
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--gib"))
			gib = atof(argv[i + 1]);
		else if (!strcmp(argv[i], "--threads"))
			nthreads = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--dir"))
			dir = argv[i + 1];
		else if (!strcmp(argv[i], "--staged-only"))
			first_way = atoi(argv[i + 1]) ? 2 : 0;
	}
	if (nthreads < 1 || nthreads > 256)
		return 2;
	share = ((size_t)(gib * (1UL << 30)) / nthreads) & ~((2UL << 20) - 1);
	total = share * nthreads;
	CK(cuInit(0));
	CK(cuDeviceGet(&d, 0));
	CK(cuDevicePrimaryCtxRetain(&ctx, d));
	CK(cuCtxSetCurrent(ctx));
	CK(cuMemAlloc(&dev, total));
	CK(cuMemsetD32(dev, 0x5a5a5a5a, total / 4));
	CK(cuCtxSynchronize());
	jobs = calloc(nthreads, sizeof(*jobs));
	printf("{\"benchmark\": \"host_paths\", \"threads\": %d, \"bytes\": %zu, \"dir\": \"%s\", "
	       "\"runs\": [\n", nthreads, total, dir);
	for (int round = 1; round <= 2; round++)
		for (int way = first_way; way < 4; way++) {
			one(jobs, way, 1, round, first);
			first = 0;
			one(jobs, way, 0, round, 0);
		}
	printf("\n]}\n");
	return 0;
}
