/* torpor-copier: a paused program's held GPU memory into its checkpoint's data files, from a
 * process of its own, while the driver checkpoints the program and CRIU dumps it
 * (agent/src/defer.c says why; agent/PROTOCOL.md "The deferred copy").
 *
 *   torpor-copier --libcuda PATH --plan FD --files FD[,FD...] --held FD[,FD...]
 *   torpor-copier --libcuda PATH --ctl FD [--devices UUID[,UUID...]] [--deadline SECONDS]
 *
 * plan: the plan the program's agent wrote (defer.c: what is in it); files: the data files, in
 * the agent's order, open for writing and sized already; held: the descriptors of the program's
 * allocations (`detach hold`), in their order. Each allocation is imported and mapped here,
 * read only; each part of the plan is copied to the host (two pinned buffers and streams a
 * file, one thread a file) and written whole, in one pwrite, where the plan says. The
 * descriptors keep the memory alive as long as this process has them, whatever becomes of
 * torpor: torpor starts it in a session of its own, so a torpor killed during the pause leaves
 * the files complete, and its recovery resumes the program from them.
 *
 * The plan comes from the program's process: nothing in it is trusted. Every record is parsed
 * whole, every count bounded by the plan's size, every allocation named must be one given,
 * every byte copied must lie inside its allocation and every byte written inside its file as
 * it was sized, a part no longer than the image store's chunk and at a multiple of it.
 *
 * Ready first (--ctl, a SOCK_SEQPACKET socket): the driver is loaded and each GPU named (NVML's
 * UUIDs) has its context before the program pauses, and one line says so on stdout:
 * {"ready":true,"devices","seconds"}. A copier that cannot get there (a GPU without room for
 * another context, in exclusive-process mode) says why instead, and torpor copies in the program
 * as without a copier. The go is one message on the socket: "go F H" with the plan, the F files
 * and the H held descriptors, in that order, as SCM_RIGHTS; past 200 held descriptors, one bag
 * of them (agent/src/fdbag.h) in their place. The socket closed without it: nothing to do.
 *
 * Then one JSON line on stdout: {"ok":true,"bytes","parts","allocations","seconds",
 * "setup_seconds","copy_seconds"}, exit 0; or {"ok":false,"error"}, exit 1 (2: bad usage).
 * Nothing else is written, to the files or anywhere, on a refusal before the copy.
 *
 * Once it has the held descriptors it may hold the only copy of the program's GPU memory:
 * from then on it ignores SIGTERM, SIGINT and SIGHUP (a unit's stop, a system shutdown's
 * first round, a terminal's hang-up) and ends when the files are full; torpor's own timeout
 * kills it with SIGKILL. --deadline: no part written for that many seconds (from the go, then
 * from each part written: torpor gone and the copy stuck), it ends by itself with
 * {"ok":false,"error"}: a recovery that waits for it is not kept waiting for ever, and a copy
 * that is slow but moving (a data file on a slow disk) is not cut short. torpor starts it in a systemd scope of its own where systemd runs
 * (shim/torpor/copier.py), so that the cgroup of the torpor or torpord that started it can be
 * killed whole without it.
 */
#define _GNU_SOURCE
#include "../src/cuda_checkpoint_types.h" /* CUuuid */
#include "../src/cuda_types.h"
#include "../src/fdbag.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PART (4UL << 20)          /* the image store's chunk: a part at most */
#define PLAN_MAX (64UL << 20)     /* bytes of plan read at most */
#define MAX_FILES 16
#define MAX_HELD 8192             /* agent.h's HOLD_MAX */
#define HELD_DIRECT 200           /* agent.h's HOLD_DIRECT: more come in one bag (fdbag.h) */
#define MAX_DEVICES 64
#define POSIX_FD 1                /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
#define HOSTALLOC_PORTABLE 1      /* CU_MEMHOSTALLOC_PORTABLE */

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGetCount)(int *);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*Import)(CUmemGenericAllocationHandle *, void *, int);
	CUresult (*AddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	CUresult (*SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	CUresult (*Unmap)(CUdeviceptr, size_t);
	CUresult (*AddressFree)(CUdeviceptr, size_t);
	CUresult (*Release)(CUmemGenericAllocationHandle);
	CUresult (*HostAlloc)(void **, size_t, unsigned);
	CUresult (*StreamCreate)(CUstream *, unsigned);
	CUresult (*DtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*StreamSynchronize)(CUstream);
} cu;

struct alloc {
	size_t size;
	unsigned char uuid[16];
	int fd, dev;              /* dev: into devices[] */
	CUmemGenericAllocationHandle h;
	CUdeviceptr va;
	int imported, reserved, mapped;
};

struct seg {
	int k;
	unsigned long long off;
	size_t len;
};

struct part {
	int file;
	unsigned long long off;
	size_t len, seg, nseg;
};

static struct alloc allocs[MAX_HELD];
static int nallocs, nheld, nfiles;
static int file_fd[MAX_FILES];
static unsigned long long file_size[MAX_FILES];
static struct seg *segs;
static struct part *parts;
static size_t nsegs, nparts;
static struct {
	CUdevice dev;
	CUcontext ctx;
	unsigned char uuid[16];
} devices[MAX_DEVICES];
static int ndevices;

static unsigned deadline_s; /* --deadline: 0, none */

static pthread_mutex_t error_lock = PTHREAD_MUTEX_INITIALIZER;
static char error[300];
static volatile int failed;

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The first error wins; the workers stop at the next part. */
static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&error_lock);
	if (!failed) {
		va_start(ap, fmt);
		vsnprintf(error, sizeof(error), fmt, ap);
		va_end(ap);
		failed = 1;
	}
	pthread_mutex_unlock(&error_lock);
}

static void usage(const char *why)
{
	fprintf(stderr, "usage: torpor-copier --libcuda PATH --plan FD --files FD[,FD...] --held "
		"FD[,FD...], or --libcuda PATH --ctl FD [--devices UUID[,UUID...]] "
		"[--deadline SECONDS] (%s)\n", why);
	exit(2);
}

/* A descriptor number from the command line: a small non-negative number that is open. */
static int fd_arg(const char *s)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < 0 || v > 1 << 20 || fcntl(v, F_GETFD) < 0)
		usage("a descriptor that is not open");
	return (int)v;
}

static int fd_list(char *s, int *out, int max)
{
	int n = 0;

	for (char *save = NULL, *tok = strtok_r(s, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		if (n == max)
			usage("too many descriptors");
		out[n++] = fd_arg(tok);
	}
	return n;
}

static void *need(void *lib, const char *name)
{
	void *p = dlsym(lib, name);

	if (!p)
		fail("the driver has no %s", name);
	return p;
}

static int load(const char *path)
{
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);

	if (!lib) {
		fail("loading the driver %s: %s", path, dlerror());
		return -1;
	}
	cu.Init = need(lib, "cuInit");
	cu.DeviceGetCount = need(lib, "cuDeviceGetCount");
	cu.DeviceGet = need(lib, "cuDeviceGet");
	cu.DeviceGetUuid = dlsym(lib, "cuDeviceGetUuid_v2");
	if (!cu.DeviceGetUuid)
		cu.DeviceGetUuid = need(lib, "cuDeviceGetUuid");
	cu.PrimaryCtxRetain = need(lib, "cuDevicePrimaryCtxRetain");
	cu.CtxSetCurrent = need(lib, "cuCtxSetCurrent");
	cu.Import = need(lib, "cuMemImportFromShareableHandle");
	cu.AddressReserve = need(lib, "cuMemAddressReserve");
	cu.Map = need(lib, "cuMemMap");
	cu.SetAccess = need(lib, "cuMemSetAccess");
	cu.Unmap = need(lib, "cuMemUnmap");
	cu.AddressFree = need(lib, "cuMemAddressFree");
	cu.Release = need(lib, "cuMemRelease");
	cu.HostAlloc = need(lib, "cuMemHostAlloc");
	cu.StreamCreate = need(lib, "cuStreamCreate");
	cu.DtoHAsync = need(lib, "cuMemcpyDtoHAsync_v2");
	cu.StreamSynchronize = need(lib, "cuStreamSynchronize");
	return failed ? -1 : 0;
}

/* -- the plan ------------------------------------------------------------------------------------ */

static char *read_plan(int fd, size_t *len)
{
	char *buf = malloc(PLAN_MAX + 1);
	size_t n = 0;

	if (!buf) {
		fail("out of memory");
		return NULL;
	}
	for (;;) {
		ssize_t r = pread(fd, buf + n, PLAN_MAX + 1 - n, (off_t)n);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			fail("reading the plan: %s", strerror(errno));
			free(buf);
			return NULL;
		}
		if (r == 0)
			break;
		n += (size_t)r;
		if (n > PLAN_MAX) {
			fail("the plan is larger than %lu bytes", PLAN_MAX);
			free(buf);
			return NULL;
		}
	}
	buf[n] = 0;
	if (memchr(buf, 0, n)) {
		fail("the plan holds a NUL byte");
		free(buf);
		return NULL;
	}
	*len = n;
	return buf;
}

static int hexval(char c)
{
	return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* A line is one record, parsed whole: "%n" at its end must reach the line's end. */
static int parse_plan(char *text, size_t len)
{
	size_t cap_parts = len / 8 + 1, cap_segs = len / 8 + 1, lineno = 0;
	int seen_files = 0, ended = 0;
	size_t part_left = 0;
	char *save = NULL;

	parts = calloc(cap_parts, sizeof(*parts));
	segs = calloc(cap_segs, sizeof(*segs));
	if (!parts || !segs) {
		fail("out of memory");
		return -1;
	}
	if (len && text[len - 1] != '\n') {
		fail("the plan does not end in a newline");
		return -1;
	}
	for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		int n = -1, k, file;
		unsigned long long a, b;
		char hex[33];

		lineno++;
		if (ended) {
			fail("plan line %zu: after its end", lineno);
			return -1;
		}
		if (lineno == 1) {
			if (strcmp(line, "torpor-copy-plan 1")) {
				fail("not a copy plan of version 1");
				return -1;
			}
			continue;
		}
		if (!seen_files) {
			if (sscanf(line, "files %d%n", &k, &n) != 1 || n != (int)strlen(line) ||
			    k != nfiles) {
				fail("plan line %zu: the files are not the %d given", lineno, nfiles);
				return -1;
			}
			seen_files = 1;
			continue;
		}
		if (!strncmp(line, "alloc ", 6)) {
			if (nparts || sscanf(line, "alloc %d %llu %32[0-9a-f]%n", &k, &a, hex, &n) != 3 ||
			    n != (int)strlen(line) || strlen(hex) != 32 || k != nallocs ||
			    k >= nheld || !a || a > (1ULL << 48)) {
				fail("plan line %zu: a bad allocation (they come first, in the order of the "
				     "%d descriptors given)", lineno, nheld);
				return -1;
			}
			allocs[k].size = (size_t)a;
			allocs[k].fd = -1;
			for (int i = 0; i < 16; i++)
				allocs[k].uuid[i] = (unsigned char)(hexval(hex[2 * i]) << 4 |
								    hexval(hex[2 * i + 1]));
			nallocs++;
		} else if (!strncmp(line, "part ", 5)) {
			struct part *p;

			if (part_left || sscanf(line, "part %d %llu %llu%n", &file, &a, &b, &n) != 3 ||
			    n != (int)strlen(line) || file < 0 || file >= nfiles || a % PART ||
			    !b || b > PART || a > file_size[file] || b > file_size[file] - a ||
			    nparts == cap_parts) {
				fail("plan line %zu: a part that is not a whole part inside its file "
				     "as sized", lineno);
				return -1;
			}
			p = &parts[nparts++];
			*p = (struct part){ file, a, (size_t)b, nsegs, 0 };
			part_left = (size_t)b;
		} else if (!strncmp(line, "seg ", 4)) {
			if (!nparts || !part_left || sscanf(line, "seg %d %llu %llu%n", &k, &a, &b, &n) != 3 ||
			    n != (int)strlen(line) || k < 0 || k >= nallocs || !b || b > part_left ||
			    a > allocs[k].size || b > allocs[k].size - a || nsegs == cap_segs) {
				fail("plan line %zu: a segment outside its allocation or its part", lineno);
				return -1;
			}
			segs[nsegs++] = (struct seg){ k, a, (size_t)b };
			parts[nparts - 1].nseg++;
			part_left -= (size_t)b;
		} else if (!strcmp(line, "end")) {
			ended = 1;
		} else {
			fail("plan line %zu: not a record", lineno);
			return -1;
		}
	}
	if (!ended || part_left || nallocs != nheld) {
		fail("the plan is cut short or names %d allocations for %d descriptors", nallocs, nheld);
		return -1;
	}
	return 0;
}

/* -- the GPU side -------------------------------------------------------------------------------- */

/* devices[]'s index of the GPU whose UUID is uuid, its primary context retained (at the first
 * time it is named); -1 when this host shows no such GPU or it has no room for a context. */
static int device_retain(const unsigned char *uuid)
{
	int d, count = 0;
	CUresult rc;

	for (d = 0; d < ndevices; d++)
		if (!memcmp(devices[d].uuid, uuid, 16))
			return d;
	if ((rc = cu.DeviceGetCount(&count))) {
		fail("cuDeviceGetCount: CUresult %d", rc);
		return -1;
	}
	for (int i = 0; i < count; i++) {
		CUdevice dev;
		CUuuid u;

		if (cu.DeviceGet(&dev, i) || cu.DeviceGetUuid(&u, dev) || memcmp(u.bytes, uuid, 16))
			continue;
		if (ndevices == MAX_DEVICES) {
			fail("more than %d GPUs", MAX_DEVICES);
			return -1;
		}
		if ((rc = cu.PrimaryCtxRetain(&devices[d].ctx, dev))) {
			fail("a context on GPU %d: CUresult %d", i, rc);
			return -1;
		}
		devices[d].dev = dev;
		memcpy(devices[d].uuid, uuid, 16);
		return ndevices++;
	}
	fail("a GPU this host does not show");
	return -1;
}

static int cuda_init(void)
{
	CUresult rc = cu.Init(0);

	if (rc)
		fail("cuInit: CUresult %d", rc);
	return rc ? -1 : 0;
}

static int devices_find(void)
{
	for (int k = 0; k < nallocs; k++)
		if ((allocs[k].dev = device_retain(allocs[k].uuid)) < 0) {
			fail("allocation %d is on a GPU this host cannot give a context", k);
			return -1;
		}
	return 0;
}

/* --devices (before the plan): each GPU named by NVML's UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-
 * xxxxxxxxxxxx) gets its context now, while the program still runs. A name of another form is
 * skipped; ready needs one at least (a program on a MIG instance, which NVML names by its
 * parent GPU and CUDA by its own UUID, is not ready: it copies in its agent). */
static int devices_ready(char *list)
{
	for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		unsigned char uuid[16];
		int n = 0;

		if (strncmp(tok, "GPU-", 4))
			continue;
		for (const char *c = tok + 4; *c && n <= 32; c++) {
			if (*c == '-')
				continue;
			if (hexval(*c) < 0) {
				n = -1;
				break;
			}
			if (n < 32)
				uuid[n / 2] = (unsigned char)(n % 2 ? uuid[n / 2] << 4 | hexval(*c) : hexval(*c));
			n++;
		}
		if (n != 32)
			usage("--devices: not a GPU UUID");
		if (device_retain(uuid) < 0)
			return -1;
	}
	return 0;
}

/* --ctl: torpor's go, one SOCK_SEQPACKET message "go F H" carrying 1 + F + H descriptors: the
 * plan, the F data files, the H held allocations. Anything else is refused, every descriptor
 * that came with it closed. The socket closed first (torpor's prepare did not defer, or torpor
 * is gone): nothing to do. */
static int receive(int sock, int *plan, int *held)
{
	enum { MAX = 1 + MAX_FILES + HELD_DIRECT };
	char text[64];
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int) * MAX)];
	} c;
	struct iovec iov = { text, sizeof(text) - 1 };
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.b,
			    .msg_controllen = sizeof(c.b) };
	int fds[MAX], nfds = 0, f = 0, h = 0, end = 0;
	ssize_t n;

	do
		n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0) {
		fail("receiving the plan: %s", strerror(errno));
		return -1;
	}
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
		size_t k;

		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k; i++) {
			int fd;

			memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
			if (nfds < MAX)
				fds[nfds++] = fd;
			else
				close(fd);
		}
	}
	text[n] = 0;
	if (n == 0 && !nfds) {
		fail("no plan came: torpor copied in the program or went away");
		return -1;
	}
	if ((m.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) ||
	    sscanf(text, "go %d %d%n", &f, &h, &end) != 2 || text[end] || f < 1 || f > MAX_FILES ||
	    h < 1 || h > MAX_HELD || nfds != 1 + f + (h > HELD_DIRECT ? 1 : h)) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		fail("torpor's go is malformed");
		return -1;
	}
	if (h > HELD_DIRECT) { /* one bag of them, last */
		char why[200];
		int bag = fds[nfds - 1];

		nfds--;
		if (fdbag_unpack(bag, held, h, why, sizeof(why))) {
			close(bag);
			for (int i = 0; i < nfds; i++)
				close(fds[i]);
			fail("torpor's go: %s", why);
			return -1;
		}
		close(bag);
	} else {
		memcpy(held, fds + 1 + f, sizeof(int) * (size_t)h);
	}
	*plan = fds[0];
	memcpy(file_fd, fds + 1, sizeof(int) * (size_t)f);
	nfiles = f;
	nheld = h;
	return 0;
}

static int import_all(const int *held)
{
	for (int k = 0; k < nallocs; k++) {
		struct alloc *a = &allocs[k];
		CUmemAccessDesc access = { { CU_MEM_LOCATION_TYPE_DEVICE, devices[a->dev].dev },
					   CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
		CUresult rc;

		cu.CtxSetCurrent(devices[a->dev].ctx);
		if ((rc = cu.Import(&a->h, (void *)(intptr_t)held[k], POSIX_FD))) {
			fail("importing allocation %d: CUresult %d", k, rc);
			return -1;
		}
		a->imported = 1;
		if ((rc = cu.AddressReserve(&a->va, a->size, 0, 0, 0))) {
			fail("reserving %zu bytes of addresses: CUresult %d", a->size, rc);
			return -1;
		}
		a->reserved = 1;
		if ((rc = cu.Map(a->va, a->size, 0, a->h, 0))) {
			fail("mapping allocation %d (%zu bytes): CUresult %d", k, a->size, rc);
			return -1;
		}
		a->mapped = 1;
		if ((rc = cu.SetAccess(a->va, a->size, &access, 1))) {
			fail("access to allocation %d: CUresult %d", k, rc);
			return -1;
		}
	}
	return 0;
}

static void release_all(void)
{
	for (int k = 0; k < nallocs; k++) {
		struct alloc *a = &allocs[k];

		if (a->imported)
			cu.CtxSetCurrent(devices[a->dev].ctx);
		if (a->mapped)
			cu.Unmap(a->va, a->size);
		if (a->reserved)
			cu.AddressFree(a->va, a->size);
		if (a->imported)
			cu.Release(a->h);
	}
}

/* -- the workers: one a file ------------------------------------------------------------------ */

struct worker {
	pthread_t thread;
	int file;
	unsigned long long bytes;
	size_t parts;
};

static int write_part(int fd, const unsigned char *buf, const struct part *p)
{
	size_t done = 0;

	while (done < p->len) {
		ssize_t n = pwrite(fd, buf + done, p->len - done, (off_t)(p->off + done));

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			fail("writing data file %d at %llu: %s", p->file, p->off + done,
			     n < 0 ? strerror(errno) : "nothing written");
			return -1;
		}
		done += (size_t)n;
	}
	if (deadline_s) /* a part written: the copy moves (alarm is the process's, any thread's) */
		alarm(deadline_s);
	return 0;
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	unsigned char *buf[2] = { NULL, NULL };
	CUstream stream[MAX_DEVICES][2];
	unsigned char have[MAX_DEVICES] = { 0 };
	const struct part *pending[2] = { NULL, NULL };
	CUstream pending_stream[2] = { 0, 0 };
	CUresult rc;

	cu.CtxSetCurrent(devices[0].ctx);
	for (int b = 0; b < 2; b++)
		if ((rc = cu.HostAlloc((void **)&buf[b], PART, HOSTALLOC_PORTABLE))) {
			fail("pinned host memory: CUresult %d", rc);
			return NULL;
		}
	for (size_t i = 0, n = 0; i < nparts && !failed; i++) {
		const struct part *p = &parts[i];
		int b, d = allocs[segs[p->seg].k].dev;
		size_t at = 0;

		if (p->file != w->file)
			continue;
		b = (int)(n++ % 2);
		if (pending[b]) { /* this buffer's last part: its copy done, written */
			if ((rc = cu.StreamSynchronize(pending_stream[b]))) {
				fail("copying to the host: CUresult %d", rc);
				break;
			}
			if (write_part(file_fd[w->file], buf[b], pending[b]))
				break;
			pending[b] = NULL;
		}
		cu.CtxSetCurrent(devices[d].ctx);
		if (!have[d]) {
			if ((rc = cu.StreamCreate(&stream[d][0], 1)) || (rc = cu.StreamCreate(&stream[d][1], 1))) {
				fail("a stream: CUresult %d", rc);
				break;
			}
			have[d] = 1;
		}
		for (size_t s = p->seg; s < p->seg + p->nseg && !failed; s++) {
			const struct seg *g = &segs[s];

			if (allocs[g->k].dev != d) { /* the agent's chunks are one GPU's */
				fail("a part's segments on two GPUs");
				break;
			}
			if ((rc = cu.DtoHAsync(buf[b] + at, allocs[g->k].va + g->off, g->len, stream[d][b]))) {
				fail("copying to the host: CUresult %d", rc);
				break;
			}
			at += g->len;
		}
		pending[b] = p;
		pending_stream[b] = stream[d][b];
		w->bytes += p->len;
		w->parts++;
	}
	for (int b = 0; b < 2; b++)
		if (pending[b] && !failed) {
			if ((rc = cu.StreamSynchronize(pending_stream[b])))
				fail("copying to the host: CUresult %d", rc);
			else
				write_part(file_fd[w->file], buf[b], pending[b]);
		}
	/* nothing of ours still copying when the allocations are unmapped (release_all), failed
	 * or not */
	for (int d = 0; d < ndevices; d++)
		if (have[d]) {
			cu.CtxSetCurrent(devices[d].ctx);
			cu.StreamSynchronize(stream[d][0]);
			cu.StreamSynchronize(stream[d][1]);
		}
	return NULL;
}

/* -- main ------------------------------------------------------------------------------------- */

static int result(double t0, double setup, double copy_s, unsigned long long bytes, size_t nparts_done)
{
	alarm(0); /* its one line is this one (a failure after the go, the driver's teardown) */
	if (failed) {
		for (char *c = error; *c; c++)
			if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20)
				*c = ' ';
		printf("{\"ok\":false,\"error\":\"%s\"}\n", error);
		fflush(stdout);
		return 1;
	}
	printf("{\"ok\":true,\"bytes\":%llu,\"parts\":%zu,\"allocations\":%d,\"seconds\":%.6f,"
	       "\"setup_seconds\":%.6f,\"copy_seconds\":%.6f}\n", bytes, nparts_done, nallocs,
	       now() - t0, setup, copy_s);
	fflush(stdout);
	return 0;
}

/* --deadline passed (SIGALRM): one line and out; the descriptors close with the process. */
static void deadline_passed(int sig)
{
	static const char msg[] = "{\"ok\":false,\"error\":\"no part written for its deadline: "
				  "ended\"}\n";
	ssize_t r;

	(void)sig;
	r = write(STDOUT_FILENO, msg, sizeof(msg) - 1);
	(void)r;
	_exit(1);
}

/* From the go on: the memory may be held by this process alone (see the top). */
static void keep_going(void)
{
	signal(SIGTERM, SIG_IGN);
	signal(SIGINT, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
}

int main(int argc, char **argv)
{
	const char *libcuda = NULL;
	char *devices_arg = NULL;
	int plan_fd = -1, ctl_fd = -1, held[MAX_HELD], files_given = 0;
	long deadline = 0;
	double t0 = now(), t1, t2;
	struct worker workers[MAX_FILES];
	unsigned long long bytes = 0;
	size_t done = 0;
	char *text;
	size_t len;

	struct rlimit rl;

	signal(SIGPIPE, SIG_IGN); /* a torpor gone: the files are finished all the same */
	/* room for every held descriptor (thousands of PyTorch's expandable segments) */
	if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	for (int i = 1; i < argc; i += 2) {
		if (i + 1 >= argc)
			usage("an option without its value");
		if (!strcmp(argv[i], "--libcuda"))
			libcuda = argv[i + 1];
		else if (!strcmp(argv[i], "--plan"))
			plan_fd = fd_arg(argv[i + 1]);
		else if (!strcmp(argv[i], "--files"))
			nfiles = fd_list(argv[i + 1], file_fd, MAX_FILES), files_given = 1;
		else if (!strcmp(argv[i], "--held"))
			nheld = fd_list(argv[i + 1], held, MAX_HELD);
		else if (!strcmp(argv[i], "--ctl"))
			ctl_fd = fd_arg(argv[i + 1]);
		else if (!strcmp(argv[i], "--devices"))
			devices_arg = argv[i + 1];
		else if (!strcmp(argv[i], "--deadline")) {
			char *end;

			deadline = strtol(argv[i + 1], &end, 10);
			if (end == argv[i + 1] || *end || deadline <= 0 || deadline > 7 * 86400)
				usage("a deadline that is not a number of seconds");
		}
		else
			usage("an unknown option");
	}
	if (ctl_fd >= 0) {
		/* ready first: the driver loaded and each GPU's context made while the program runs;
		 * then the plan and the descriptors, from torpor over the socket */
		if (plan_fd >= 0 || files_given || nheld || !libcuda)
			usage("--ctl takes --libcuda, --devices and --deadline only");
		if (load(libcuda) || cuda_init() || (devices_arg && devices_ready(devices_arg)))
			return result(t0, 0, 0, 0, 0);
		if (!ndevices) { /* NVML named none (or a MIG instance's parent): nothing proven */
			fail("no GPU of the program's has a context here");
			return result(t0, 0, 0, 0, 0);
		}
		printf("{\"ready\":true,\"devices\":%d,\"seconds\":%.6f}\n", ndevices, now() - t0);
		fflush(stdout);
		if (receive(ctl_fd, &plan_fd, held))
			return result(t0, 0, 0, 0, 0);
		keep_going();
		if (deadline) {
			deadline_s = (unsigned)deadline;
			signal(SIGALRM, deadline_passed);
			alarm(deadline_s);
		}
		close(ctl_fd);
		t0 = now();
	} else if (!libcuda || plan_fd < 0 || !files_given || !nfiles || !nheld || devices_arg) {
		usage("every option is needed");
	} else {
		keep_going();
	}
	for (int k = 0; k < nfiles; k++) {
		struct stat st;

		if (fstat(file_fd[k], &st) < 0 || !S_ISREG(st.st_mode) ||
		    (fcntl(file_fd[k], F_GETFL) & O_ACCMODE) == O_RDONLY) {
			fail("data file %d is not a regular file open for writing", k);
			return result(t0, 0, 0, 0, 0);
		}
		file_size[k] = (unsigned long long)st.st_size;
	}
	text = read_plan(plan_fd, &len);
	if (!text || parse_plan(text, len) || (ctl_fd < 0 && (load(libcuda) || cuda_init())) ||
	    devices_find() || import_all(held)) {
		release_all();
		return result(t0, 0, 0, 0, 0);
	}
	free(text);
	t1 = now();
	for (int f = 0; f < nfiles; f++) {
		int err;

		workers[f] = (struct worker){ .file = f };
		err = pthread_create(&workers[f].thread, NULL, worker_main, &workers[f]);
		if (err) {
			fail("starting a thread: %s", strerror(err));
			for (int g = 0; g < f; g++)
				pthread_join(workers[g].thread, NULL);
			release_all();
			return result(t0, 0, 0, 0, 0);
		}
	}
	for (int f = 0; f < nfiles; f++) {
		pthread_join(workers[f].thread, NULL);
		bytes += workers[f].bytes;
		done += workers[f].parts;
	}
	alarm(0); /* done: its one line is the result's */
	t2 = now();
	release_all();
	return result(t0, t1 - t0, t2 - t1, bytes, done);
}
