/* bench/probe_held_memory.c: can a leave-running checkpoint keep a program's GPU memory on the
 * GPU, held by another process, instead of copying it out and back?
 *
 * Today (agent/src/mover.c) a leave-running checkpoint copies the program's GPU memory to the
 * host, releases it so that the driver's checkpoint (cuCheckpointProcessCheckpoint) has only
 * contexts and modules to save, lets CRIU dump, restores the driver's state and copies the
 * memory back: two PCIe copies inside the pause, whose floor at 16 GiB (1.72 s on the H200)
 * is above issue 20's 1.47 s before torpor adds anything. If a second process (torpord's
 * helper) imported the program's physical allocations (cuMemExportToShareableHandle with a
 * POSIX file descriptor) before the program released its own handles, the memory would stay
 * alive on the GPU through the driver's checkpoint, and the program would map it back at the
 * same addresses afterwards: no copy back at all, and the copy out (for the checkpoint's data)
 * could be one device-to-device snapshot into spare GPU memory, written out after the pause.
 *
 * Whether the driver allows that is not documented. This program answers it on a GPU host,
 * with three processes: the program (P) maps --gib GiB through the VMM API with an exportable
 * handle and fills it with a pattern of its offsets; the holder (H) imports P's handle; the
 * controller (this process, no context of its own, as torpor) drives P and H and calls the
 * driver's checkpoint API on P, as torpor does:
 *
 *   1. baseline   P keeps its memory mapped: lock, checkpoint, restore, unlock (timed): what
 *                 the driver does with all of it; P checks its data.
 *   2. held       H imports P's handle (and maps it); P unmaps and releases its own; lock,
 *                 checkpoint, restore, unlock; H hands the handle back (a new descriptor); P
 *                 imports it, maps it at the same address and checks every byte.
 *   2b. fdonly    P maps fresh memory and exports it; this process keeps the descriptor, no
 *                 one imports it; P unmaps and releases; lock, checkpoint, restore, unlock
 *                 (the checkpoint's time against the baseline says whether the driver copied
 *                 it); P imports the kept descriptor at the same address and checks it.
 *   2c. selfheld  P maps fresh memory, exports it and keeps the descriptor itself (the
 *                 agent's place), releases its handle; lock, checkpoint, restore, unlock (the
 *                 checkpoint's time against the baseline: whether the driver saved memory the
 *                 program holds only by a descriptor); P imports its own descriptor at the same
 *                 address, checks it, and exports the imported handle again (can the program
 *                 hand it out a second time?).
 *   3. snapshot   H copies the held memory device to device into memory of its own (timed):
 *                 what the copy out inside the pause would cost.
 *   4. drain      P maps fresh memory, exports it (this process keeps the descriptor) and
 *                 releases its handle; H imports the descriptor and copies all of it to the
 *                 host (pinned, 64 MiB at a time), checking every byte, *while* this process
 *                 locks and checkpoints P; then restore, unlock, P imports the kept descriptor
 *                 and checks it. Can the copy out leave the pause's critical path (run beside
 *                 the driver's checkpoint and CRIU's dump, in another process), at what rate,
 *                 and does it slow the driver's checkpoint (against fdonly's)?
 * Every step says what the driver answered; the first refusal ends the probe with its CUresult.
 * JSON on stdout, a line a step on stderr.
 *
 *   gcc -O2 bench/probe_held_memory.c -ldl -o /tmp/probe_held_memory
 *   /tmp/probe_held_memory --gib 4 > results/x.json
 */
#define _GNU_SOURCE
#include "../agent/src/cuda_checkpoint_types.h"
#include "../agent/src/cuda_types.h"
#define BENCH_NAME "probe"
#define BENCH_FAIL 3
#include "driver_loader.h"

#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1UL << 20)
#define PIECE (64 * MIB)
#define POSIX_FD 1 /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*CtxSynchronize)(void);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemFree)(CUdeviceptr);
	CUresult (*Granularity)(size_t *, const CUmemAllocationProp *, int);
	CUresult (*AddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
			   unsigned long long);
	CUresult (*Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	CUresult (*SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	CUresult (*Unmap)(CUdeviceptr, size_t);
	CUresult (*Release)(CUmemGenericAllocationHandle);
	CUresult (*Export)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
	CUresult (*Import)(CUmemGenericAllocationHandle *, void *, int);
	CUresult (*HtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*DtoH)(void *, CUdeviceptr, size_t);
	CUresult (*DtoD)(CUdeviceptr, CUdeviceptr, size_t);
	CUresult (*HostAlloc)(void **, size_t, unsigned);
	CUresult (*Lock)(int, CUcheckpointLockArgs *);
	CUresult (*Checkpoint)(int, CUcheckpointCheckpointArgs *);
	CUresult (*Restore)(int, CUcheckpointRestoreArgs *);
	CUresult (*Unlock)(int, CUcheckpointUnlockArgs *);
	CUresult (*GetState)(int, int *);
} cu;

static size_t bytes;
static int first_out = 1;

static CUresult missing(void)
{
	return CUDA_ERROR_NOT_SUPPORTED;
}

/* a call a driver (or the tests' fake) may lack: missing() answers for it */
static void *optional(void *lib, const char *name)
{
	void *p = dlsym(lib, name);

	return p ? p : (void *)missing;
}

static void load_driver(void)
{
	void *lib = driver_open();

	cu.Init = sym(lib, "cuInit");
	cu.DeviceGet = sym(lib, "cuDeviceGet");
	cu.PrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain");
	cu.CtxSetCurrent = sym(lib, "cuCtxSetCurrent");
	cu.CtxSynchronize = sym(lib, "cuCtxSynchronize");
	cu.MemAlloc = sym(lib, "cuMemAlloc_v2");
	cu.MemFree = sym(lib, "cuMemFree_v2");
	cu.Granularity = sym(lib, "cuMemGetAllocationGranularity");
	cu.AddressReserve = sym(lib, "cuMemAddressReserve");
	cu.Create = sym(lib, "cuMemCreate");
	cu.Map = sym(lib, "cuMemMap");
	cu.SetAccess = sym(lib, "cuMemSetAccess");
	cu.Unmap = sym(lib, "cuMemUnmap");
	cu.Release = sym(lib, "cuMemRelease");
	cu.Export = optional(lib, "cuMemExportToShareableHandle");
	cu.Import = optional(lib, "cuMemImportFromShareableHandle");
	cu.HtoD = sym(lib, "cuMemcpyHtoD_v2");
	cu.DtoH = sym(lib, "cuMemcpyDtoH_v2");
	cu.DtoD = optional(lib, "cuMemcpyDtoD_v2");
	cu.HostAlloc = optional(lib, "cuMemHostAlloc");
	cu.Lock = sym(lib, "cuCheckpointProcessLock");
	cu.Checkpoint = sym(lib, "cuCheckpointProcessCheckpoint");
	cu.Restore = sym(lib, "cuCheckpointProcessRestore");
	cu.Unlock = sym(lib, "cuCheckpointProcessUnlock");
	cu.GetState = sym(lib, "cuCheckpointProcessGetState");
}

/* -- messages between the processes: one byte of command/answer, a result, maybe a descriptor */

struct msg {
	char what;        /* the command, or the answer to it */
	int rc;           /* CUresult of the step (0: done) */
	double seconds;   /* how long the step took */
	char step[48];    /* which call answered rc */
	uint64_t arg;     /* the drain's: the program's seed */
};

static void send_msg(int sock, const struct msg *m, int fd)
{
	char ctl[CMSG_SPACE(sizeof(int))];
	struct iovec iov = { (void *)m, sizeof(*m) };
	struct msghdr h = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (fd >= 0) {
		struct cmsghdr *c;

		memset(ctl, 0, sizeof(ctl));
		h.msg_control = ctl, h.msg_controllen = sizeof(ctl);
		c = CMSG_FIRSTHDR(&h);
		c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof(int));
	}
	if (sendmsg(sock, &h, MSG_NOSIGNAL) != sizeof(*m)) {
		perror("probe: sendmsg");
		exit(3);
	}
}

/* the next message; its descriptor (or -1) in *fd if fd */
static void recv_msg(int sock, struct msg *m, int *fd)
{
	char ctl[CMSG_SPACE(sizeof(int))];
	struct iovec iov = { m, sizeof(*m) };
	struct msghdr h = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
			    .msg_controllen = sizeof(ctl) };
	struct cmsghdr *c;
	ssize_t n = recvmsg(sock, &h, MSG_CMSG_CLOEXEC);

	if (n != sizeof(*m)) {
		fprintf(stderr, "probe: a peer is gone (%zd)\n", n);
		exit(3);
	}
	if (fd) {
		*fd = -1;
		c = CMSG_FIRSTHDR(&h);
		if (c && c->cmsg_type == SCM_RIGHTS)
			memcpy(fd, CMSG_DATA(c), sizeof(int));
	}
}

static void answer(int sock, char what, CUresult rc, const char *step, double t, int fd)
{
	struct msg m = { .what = what, .rc = rc, .seconds = t };

	snprintf(m.step, sizeof(m.step), "%s", step);
	send_msg(sock, &m, fd);
}

/* A plain block, not do { } while (0): its `continue` must reach the command loop (inside a
 * do-while it only left the do-while, the command went on and answered a second time, and
 * every later answer of that process went to the command after the one it answered). */
#define TRY(call, name)                                                                        \
	{                                                                                      \
		CUresult rc_ = (call);                                                         \
		if (rc_ != CUDA_SUCCESS) {                                                     \
			answer(sock, cmd.what, rc_, name, 0, -1);                              \
			continue;                                                              \
		}                                                                              \
	}

/* -- the program and the holder ----------------------------------------------------------------- */

static CUmemAllocationProp prop(void)
{
	CUmemAllocationProp p;

	memset(&p, 0, sizeof(p));
	p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	p.requestedHandleTypes = POSIX_FD;
	p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	p.location.id = 0;
	return p;
}

static void context(void)
{
	CUdevice d;
	CUcontext c;

	if (cu.Init(0) || cu.DeviceGet(&d, 0) || cu.PrimaryCtxRetain(&c, d) || cu.CtxSetCurrent(c)) {
		fprintf(stderr, "probe: no CUDA context in pid %d\n", getpid());
		exit(3);
	}
}

/* the pattern: each 8-byte word holds its own offset, mixed with a seed */
static void pattern(uint64_t *w, size_t off, size_t n, uint64_t seed)
{
	for (size_t i = 0; i < n / 8; i++)
		w[i] = ((off + i * 8) * 0x9E3779B97F4A7C15ULL) ^ seed;
}

static CUresult fill(CUdeviceptr at, uint64_t seed, uint64_t *buf)
{
	for (size_t o = 0; o < bytes; o += PIECE) {
		CUresult rc;

		pattern(buf, o, PIECE, seed);
		if ((rc = cu.HtoD(at + o, buf, PIECE)))
			return rc;
	}
	return CUDA_SUCCESS;
}

/* 0: every byte as fill wrote it; else CUDA_ERROR_INVALID_VALUE (or the copy's CUresult) */
static CUresult check(CUdeviceptr at, uint64_t seed, uint64_t *buf, uint64_t *want)
{
	for (size_t o = 0; o < bytes; o += PIECE) {
		CUresult rc = cu.DtoH(buf, at + o, PIECE);

		if (rc)
			return rc;
		pattern(want, o, PIECE, seed);
		if (memcmp(buf, want, PIECE))
			return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

/* P: commands m(ap), e(xport) [fd out], r(elease), i(mport) [fd in], c(heck), q(uit) */
static void program(int sock)
{
	CUmemAllocationProp p = prop();
	CUmemAccessDesc access = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	CUmemGenericAllocationHandle h = 0;
	CUdeviceptr va = 0;
	uint64_t *buf = malloc(PIECE), *want = malloc(PIECE);
	uint64_t seed = 0x5eed0000ULL ^ (uint64_t)getpid();
	struct msg cmd;
	int own = -1; /* selfheld: the descriptor the program keeps of its own memory */

	context();
	for (;;) {
		int fd = -1;
		double t;

		recv_msg(sock, &cmd, &fd);
		t = now();
		switch (cmd.what) {
		case 'm': /* reserve, create, map, fill */
			TRY(cu.AddressReserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
			TRY(cu.Create(&h, bytes, &p, 0), "cuMemCreate (exportable)");
			TRY(cu.Map(va, bytes, 0, h, 0), "cuMemMap");
			TRY(cu.SetAccess(va, bytes, &access, 1), "cuMemSetAccess");
			TRY(fill(va, seed, buf), "fill");
			answer(sock, 'm', 0, "", now() - t, -1);
			break;
		case 'n': /* fresh memory of its own at the same address (an imported handle cannot
			   * be exported again), filled again */
			TRY(cu.Unmap(va, bytes), "cuMemUnmap");
			TRY(cu.Release(h), "cuMemRelease");
			TRY(cu.Create(&h, bytes, &p, 0), "cuMemCreate (exportable)");
			TRY(cu.Map(va, bytes, 0, h, 0), "cuMemMap");
			TRY(cu.SetAccess(va, bytes, &access, 1), "cuMemSetAccess");
			TRY(fill(va, seed, buf), "fill");
			answer(sock, 'n', 0, "", now() - t, -1);
			break;
		case 'e': {
			int out = -1;

			TRY(cu.Export(&out, h, POSIX_FD, 0), "cuMemExportToShareableHandle");
			answer(sock, 'e', 0, "", now() - t, out);
			close(out);
			break;
		}
		case 'r':
			TRY(cu.Unmap(va, bytes), "cuMemUnmap");
			TRY(cu.Release(h), "cuMemRelease");
			h = 0;
			answer(sock, 'r', 0, "", now() - t, -1);
			break;
		case 'i':
			if (fd < 0) {
				answer(sock, 'i', CUDA_ERROR_INVALID_VALUE, "no descriptor came", 0, -1);
				break;
			}
			TRY(cu.Import(&h, (void *)(intptr_t)fd, POSIX_FD), "cuMemImportFromShareableHandle");
			close(fd);
			TRY(cu.Map(va, bytes, 0, h, 0), "cuMemMap at the same address");
			TRY(cu.SetAccess(va, bytes, &access, 1), "cuMemSetAccess");
			answer(sock, 'i', 0, "", now() - t, -1);
			break;
		case 'c':
			TRY(check(va, seed, buf, want), "every byte as written");
			answer(sock, 'c', 0, "", now() - t, -1);
			break;
		case 'K': /* export and keep the descriptor here */
			TRY(cu.Export(&own, h, POSIX_FD, 0), "cuMemExportToShareableHandle");
			answer(sock, 'K', 0, "", now() - t, -1);
			break;
		case 'J': /* import the kept descriptor at the same address */
			if (own < 0) {
				answer(sock, 'J', CUDA_ERROR_INVALID_VALUE, "no descriptor kept", 0, -1);
				break;
			}
			TRY(cu.Import(&h, (void *)(intptr_t)own, POSIX_FD),
			    "cuMemImportFromShareableHandle (its own)");
			close(own);
			own = -1;
			TRY(cu.Map(va, bytes, 0, h, 0), "cuMemMap at the same address");
			TRY(cu.SetAccess(va, bytes, &access, 1), "cuMemSetAccess");
			answer(sock, 'J', 0, "", now() - t, -1);
			break;
		case 'x': { /* the imported handle exported again, in the same process */
			int out = -1;

			TRY(cu.Export(&out, h, POSIX_FD, 0),
			    "cuMemExportToShareableHandle (imported)");
			answer(sock, 'x', 0, "", now() - t, -1);
			close(out);
			break;
		}
		default:
			answer(sock, cmd.what, 0, "", 0, -1);
			_exit(0);
		}
	}
}

/* H's drain: every byte of the memory at va to the host, 64 MiB at a time through a pinned
 * buffer (pageable where the driver has no cuMemHostAlloc), each piece checked against the
 * program's pattern; *copy_s: the copies' seconds alone (not the checks') */
static CUresult drain(CUdeviceptr va, uint64_t seed, double *copy_s)
{
	static uint64_t *pinned, *want;
	CUresult rc;

	*copy_s = 0;
	if (!pinned && cu.HostAlloc((void **)&pinned, PIECE, 0))
		pinned = malloc(PIECE);
	if (!want)
		want = malloc(PIECE);
	if (!pinned || !want)
		return CUDA_ERROR_OUT_OF_MEMORY;
	for (size_t o = 0; o < bytes; o += PIECE) {
		double t = now();

		if ((rc = cu.DtoH(pinned, va + o, PIECE)))
			return rc;
		*copy_s += now() - t;
		pattern(want, o, PIECE, seed);
		if (memcmp(pinned, want, PIECE))
			return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

/* H: commands i(mport) [fd in], s(napshot), e(xport) [fd out], d(rain) [fd in], q(uit) */
static void holder(int sock)
{
	CUmemAccessDesc access = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	CUmemGenericAllocationHandle h = 0, dh = 0;
	CUdeviceptr va = 0, copy = 0, dva = 0;
	struct msg cmd;
	double copy_s;

	context();
	for (;;) {
		int fd = -1;
		double t;

		recv_msg(sock, &cmd, &fd);
		t = now();
		switch (cmd.what) {
		case 'i':
			if (fd < 0) {
				answer(sock, 'i', CUDA_ERROR_INVALID_VALUE, "no descriptor came", 0, -1);
				break;
			}
			TRY(cu.Import(&h, (void *)(intptr_t)fd, POSIX_FD), "cuMemImportFromShareableHandle");
			close(fd);
			TRY(cu.AddressReserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
			TRY(cu.Map(va, bytes, 0, h, 0), "cuMemMap");
			TRY(cu.SetAccess(va, bytes, &access, 1), "cuMemSetAccess");
			answer(sock, 'i', 0, "", now() - t, -1);
			break;
		case 's':
			if (!copy)
				TRY(cu.MemAlloc(&copy, bytes), "cuMemAlloc (the snapshot)");
			t = now();
			TRY(cu.DtoD(copy, va, bytes), "cuMemcpyDtoD");
			TRY(cu.CtxSynchronize(), "cuCtxSynchronize");
			answer(sock, 's', 0, "", now() - t, -1);
			break;
		case 'e': {
			int out = -1;

			TRY(cu.Export(&out, h, POSIX_FD, 0), "cuMemExportToShareableHandle (held)");
			answer(sock, 'e', 0, "", now() - t, out);
			close(out);
			break;
		}
		case 'd': /* import at an address of its own, copy all of it out, let it go */
			if (fd < 0) {
				answer(sock, 'd', CUDA_ERROR_INVALID_VALUE, "no descriptor came", 0, -1);
				break;
			}
			TRY(cu.Import(&dh, (void *)(intptr_t)fd, POSIX_FD),
			    "cuMemImportFromShareableHandle (drain)");
			close(fd);
			if (!dva)
				TRY(cu.AddressReserve(&dva, bytes, 0, 0, 0), "cuMemAddressReserve (drain)");
			TRY(cu.Map(dva, bytes, 0, dh, 0), "cuMemMap (drain)");
			TRY(cu.SetAccess(dva, bytes, &access, 1), "cuMemSetAccess (drain)");
			TRY(drain(dva, cmd.arg, &copy_s), "every byte to the host, as written");
			TRY(cu.Unmap(dva, bytes), "cuMemUnmap (drain)");
			TRY(cu.Release(dh), "cuMemRelease (drain)");
			answer(sock, 'd', 0, "", copy_s, -1);
			break;
		default:
			answer(sock, cmd.what, 0, "", 0, -1);
			_exit(0);
		}
	}
}

/* -- the controller ------------------------------------------------------------------------------ */

static void out_json(const char *phase, const char *step, CUresult rc, double t)
{
	printf("%s    {\"phase\": \"%s\", \"step\": \"%s\", \"cuda_result\": %d, \"seconds\": %.4f}",
	       first_out ? "" : ",\n", phase, step, rc, t);
	first_out = 0;
	fflush(stdout);
	fprintf(stderr, "%-9s %-44s %s (%.3f s)\n", phase, step, rc ? "REFUSED" : "ok", t);
	if (rc)
		fprintf(stderr, "          CUresult %d\n", rc);
}

static int finish(int code, const char *verdict)
{
	printf("\n  ], \"verdict\": \"%s\"}\n", verdict);
	fprintf(stderr, "verdict: %s\n", verdict);
	return code;
}

/* one command to a process; its answer logged; its descriptor (if any) in *fd */
static CUresult ask(int sock, const char *phase, char what, int fd_in, int *fd_out, const char *label)
{
	struct msg m = { .what = what };

	send_msg(sock, &m, fd_in);
	recv_msg(sock, &m, fd_out);
	out_json(phase, m.rc ? m.step : label, m.rc, m.seconds);
	return m.rc;
}

/* half of the driver's checkpoint of pid and back, each call timed: lock and checkpoint
 * (out), or restore and unlock */
static CUresult half_trip(const char *phase, int pid, int out)
{
	CUcheckpointLockArgs lock = { .timeoutMs = 30000 };
	CUcheckpointCheckpointArgs ck;
	CUcheckpointRestoreArgs rs;
	CUcheckpointUnlockArgs un;
	CUresult rc;
	double t;

	memset(&ck, 0, sizeof(ck)), memset(&rs, 0, sizeof(rs)), memset(&un, 0, sizeof(un));
#define TIMED(call, name)                                                                      \
	t = now();                                                                             \
	rc = (call);                                                                           \
	out_json(phase, name, rc, now() - t);                                                  \
	if (rc)                                                                                \
		return rc;
	if (out) {
		TIMED(cu.Lock(pid, &lock), "cuCheckpointProcessLock");
		TIMED(cu.Checkpoint(pid, &ck), "cuCheckpointProcessCheckpoint");
	} else {
		TIMED(cu.Restore(pid, &rs), "cuCheckpointProcessRestore");
		TIMED(cu.Unlock(pid, &un), "cuCheckpointProcessUnlock");
	}
#undef TIMED
	return CUDA_SUCCESS;
}

static CUresult round_trip(const char *phase, int pid)
{
	CUresult rc = half_trip(phase, pid, 1);

	return rc ? rc : half_trip(phase, pid, 0);
}

/* 4. the drain: H copies the program's released memory out (kept: its descriptor, which the
 * program takes back afterwards) while the driver locks and checkpoints the program. What it
 * found, in a sentence. */
static const char *drain_phase(int psock, int hsock, int pid)
{
	struct msg m = { .what = 'd', .arg = 0x5eed0000ULL ^ (uint64_t)pid };
	int kept = -1;
	CUresult ck;
	double t;
	const char *said, *xor = getenv("PROBE_DRAIN_SEED_XOR");

	if (xor) /* the tests': the holder told another pattern, as for another allocation */
		m.arg ^= strtoull(xor, NULL, 0);
	if (ask(psock, "drain", 'n', -1, NULL, "program maps fresh memory of its own"))
		return "the program could not map fresh memory";
	if (ask(psock, "drain", 'e', -1, &kept, "program exports its handle") || kept < 0)
		return "the handle could not be exported";
	if (ask(psock, "drain", 'r', -1, NULL, "program unmaps and releases its own")) {
		close(kept);
		return "the program could not release its handle";
	}
	t = now();
	send_msg(hsock, &m, kept);            /* H starts; the driver's half runs meanwhile */
	ck = half_trip("drain", pid, 1);
	out_json("drain", "(the lock and checkpoint ended, seconds after the drain began)", 0,
		 now() - t);
	recv_msg(hsock, &m, NULL);
	out_json("drain", m.rc ? m.step : "holder copied all of it out beside them (copy seconds)",
		 m.rc, m.seconds);
	out_json("drain", "(the drain ended, seconds after it began)", 0, now() - t);
	said = m.rc ? "the holder could not copy the released memory out" : NULL;
	if (ck) {
		close(kept);
		return "the driver refused the checkpoint beside the drain";
	}
	if (half_trip("drain", pid, 0)) {
		close(kept);
		return "the driver refused the restore after the drain";
	}
	if (ask(psock, "drain", 'i', kept, NULL, "program imports the kept descriptor")) {
		close(kept);
		return "the kept descriptor does not import after the drain";
	}
	close(kept);
	if (ask(psock, "drain", 'c', -1, NULL, "every byte back"))
		return "the memory came back changed";
	return said ? said : "another process copies released memory out while the driver "
		"checkpoints its program (the steps' times say at what rate and at what cost)";
}

int main(int argc, char **argv)
{
	double gib = 4;
	int ps[2], hs[2], pid, hid, fd = -1, kept = -1;
	const char *how = "", *fdonly, *selfheld, *drained;
	char verdict[640];

	for (int i = 1; i < argc; i += 2) {
		if (i + 1 < argc && !strcmp(argv[i], "--gib"))
			gib = atof(argv[i + 1]);
		else {
			fprintf(stderr, "usage: probe_held_memory [--gib G]\n");
			return 2;
		}
	}
	bytes = ((size_t)(gib * (1UL << 30)) + PIECE - 1) / PIECE * PIECE;
	if (!bytes || gib <= 0) {
		fprintf(stderr, "usage: probe_held_memory [--gib G]\n");
		return 2;
	}
	/* the children first: nothing of the driver may be loaded across a fork */
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ps) ||
	    socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, hs))
		return perror("socketpair"), 3;
	if ((pid = fork()) == 0) {
		close(ps[0]), close(hs[0]), close(hs[1]);
		load_driver();
		program(ps[1]);
	}
	if ((hid = fork()) == 0) {
		close(ps[0]), close(ps[1]), close(hs[0]);
		load_driver();
		holder(hs[1]);
	}
	close(ps[1]), close(hs[1]);
	load_driver();
	if (cu.Init(0))
		return fprintf(stderr, "probe: cuInit failed in the controller\n"), 3;
	printf("{\"probe\": \"held_memory\", \"bytes\": %zu, \"steps\": [\n", bytes);

	/* 1. baseline: the driver saves all of it */
	if (ask(ps[0], "baseline", 'm', -1, NULL, "map and fill (exportable)") ||
	    round_trip("baseline", pid) || ask(ps[0], "baseline", 'c', -1, NULL, "every byte back"))
		return finish(1, "the baseline failed: the probe cannot say anything");
	/* 2. held by H through the driver's checkpoint; the program's own export descriptor is kept
	 * too (here, in the controller: torpord's place), the second way to hand the memory back */
	if (ask(ps[0], "held", 'e', -1, &kept, "program exports its handle") || kept < 0)
		return finish(1, "the program's handle cannot be exported");
	if (ask(hs[0], "held", 'i', kept, NULL, "holder imports and maps it"))
		return finish(1, "another process cannot import the program's memory");
	if (ask(ps[0], "held", 'r', -1, NULL, "program unmaps and releases its own"))
		return finish(1, "the program cannot release its handle");
	if (round_trip("held", pid))
		return finish(1, "the driver refuses a checkpoint of a program whose memory another "
			      "process holds");
	if (!ask(hs[0], "held", 'e', -1, &fd, "holder exports the held handle") && fd >= 0) {
		how = "the holder's own export";
		if (ask(ps[0], "held", 'i', fd, NULL, "program imports it at the same address"))
			return finish(1, "the restored program cannot map its memory back");
		close(fd);
	} else {
		how = "the descriptor exported before the checkpoint";
		if (ask(ps[0], "held", 'i', kept, NULL,
			"program imports its pre-checkpoint descriptor at the same address"))
			return finish(1, "the held handle cannot be handed back: the holder cannot export "
				      "it and the descriptor from before the checkpoint does not import");
	}
	close(kept);
	kept = -1;
	if (ask(ps[0], "held", 'c', -1, NULL, "every byte back, nothing copied"))
		return finish(1, "the memory came back changed");
	/* 2b. held by a descriptor alone: the controller (torpor's place, no CUDA context) keeps
	 * the program's export descriptor and nobody imports it while the program has released
	 * its handle. cuMemRelease's documentation says the memory lives while a shareable
	 * counterpart does; whether the driver's checkpoint then leaves it out (its time against
	 * the baseline says) and the program maps it back intact is this phase's answer. */
	fdonly = "not tried";
	if (ask(ps[0], "fdonly", 'n', -1, NULL, "program maps fresh memory of its own"))
		fdonly = "the program could not map fresh memory";
	else if (ask(ps[0], "fdonly", 'e', -1, &kept, "program exports its handle") || kept < 0)
		fdonly = "the handle could not be exported a second time";
	else if (ask(ps[0], "fdonly", 'r', -1, NULL, "program unmaps and releases its own"))
		fdonly = "the program could not release its handle";
	else if (round_trip("fdonly", pid))
		fdonly = "the driver refused the checkpoint";
	else if (ask(ps[0], "fdonly", 'i', kept, NULL, "program imports the kept descriptor"))
		fdonly = "the kept descriptor does not import after the checkpoint";
	else if (ask(ps[0], "fdonly", 'c', -1, NULL, "every byte back, nothing copied"))
		fdonly = "the memory came back changed";
	else
		fdonly = "a descriptor alone holds it";
	if (kept >= 0)
		close(kept);
	/* 2c. held by the program itself: the agent would keep its descriptors (no hand-over to
	 * torpor) if the driver's checkpoint leaves such memory out too */
	if (ask(ps[0], "selfheld", 'n', -1, NULL, "program maps fresh memory of its own"))
		selfheld = "the program could not map fresh memory";
	else if (ask(ps[0], "selfheld", 'K', -1, NULL, "program exports and keeps the descriptor"))
		selfheld = "the handle could not be exported";
	else if (ask(ps[0], "selfheld", 'r', -1, NULL, "program unmaps and releases its own"))
		selfheld = "the program could not release its handle";
	else if (round_trip("selfheld", pid))
		selfheld = "the driver refused the checkpoint";
	else if (ask(ps[0], "selfheld", 'J', -1, NULL, "program imports its own descriptor"))
		selfheld = "its own descriptor does not import after the checkpoint";
	else if (ask(ps[0], "selfheld", 'c', -1, NULL, "every byte back, nothing copied"))
		selfheld = "the memory came back changed";
	else
		selfheld = ask(ps[0], "selfheld", 'x', -1, NULL, "program exports the imported "
			       "handle again") ? "its own descriptor holds it (the checkpoint's time "
			       "says whether the driver saved it); the imported handle does not export "
			       "again" : "its own descriptor holds it (the checkpoint's time says whether "
			       "the driver saved it); the imported handle exports again";
	/* 3. what a snapshot inside the pause would cost */
	ask(hs[0], "snapshot", 's', -1, NULL, "device-to-device copy of all of it");
	drained = drain_phase(ps[0], hs[0], pid);
	ask(ps[0], "done", 'q', -1, NULL, "program ends");
	ask(hs[0], "done", 'q', -1, NULL, "holder ends");
	waitpid(pid, NULL, 0), waitpid(hid, NULL, 0);
	snprintf(verdict, sizeof(verdict), "held memory survives the driver's checkpoint: no copy "
		 "back needed (handed back by %s); without a holder: %s; held by the program "
		 "itself: %s; drain: %s", how, fdonly, selfheld, drained);
	return finish(0, verdict);
}
