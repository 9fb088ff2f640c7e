// A CUDA C (runtime API) target for the GPU tests: large cudaMalloc buffers, two streams
// ordered by events, a deterministic kernel updating state every step, a checksum copied back
// with cudaMemcpyAsync. Same steps-file and status formats as torch_program.py, so
// tests/gpu/compare_steps.py compares a run with a reference of the same seed:
//
//     <step> <loss as C99 hex float> <checksum, 16 hex digits>
//
//     nvcc -O2 -o cuda_streams cuda_streams.cu
//     ./cuda_streams --mib 2048 --seed 1234 --steps-file S --status J [--max-steps N] [--sleep 0.05]
//
// Memory: NBUF buffers of --mib / NBUF MiB each (cudaMalloc: large enough for the agent's VMM
// path), plus a few small device words (the driver's checkpoint keeps those). Each step:
//   stream A waits for event B (the previous step's reads), advances buffers 0..NBUF/2-1 by an
//   LCG salted with the step, records event A;
//   stream B waits for event A, blends buffer NBUF/2+k with buffer k, sums one rotating 64 MiB
//   window of all buffers (exact uint64 sum of the 32-bit words: order does not matter), folds
//   it into a double "loss" on one thread, copies both back to pinned host memory
//   (cudaMemcpyAsync), records event B; the host waits for stream B.
// Every window is summed in turn, so a buffer that came back wrong after a restore shows.
// --status is JSON, replaced atomically: {"pid","step","ready","mib","seed","done","updated"}.

#include <cuda_runtime.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define CK(call)                                                                      \
	do {                                                                          \
		cudaError_t e_ = (call);                                              \
		if (e_ != cudaSuccess) {                                              \
			fprintf(stderr, "cuda_streams: %s:%d: %s: %s\n", __FILE__,    \
				__LINE__, #call, cudaGetErrorString(e_));             \
			exit(2);                                                      \
		}                                                                     \
	} while (0)

static const int NBUF = 4;
static const size_t WINDOW_WORDS = (64u << 20) / 4;
static const int THREADS = 256;
static const int BLOCKS = 2048;

__device__ __forceinline__ uint32_t mix32(uint32_t x)
{
	x ^= x >> 16;
	x *= 0x7feb352du;
	x ^= x >> 15;
	x *= 0x846ca68bu;
	x ^= x >> 16;
	return x;
}

__global__ void fill(uint32_t *p, size_t n, uint32_t seed, uint32_t buf)
{
	uint32_t salt = mix32(seed * 8u + buf + 1u);
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		p[i] = mix32((uint32_t)i ^ salt ^ mix32((uint32_t)(i >> 32)));
}

__global__ void advance(uint32_t *p, size_t n, uint32_t step)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		p[i] = p[i] * 1664525u + 1013904223u + step;
}

__global__ void blend(uint32_t *b, const uint32_t *a, size_t n, uint32_t step)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		uint32_t x = a[i];
		b[i] = (b[i] ^ ((x << 7) | (x >> 25))) + step;
	}
}

/* blockDim.x is a multiple of 32 and every thread reaches the shuffles */
__global__ void checksum(const uint32_t *p, size_t n, unsigned long long *out)
{
	unsigned long long s = 0;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		s += p[i];
	for (int o = 16; o > 0; o >>= 1)
		s += __shfl_down_sync(0xffffffffu, s, o);
	if ((threadIdx.x & 31) == 0)
		atomicAdd(out, s);
}

__global__ void fold(double *loss, const unsigned long long *sum, uint32_t step)
{
	double x = (double)(*sum % 1000003ull) / 1000003.0;
	*loss = *loss * 0.9 + 0.1 * x * x + 1e-3 / (double)step;
}

struct Args {
	double mib = 1024, sleep = 0.05;
	long long seed = 1234, max_steps = 0;
	const char *steps = nullptr, *status = nullptr;
};

static void usage(void)
{
	fprintf(stderr, "usage: cuda_streams --mib N --steps-file F --status F [--seed N] "
			"[--max-steps N] [--sleep S]\n");
	exit(64);
}

static Args parse(int argc, char **argv)
{
	Args a;
	for (int i = 1; i < argc; i++) {
		const char *k = argv[i];
		if (i + 1 >= argc)
			usage();
		const char *v = argv[++i];
		if (!strcmp(k, "--mib"))
			a.mib = strtod(v, nullptr);
		else if (!strcmp(k, "--seed"))
			a.seed = strtoll(v, nullptr, 10);
		else if (!strcmp(k, "--max-steps"))
			a.max_steps = strtoll(v, nullptr, 10);
		else if (!strcmp(k, "--sleep"))
			a.sleep = strtod(v, nullptr);
		else if (!strcmp(k, "--steps-file"))
			a.steps = v;
		else if (!strcmp(k, "--status"))
			a.status = v;
		else
			usage();
	}
	if (!a.steps || !a.status || a.mib <= 0)
		usage();
	return a;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void write_all(int fd, const char *buf, size_t len, const char *path)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			fprintf(stderr, "cuda_streams: write %s: %s\n", path, strerror(errno));
			exit(3);
		}
		buf += n;
		len -= (size_t)n;
	}
}

/* tmp file + rename: a reader never sees half a status */
static void write_status(const Args &a, long long step, bool ready, bool done)
{
	char tmp[4096], buf[512];
	snprintf(tmp, sizeof(tmp), "%s.tmp", a.status);
	int len = snprintf(buf, sizeof(buf),
			   "{\"pid\": %d, \"step\": %lld, \"ready\": %s, \"mib\": %.17g, "
			   "\"seed\": %lld, \"done\": %s, \"updated\": %.6f}\n",
			   (int)getpid(), step, ready ? "true" : "false", a.mib, a.seed,
			   done ? "true" : "false", now_s());
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0) {
		fprintf(stderr, "cuda_streams: open %s: %s\n", tmp, strerror(errno));
		exit(3);
	}
	write_all(fd, buf, (size_t)len, tmp);
	close(fd);
	if (rename(tmp, a.status) != 0) {
		fprintf(stderr, "cuda_streams: rename %s: %s\n", tmp, strerror(errno));
		exit(3);
	}
}

/* open, append, fsync, close: no descriptor stays open across a checkpoint */
static void append_step(const char *path, const char *line)
{
	int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0) {
		fprintf(stderr, "cuda_streams: open %s: %s\n", path, strerror(errno));
		exit(3);
	}
	write_all(fd, line, strlen(line), path);
	fsync(fd);
	close(fd);
}

int main(int argc, char **argv)
{
	Args a = parse(argc, argv);
	write_status(a, 0, false, false);

	size_t total = (size_t)(a.mib * (double)(1 << 20));
	size_t words = total / NBUF / 4;
	if (words == 0)
		words = 1;
	uint32_t *buf[NBUF];
	for (int k = 0; k < NBUF; k++) {
		CK(cudaMalloc((void **)&buf[k], words * 4));
		fill<<<BLOCKS, THREADS>>>(buf[k], words, (uint32_t)a.seed, (uint32_t)k);
		CK(cudaGetLastError());
	}
	unsigned long long *dsum;
	double *dloss;
	CK(cudaMalloc((void **)&dsum, sizeof(*dsum)));
	CK(cudaMalloc((void **)&dloss, sizeof(*dloss)));
	CK(cudaMemset(dloss, 0, sizeof(*dloss)));
	struct Out {
		unsigned long long sum;
		double loss;
	} *host;
	CK(cudaMallocHost((void **)&host, sizeof(*host)));

	cudaStream_t sa, sb;
	cudaEvent_t ea, eb;
	CK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
	CK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
	CK(cudaEventCreateWithFlags(&ea, cudaEventDisableTiming));
	CK(cudaEventCreateWithFlags(&eb, cudaEventDisableTiming));
	CK(cudaDeviceSynchronize());
	CK(cudaEventRecord(eb, sb)); /* the first step's wait has an event to wait for */

	size_t per_buf = (words + WINDOW_WORDS - 1) / WINDOW_WORDS;
	size_t nwin = per_buf * NBUF;
	write_status(a, 0, true, false);
	cudaDeviceProp prop;
	CK(cudaGetDeviceProperties(&prop, 0));
	printf("cuda_streams: pid %d mib %g seed %lld device %s\n", (int)getpid(), a.mib, a.seed,
	       prop.name);
	fflush(stdout);

	FILE *create = fopen(a.steps, "a");
	if (create)
		fclose(create);
	long long step = 0;
	while (!a.max_steps || step < a.max_steps) {
		step++;
		uint32_t s32 = (uint32_t)step;
		CK(cudaStreamWaitEvent(sa, eb, 0));
		for (int k = 0; k < NBUF / 2; k++)
			advance<<<BLOCKS, THREADS, 0, sa>>>(buf[k], words, s32);
		CK(cudaGetLastError());
		CK(cudaEventRecord(ea, sa));
		CK(cudaStreamWaitEvent(sb, ea, 0));
		for (int k = NBUF / 2; k < NBUF; k++)
			blend<<<BLOCKS, THREADS, 0, sb>>>(buf[k], buf[k - NBUF / 2], words, s32);
		size_t w = (size_t)(step % (long long)nwin);
		size_t first = (w % per_buf) * WINDOW_WORDS;
		size_t len = words - first < WINDOW_WORDS ? words - first : WINDOW_WORDS;
		CK(cudaMemsetAsync(dsum, 0, sizeof(*dsum), sb));
		checksum<<<BLOCKS, THREADS, 0, sb>>>(buf[w / per_buf] + first, len, dsum);
		fold<<<1, 1, 0, sb>>>(dloss, dsum, s32);
		CK(cudaGetLastError());
		CK(cudaMemcpyAsync(&host->sum, dsum, sizeof(host->sum), cudaMemcpyDeviceToHost, sb));
		CK(cudaMemcpyAsync(&host->loss, dloss, sizeof(host->loss), cudaMemcpyDeviceToHost,
				   sb));
		CK(cudaEventRecord(eb, sb));
		CK(cudaStreamSynchronize(sb));

		char line[128];
		snprintf(line, sizeof(line), "%lld %a %016llx\n", step, host->loss, host->sum);
		append_step(a.steps, line);
		write_status(a, step, true, false);
		if (a.sleep > 0) {
			struct timespec ts;
			ts.tv_sec = (time_t)a.sleep;
			ts.tv_nsec = (long)((a.sleep - (double)ts.tv_sec) * 1e9);
			while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
				;
		}
	}
	write_status(a, step, true, true);
	return 0;
}
