/* A fake libcuda.so.1 for tests without a GPU: the driver calls a test program and torpor's
 * agent need, and the six cuCheckpointProcess* calls with the exact ABI of cuda.h (CUDA 12.8+),
 * acting on the per-process files under $FAKE_CUDA_STATE_DIR (see fake_common.h for the layout).
 *
 * Semantics follow the CUDA driver API documentation, "CUDA Checkpointing":
 *   lock        RUNNING      -> LOCKED        (hang/lock: waits timeoutMs, CUDA_ERROR_TIMEOUT)
 *   checkpoint  LOCKED       -> CHECKPOINTED  (the process holds no GPU memory any more)
 *   restore     CHECKPOINTED -> LOCKED        (gpuPairs must name every checkpointed GPU; each
 *                                              new UUID must exist; the new GPU needs room)
 *   unlock      LOCKED       -> RUNNING
 * A call in the wrong state returns CUDA_ERROR_ILLEGAL_STATE. A pid that is not a live CUDA
 * process returns CUDA_ERROR_INVALID_VALUE: the documented return values of these calls are
 * SUCCESS, INVALID_VALUE, NOT_INITIALIZED, ILLEGAL_STATE and NOT_SUPPORTED, and the pid is
 * the argument that is wrong. Non-zero reserved fields also return CUDA_ERROR_INVALID_VALUE
 * ("must be zeroed").
 *
 * In the target process, every call that works on its context (memory, copies, streams,
 * events, synchronization; not the device queries, push/pop or cuGetProcAddress) blocks while
 * the process is LOCKED or CHECKPOINTED, as the real driver's API locks do.
 *
 * Device memory holds data: a device pointer is an address in the program's own memory, so a
 * CRIU dump carries it as the real driver's checkpoint carries device memory in host memory
 * (see "device memory" below). Copies are done when called, also the *Async ones.
 *
 * Processes are proc/<key> entries (fk_key_of): the caller passes a pid as its /proc numbers
 * it (the host pid, for a program in a container), and the entry is that process's key: the
 * pid itself, or "<FAKE_CUDA_SCOPE>.<innermost pid>" for a scoped program. Faults (fail/,
 * hang/, delay/) and calls.log go by the pid the caller passed; cuCheckpointProcess-
 * GetRestoreThreadId returns it too. The program's own calls take fail/ and delay/ files named
 * after their exported names (fail/cuMemcpyDtoHAsync_v2) and go by its getpid().
 */
#include "fake_common.h"
#include "cuda_types.h" /* the agent's: the one copy of the driver ABI it and this fake share */
#include "cuda_checkpoint_types.h"

#include <pthread.h>
#include <sys/mman.h>

/* The values beyond cuda_types.h's that the fake answers with or is asked about. */
enum {
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
    CU_MEMORYTYPE_HOST = 1,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
};

/* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: the one shareable handle type this fake has. */
#define FK_POSIX_FD 1

/* The granularity of the VMM calls (cuMemGetAllocationGranularity), as on current GPUs. */
#define FK_GRANULARITY ((size_t)2 << 20)

#define EXPORT __attribute__((visibility("default")))

enum {
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};

static const struct { int code; const char *name, *text; } ERRORS[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int g_inited;         /* cuInit succeeded in this process */
static int g_registered;     /* this process made a context (it is a "CUDA process") */

/* -- plain driver calls --------------------------------------------------------------------- */

EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == error) {
            *pStr = ERRORS[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == error) {
            *pStr = ERRORS[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDriverGetVersion(int *driverVersion)
{
    char path[4096], buf[64];
    const char *dir = fk_dir();
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = 13000;
    if (dir) {
        snprintf(path, sizeof path, "%s/cuda_version", dir);
        if (fk_read_file(path, buf, sizeof buf) > 0 && atoi(buf) > 0)
            *driverVersion = atoi(buf);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuInit(unsigned int flags)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir = fk_dir();
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dir || fk_read_gpus(dir, gpus, FK_MAX_GPUS) <= 0)
        return CUDA_ERROR_NO_DEVICE;
    g_inited = 1;
    return CUDA_SUCCESS;
}

/* Checks init and reads the GPUs; returns CUDA_SUCCESS or the error to return. */
static CUresult need_gpus(const char **dir, fk_gpu *gpus, int *n)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!(*dir = fk_dir()) || (*n = fk_read_gpus(*dir, gpus, FK_MAX_GPUS)) <= 0)
        return CUDA_ERROR_NO_DEVICE;
    return CUDA_SUCCESS;
}

/* need_gpus, and dev one of them. */
static CUresult need_device(CUdevice dev, fk_gpu *gpus)
{
    const char *dir;
    int n = 0;
    CUresult rc = need_gpus(&dir, gpus, &n);
    if (rc == CUDA_SUCCESS && (dev < 0 || dev >= n))
        rc = CUDA_ERROR_INVALID_DEVICE;
    return rc;
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir;
    int n = 0;
    CUresult rc;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_gpus(&dir, gpus, &n)) != CUDA_SUCCESS)
        return rc;
    *count = n;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    fk_gpu gpus[FK_MAX_GPUS];
    CUresult rc;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_device(ordinal, gpus)) != CUDA_SUCCESS)
        return rc;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    fk_gpu gpus[FK_MAX_GPUS];
    CUresult rc;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_device(dev, gpus)) != CUDA_SUCCESS)
        return rc;
    snprintf(name, (size_t)len, "%s", gpus[dev].name);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    fk_gpu gpus[FK_MAX_GPUS];
    unsigned char b[16];
    CUresult rc;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_device(dev, gpus)) != CUDA_SUCCESS)
        return rc;
    if (fk_uuid_parse(gpus[dev].uuid, b) != 0)
        memset(b, 0, sizeof b);
    memcpy(uuid->bytes, b, 16);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid(uuid, dev);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    fk_gpu gpus[FK_MAX_GPUS];
    CUresult rc;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_device(dev, gpus)) != CUDA_SUCCESS)
        return rc;
    *bytes = (size_t)gpus[dev].total;
    return CUDA_SUCCESS;
}
/* -- faults --------------------------------------------------------------------------------- */

/* Reads "$dir/<kind>/<call>" = "<value> [pid]"; returns 1 when it applies to pid. */
static int fault(const char *dir, const char *kind, const char *call, int pid, long *value)
{
    char path[4096], buf[256], *end;
    long v, only;
    snprintf(path, sizeof path, "%s/%s/%s", dir, kind, call);
    if (fk_read_file(path, buf, sizeof buf) < 0)
        return 0;
    v = strtol(buf, &end, 0);
    if (end == buf)
        v = 0;
    only = strtol(end, &end, 10);
    if (only > 0 && only != pid)
        return 0;
    if (value)
        *value = v;
    return 1;
}

/* fail/<call>: "<CUresult> [pid] [after=<n>] [times=<k>]" (fake_common.h); after and times
 * are -1 when not given. 0, or -1 when a count is not a number (the file is then ignored). */
typedef struct { long rc, pid, after, times; } fk_fail;

static int fail_parse(char *buf, fk_fail *f)
{
    char *tok, *save = NULL, *end;
    int first = 1;
    f->rc = f->pid = 0;
    f->after = f->times = -1;
    for (tok = strtok_r(buf, " \t\r\n", &save); tok; tok = strtok_r(NULL, " \t\r\n", &save)) {
        if (!strncmp(tok, "after=", 6) || !strncmp(tok, "times=", 6)) {
            long v = strtol(tok + 6, &end, 10);
            if (end == tok + 6 || *end || v < 0)
                return -1;
            *(tok[0] == 'a' ? &f->after : &f->times) = v;
        } else if (first) {
            f->rc = strtol(tok, NULL, 0); /* not a number: 0, as before the counts existed */
        } else {
            f->pid = strtol(tok, NULL, 10);
        }
        first = 0;
    }
    return 0;
}

/* Does this call of `call` (by `pid`) fail by fail/<call>? Then 1, with the CUresult in *rc.
 * The counts are kept in the file itself, counted down under the state directory's lock, so
 * every thread and process making the call shares them: after=<n> lets n calls through first
 * (whatever they return), times=<k> fails k calls and then no more (the file stays, spent). */
static int injected(const char *dir, const char *call, int pid, CUresult *rc)
{
    char path[4096], buf[256], line[256];
    fk_fail f;
    int fd, fails = 0, changed = 0, len;
    if (!dir)
        return 0;
    snprintf(path, sizeof path, "%s/fail/%s", dir, call);
    if (fk_read_file(path, buf, sizeof buf) < 0 || fail_parse(buf, &f) != 0 ||
        (f.pid > 0 && f.pid != pid))
        return 0;
    if (f.after < 0 && f.times < 0) {
        *rc = (CUresult)f.rc;
        return 1;
    }
    fd = fk_lock(dir);
    /* read again under the lock: another call may have counted meanwhile */
    if (fk_read_file(path, buf, sizeof buf) >= 0 && fail_parse(buf, &f) == 0 &&
        !(f.pid > 0 && f.pid != pid)) {
        if (f.after > 0) {
            f.after--; /* this one goes through */
            changed = 1;
        } else if (f.times != 0) {
            fails = 1;
            if (f.times > 0) {
                f.times--;
                changed = 1;
            }
        }
        if (changed) {
            len = snprintf(line, sizeof line, "%ld", f.rc);
            if (f.pid > 0)
                len += snprintf(line + len, sizeof line - len, " %ld", f.pid);
            if (f.after >= 0)
                len += snprintf(line + len, sizeof line - len, " after=%ld", f.after);
            if (f.times >= 0)
                len += snprintf(line + len, sizeof line - len, " times=%ld", f.times);
            snprintf(line + len, sizeof line - len, "\n");
            fk_write_atomic(path, line);
        }
    }
    fk_unlock(fd);
    if (fails)
        *rc = (CUresult)f.rc;
    return fails;
}

/* Sleeps as delay/<call> says for this process. */
static void call_delay(const char *call)
{
    const char *dir = fk_dir();
    long v;
    if (dir && fault(dir, "delay", call, (int)getpid(), &v) && v > 0)
        fk_sleep_ms(v);
}

/* -- contexts and the API lock -------------------------------------------------------------- */

/* The current-context stack of the calling thread: cuCtxCreate_v2 pushes (a full stack gets
 * its top replaced), cuCtxPush/PopCurrent_v2 and cuCtxSetCurrent work on it. */
static __thread CUcontext t_ctx_stack[16];
static __thread int t_ctx_top;

/* Calls that act in the calling thread's current context, as the driver's do: none current is
 * CUDA_ERROR_INVALID_CONTEXT (a new thread has none until it makes one current). The older
 * calls of this fake (cuMemAlloc_v2, copies) do not check, as tests rely on. */
#define NEED_CURRENT()                            \
    do {                                          \
        if (!t_ctx_top)                           \
            return CUDA_ERROR_INVALID_CONTEXT;    \
    } while (0)
static __thread int t_in_primary; /* in cuDevicePrimaryCtxRetain, which makes nothing current */

/* A context of this fake is 0xc0de0000 + its device: that device, else -1. */
static int ctx_device(CUcontext ctx)
{
    uintptr_t v = (uintptr_t)ctx;
    return v >= 0xc0de0000u && v < 0xc0de0000u + FK_MAX_GPUS ? (int)(v - 0xc0de0000u) : -1;
}

/* Registers the calling process as a CUDA process on GPU `dev`; the context becomes current
 * on this thread, as the driver's "the newly created context" does. */
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    fk_gpu gpus[FK_MAX_GPUS];
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    int n = 0, fd;
    CUresult rc;
    (void)flags;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_gpus(&dir, gpus, &n)) != CUDA_SUCCESS)
        return rc;
    if (dev < 0 || dev >= n)
        return CUDA_ERROR_INVALID_DEVICE;
    fk_key_of(0, key, sizeof key);
    fd = fk_lock(dir);
    if (!g_registered || fk_proc_read(dir, key, &p) != 0) {
        /* A fresh process (a stale file of a recycled pid is overwritten). One GPU a process:
         * a second context keeps the first GPU. */
        memset(&p, 0, sizeof p);
        p.state = FK_RUNNING;
        snprintf(p.gpu, sizeof p.gpu, "%s", gpus[dev].uuid);
    }
    p.pidns = fk_pidns(0);
    rc = fk_proc_write(dir, key, &p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
    fk_unlock(fd);
    if (rc == CUDA_SUCCESS) {
        g_registered = 1;
        *pctx = (CUcontext)(uintptr_t)(0xc0de0000u + (unsigned)dev);
        if (!t_in_primary) {
            if (t_ctx_top == (int)(sizeof t_ctx_stack / sizeof t_ctx_stack[0]))
                t_ctx_top--;
            t_ctx_stack[t_ctx_top++] = *pctx;
        }
    }
    return rc;
}

/* Blocks while this process (its entry `key`) is LOCKED or CHECKPOINTED (its API locks are
 * held). The key is computed once a call; it survives a CRIU restore met while waiting. */
static CUresult wait_running(const char **dirp, fk_proc *p, char *key, size_t size)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!g_registered)
        return CUDA_ERROR_INVALID_CONTEXT;
    fk_key_of(0, key, size);
    for (;;) {
        const char *dir = fk_dir();
        if (!dir || fk_proc_read(dir, key, p) != 0)
            return CUDA_ERROR_DEINITIALIZED; /* the fake host went away */
        if (fk_adopt(p, fk_pidns(0))) {
            int fd = fk_lock(dir);
            if (fk_proc_read(dir, key, p) == 0 && fk_adopt(p, fk_pidns(0)))
                fk_proc_write(dir, key, p);
            fk_unlock(fd);
        }
        if (p->state == FK_RUNNING) {
            *dirp = dir;
            return CUDA_SUCCESS;
        }
        if (p->state == FK_FAILED)
            return CUDA_ERROR_ILLEGAL_STATE;
        fk_sleep_ms(5);
    }
}

/* What enter() saw: the state directory and this process's entry. */
typedef struct {
    const char *dir;
    char key[FK_KEY_LEN];
    fk_proc p;
} fk_call;

/* The start of every call the program makes on its context: delay/<call>, the API lock
 * (wait_running), then fail/<call>. CUDA_SUCCESS: go on. */
static CUresult enter(const char *call, fk_call *c)
{
    CUresult rc;
    call_delay(call);
    if ((rc = wait_running(&c->dir, &c->p, c->key, sizeof c->key)) != CUDA_SUCCESS)
        return rc;
    return injected(c->dir, call, (int)getpid(), &rc) ? rc : CUDA_SUCCESS;
}

/* enter() for a call that also works before the process has a context (cuCtxGetCurrent,
 * cuMemGetAllocationGranularity): it waits only once there is one. */
static CUresult enter_any(const char *call)
{
    fk_call c;
    CUresult rc;
    if (g_registered)
        return enter(call, &c);
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    call_delay(call);
    return injected(fk_dir(), call, (int)getpid(), &rc) ? rc : CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void)
{
    fk_call c;
    return enter("cuCtxSynchronize", &c);
}

/* -- device memory ---------------------------------------------------------------------------
 * A device address is an address of this process, so device memory keeps what is written to
 * it, and a CRIU dump carries it as the driver's checkpoint carries device memory (in host
 * memory):
 *   cuMemAlloc_v2        private anonymous memory, MAP_NORESERVE: untouched pages cost
 *                        nothing, so a fake allocation of 100 GiB is fine;
 *   cuMemAddressReserve  a PROT_NONE MAP_NORESERVE range: addresses, no memory;
 *   cuMemCreate          a handle: a memfd of its size, which holds its data (named
 *                        fake-cuda-mem.<device>: an import finds its device again);
 *   cuMemExportToShareableHandle  a dup of that memfd (POSIX_FD only): the memory lives
 *                        while any descriptor of it does, released handle or not, as the
 *                        driver's does while a shareable handle is open;
 *   cuMemImportFromShareableHandle  a new handle over a dup of such a descriptor;
 *   cuMemMap             the memfd mapped MAP_SHARED|MAP_FIXED into a reservation, PROT_NONE
 *                        until cuMemSetAccess. Unmapped and mapped again, a handle still has
 *                        its data; a new handle starts zeroed.
 * A copy checks its device range first: one live allocation, or mappings side by side whose
 * access allows it; anything else is CUDA_ERROR_INVALID_VALUE, as for memory that is not the
 * program's. Physical memory (allocations, handles) counts in proc/<key> mem against the
 * GPU's total (CUDA_ERROR_OUT_OF_MEMORY past it): a handle's until it is released and
 * unmapped everywhere, when the driver frees it. One GPU a process: a location's device id is
 * checked, the memory counts on the process's GPU.
 * The tables are the process's own, under one read-write lock: copies read (several at once,
 * memcpy included, so that memory cannot go away under one), everything else writes.
 */

typedef struct fk_handle {
    CUmemGenericAllocationHandle id;
    int fd; /* the memfd: its data */
    size_t size;
    CUmemAllocationProp prop;
    int refs;               /* cuMemCreate, each cuMemRetainAllocationHandle; -1 a cuMemRelease */
    int maps;               /* its mappings */
    int imported;           /* cuMemImportFromShareableHandle's: not exported again */
    struct fk_handle *next; /* on the way out: a list of handles to free */
} fk_handle;

enum { FK_ALLOC, FK_MAP };

/* Device memory the program can address: an allocation (cuMemAlloc_v2) or a mapping. */
typedef struct {
    CUdeviceptr ptr;
    size_t size;  /* as asked for; an allocation's mmap() is rounded up to whole pages */
    int kind;     /* FK_ALLOC, FK_MAP */
    int prot;     /* CU_MEM_ACCESS_FLAGS_PROT_*: an allocation's is READWRITE */
    fk_handle *h; /* FK_MAP: what is mapped */
} fk_range;

/* An address range: a reservation, or host memory (cuMemHostAlloc's or registered). */
typedef struct {
    uintptr_t ptr;
    size_t size;
    int registered; /* host memory: cuMemHostRegister_v2's, not cuMemHostAlloc's */
} fk_span;

static pthread_rwlock_t g_mem = PTHREAD_RWLOCK_INITIALIZER;
static fk_range *g_ranges; /* sorted by ptr; never overlapping */
static size_t g_nranges, g_ranges_cap;
static fk_span *g_reserved, *g_host;
static size_t g_nreserved, g_reserved_cap, g_nhost, g_host_cap;
static fk_handle **g_handles;
static size_t g_nhandles, g_handles_cap;
static CUmemGenericAllocationHandle g_next_handle = 0x1000;

/* Room for one more element in a growable array: the array (maybe moved), or NULL. */
static void *grow(void *arr, size_t n, size_t *cap, size_t elem)
{
    size_t c = *cap ? 2 * *cap : 64;
    void *a;
    if (n < *cap)
        return arr;
    if (!(a = realloc(arr, c * elem)))
        return NULL;
    *cap = c;
    return a;
}

static size_t page_size(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

/* The range holding address a (its index), or -1. Under g_mem. */
static long range_at(CUdeviceptr a)
{
    size_t lo = 0, hi = g_nranges, mid;
    while (lo < hi) {
        mid = lo + (hi - lo) / 2;
        if (g_ranges[mid].ptr <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0 || a - g_ranges[lo - 1].ptr >= g_ranges[lo - 1].size)
        return -1;
    return (long)(lo - 1);
}

/* Does any range share an address with [ptr, ptr + size)? Under g_mem. */
static int range_overlaps(CUdeviceptr ptr, size_t size)
{
    for (size_t i = 0; i < g_nranges; i++)
        if (g_ranges[i].ptr < ptr + size && ptr < g_ranges[i].ptr + g_ranges[i].size)
            return 1;
    return 0;
}

/* 0, or -1 when out of memory. Under g_mem, written. */
static int range_add(fk_range r)
{
    fk_range *a = grow(g_ranges, g_nranges, &g_ranges_cap, sizeof *a);
    size_t i;
    if (!a)
        return -1;
    g_ranges = a;
    for (i = g_nranges; i > 0 && g_ranges[i - 1].ptr > r.ptr; i--)
        g_ranges[i] = g_ranges[i - 1];
    g_ranges[i] = r;
    g_nranges++;
    return 0;
}

static void range_del(size_t i, size_t count)
{
    memmove(&g_ranges[i], &g_ranges[i + count], (g_nranges - i - count) * sizeof *g_ranges);
    g_nranges -= count;
}

/* The mappings that make up [ptr, ptr + size) exactly, side by side: the index of the first
 * and their count, or -1. Under g_mem. */
static long maps_exactly(CUdeviceptr ptr, size_t size, size_t *count)
{
    CUdeviceptr at = ptr, end = ptr + size;
    long i = range_at(ptr), first = i;
    if (!size || end < ptr || i < 0 || g_ranges[i].ptr != ptr)
        return -1;
    for (*count = 0; at < end; i++, (*count)++) {
        if ((size_t)i >= g_nranges || g_ranges[i].kind != FK_MAP || g_ranges[i].ptr != at)
            return -1;
        at += g_ranges[i].size;
    }
    return at == end ? first : -1;
}

/* May a copy touch [ptr, ptr + n)? It lies in one allocation, or in mappings side by side
 * whose access has all of `need`; 0 bytes need ptr in (or at the end of) one. Under g_mem. */
static int dev_ok(CUdeviceptr ptr, size_t n, int need)
{
    CUdeviceptr end = ptr + n;
    long i;
    if (n == 0)
        return range_at(ptr) >= 0 || (ptr && range_at(ptr - 1) >= 0);
    if (end < ptr || (i = range_at(ptr)) < 0)
        return 0;
    if (g_ranges[i].kind == FK_ALLOC)
        return end - g_ranges[i].ptr <= g_ranges[i].size;
    for (;;) {
        const fk_range *r = &g_ranges[i];
        if (r->kind != FK_MAP || (r->prot & need) != need)
            return 0;
        if (end <= r->ptr + r->size)
            return 1;
        if ((size_t)++i >= g_nranges || g_ranges[i].ptr != r->ptr + r->size)
            return 0;
    }
}

static CUresult copy_to_device(CUdeviceptr dst, const void *src, size_t n)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (!src && n)
        return rc;
    pthread_rwlock_rdlock(&g_mem);
    if (dev_ok(dst, n, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) {
        if (n)
            memcpy((void *)(uintptr_t)dst, src, n);
        rc = CUDA_SUCCESS;
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

static CUresult copy_from_device(void *dst, CUdeviceptr src, size_t n)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (!dst && n)
        return rc;
    pthread_rwlock_rdlock(&g_mem);
    if (dev_ok(src, n, CU_MEM_ACCESS_FLAGS_PROT_READ)) {
        if (n)
            memcpy(dst, (const void *)(uintptr_t)src, n);
        rc = CUDA_SUCCESS;
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* What crossed "PCIe": the bytes every copy between host and device memory moved (each way)
 * and every memset wrote, in this process, since it started (a CRIU restore keeps the counts:
 * they are its memory). Written after each one to $FAKE_CUDA_STATE_DIR/copies/<key>:
 * "dtoh <n>\nhtod <n>\nmemset <n>\n" (fixed width: rewritten in place), so that a test can
 * tell that memory the agent found zero was never copied (fakegpu.FakeGpu.copies). */
enum { FK_DTOH, FK_HTOD, FK_MEMSET };
static unsigned long long g_copied[3];
static pthread_mutex_t g_copied_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult counted(const fk_call *c, int kind, size_t n, CUresult rc)
{
    char path[4096], line[96];
    int fd, len;
    if (rc != CUDA_SUCCESS || !c->dir)
        return rc;
    pthread_mutex_lock(&g_copied_lock);
    g_copied[kind] += n;
    len = snprintf(line, sizeof line, "dtoh %20llu\nhtod %20llu\nmemset %20llu\n",
                   g_copied[FK_DTOH], g_copied[FK_HTOD], g_copied[FK_MEMSET]);
    snprintf(path, sizeof path, "%s/copies", c->dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/copies/%s", c->dir, c->key);
    fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
        if (pwrite(fd, line, (size_t)len, 0) < 0) { /* nothing to do */ }
        close(fd);
    }
    pthread_mutex_unlock(&g_copied_lock);
    return rc;
}

static CUresult set_device(CUdeviceptr dst, unsigned char value, size_t n)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_rdlock(&g_mem);
    if (dev_ok(dst, n, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) {
        if (n)
            memset((void *)(uintptr_t)dst, value, n);
        rc = CUDA_SUCCESS;
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* Adds `size` bytes to this process's device memory (proc/<key> mem) if they fit on its GPU
 * beside every other live process's, under the state directory's lock. */
static CUresult charge(const char *dir, const char *key, size_t size)
{
    fk_gpu gpus[FK_MAX_GPUS];
    fk_proc p;
    int n = fk_read_gpus(dir, gpus, FK_MAX_GPUS), i, fd = fk_lock(dir);
    CUresult rc;
    if (fk_proc_read(dir, key, &p) != 0)
        rc = CUDA_ERROR_DEINITIALIZED;
    else if ((i = fk_find_gpu(gpus, n, p.gpu)) < 0)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else if (size > gpus[i].total || fk_used_on(dir, p.gpu, key) + p.mem > gpus[i].total - size)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else {
        p.mem += size;
        rc = fk_proc_write(dir, key, &p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
    }
    fk_unlock(fd);
    return rc;
}

/* Gives back what charge() took. */
static CUresult refund(const char *dir, const char *key, size_t size)
{
    fk_proc p;
    int fd = fk_lock(dir);
    CUresult rc;
    if (fk_proc_read(dir, key, &p) != 0) {
        rc = CUDA_ERROR_DEINITIALIZED;
    } else {
        p.mem = p.mem > size ? p.mem - size : 0;
        rc = fk_proc_write(dir, key, &p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
    }
    fk_unlock(fd);
    return rc;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    fk_call c;
    size_t span = (bytesize + page_size() - 1) & ~(page_size() - 1);
    void *m;
    int added;
    CUresult rc;
    if (!dptr || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = enter("cuMemAlloc_v2", &c)) != CUDA_SUCCESS)
        return rc;
    if (span < bytesize)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
             -1, 0);
    if (m == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if ((rc = charge(c.dir, c.key, bytesize)) == CUDA_SUCCESS) {
        pthread_rwlock_wrlock(&g_mem);
        added = range_add((fk_range){(uintptr_t)m, bytesize, FK_ALLOC,
                                     CU_MEM_ACCESS_FLAGS_PROT_READWRITE, NULL}) == 0;
        pthread_rwlock_unlock(&g_mem);
        if (!added) {
            refund(c.dir, c.key, bytesize);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc != CUDA_SUCCESS)
        munmap(m, span);
    else
        *dptr = (CUdeviceptr)(uintptr_t)m;
    return rc;
}

/* -- the checkpoint API --------------------------------------------------------------------- */

static void log_call(const char *dir, const char *call, int pid, CUresult rc)
{
    char path[4096], line[128];
    int fd, len;
    if (!dir)
        return;
    snprintf(path, sizeof path, "%s/calls.log", dir);
    len = snprintf(line, sizeof line, "%s %d %d\n", call, pid, rc);
    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
        if (write(fd, line, (size_t)len) < 0) { /* nothing to do */ }
        close(fd);
    }
}

/* hang/lock holds an optional pid only. */
static int hang_applies(const char *dir, int pid)
{
    char path[4096], buf[256];
    long only;
    snprintf(path, sizeof path, "%s/hang/lock", dir);
    if (fk_read_file(path, buf, sizeof buf) < 0)
        return 0;
    only = strtol(buf, NULL, 10);
    return only <= 0 || only == pid;
}

/* Common start of the six calls: init, delay, injected failure. Returns -1 to go on. */
static CUresult begin(const char *call, int pid, const char **dirp)
{
    long v;
    CUresult rc;
    const char *dir = fk_dir();
    *dirp = dir;
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dir)
        return CUDA_ERROR_NO_DEVICE;
    if (fault(dir, "delay", call, pid, &v) && v > 0)
        fk_sleep_ms(v);
    if (injected(dir, call, pid, &rc))
        return rc;
    return -1;
}

/* Reads the live CUDA process `pid` (as the caller's /proc numbers it), its entry's key to
 * `key`; CUDA_ERROR_INVALID_VALUE when pid is not one. The caller holds fk_lock: the entry may
 * be written here (fk_adopt_host), and a write outside the lock could land after another
 * process's restore and unlock and put back CHECKPOINTED (get_proc_locked otherwise). */
static CUresult get_proc(const char *dir, int pid, fk_proc *p, char *key, size_t size)
{
    if (pid <= 0 || !fk_alive(pid))
        return CUDA_ERROR_INVALID_VALUE;
    fk_key_of(pid, key, size);
    if (fk_proc_read(dir, key, p) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (fk_adopt_host(p, pid))
        fk_proc_write(dir, key, p);
    return CUDA_SUCCESS;
}

/* get_proc() for a caller that does not hold the lock. */
static CUresult get_proc_locked(const char *dir, int pid, fk_proc *p, char *key, size_t size)
{
    int fd = fk_lock(dir);
    CUresult rc = get_proc(dir, pid, p, key, size);
    fk_unlock(fd);
    return rc;
}

static int all_zero(const void *mem, size_t size)
{
    const unsigned char *b = mem;
    for (size_t i = 0; i < size; i++)
        if (b[i])
            return 0;
    return 1;
}

/* Moves pid from state `from` to `to` under the lock. */
static CUresult transition(const char *dir, int pid, int from, int to)
{
    fk_proc p;
    char key[FK_KEY_LEN];
    int fd = fk_lock(dir);
    CUresult rc = get_proc(dir, pid, &p, key, sizeof key);
    if (rc == CUDA_SUCCESS && p.state != from)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    if (rc == CUDA_SUCCESS) {
        p.state = to;
        if (to == FK_CHECKPOINTED)
            snprintf(p.image, sizeof p.image, "%s", p.gpu);
        if (fk_proc_write(dir, key, &p) != 0)
            rc = CUDA_ERROR_OPERATING_SYSTEM;
    }
    fk_unlock(fd);
    return rc;
}

/* lock's own work before its move: its reserved fields, the state, hang/lock. */
static CUresult lock_wait(const char *dir, int pid, void *arg)
{
    CUcheckpointLockArgs *args = arg;
    char key[FK_KEY_LEN];
    fk_proc p;
    unsigned int timeout = args ? args->timeoutMs : 0;
    CUresult rc;
    if (args && (args->reserved0 || !all_zero(args->reserved1, sizeof args->reserved1)))
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = get_proc_locked(dir, pid, &p, key, sizeof key)) == CUDA_SUCCESS &&
        p.state != FK_RUNNING)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    if (rc == CUDA_SUCCESS && hang_applies(dir, pid)) {
        /* The process never reaches a lockable point: wait out the timeout (0 = forever,
         * capped at 60 s). Removing hang/lock meanwhile lets the lock go through. */
        double limit = timeout ? timeout : 60000, t0 = fk_now_ms();
        while (hang_applies(dir, pid) && fk_now_ms() - t0 < limit)
            fk_sleep_ms(5);
        if (hang_applies(dir, pid))
            rc = CUDA_ERROR_TIMEOUT;
    }
    return rc;
}

/* checkpoint's and unlock's arguments: reserved, "must be zeroed". */
static CUresult args_zeroed(const char *dir, int pid, void *args)
{
    (void)dir;
    (void)pid;
    return args && !all_zero(args, sizeof(CUcheckpointUnlockArgs)) ? CUDA_ERROR_INVALID_VALUE
                                                                    : CUDA_SUCCESS;
}

_Static_assert(sizeof(CUcheckpointCheckpointArgs) == sizeof(CUcheckpointUnlockArgs),
               "args_zeroed checks both");

/* restore's work and move: the pairs, the target GPU, its room (CHECKPOINTED -> LOCKED). */
static CUresult do_restore(const char *dir, int pid, void *arg)
{
    const CUcheckpointRestoreArgs *args = arg;
    fk_gpu gpus[FK_MAX_GPUS];
    fk_proc p;
    char key[FK_KEY_LEN], target[FK_UUID_LEN], pairs[FK_PAIRS_LEN] = "";
    unsigned int count = args ? args->gpuPairsCount : 0;
    int n, i, fd, covered = 0;
    CUresult rc;

    if (args && (!all_zero(args->reserved, sizeof args->reserved) || args->reserved1))
        return CUDA_ERROR_INVALID_VALUE;
    if (count && !args->gpuPairs)
        return CUDA_ERROR_INVALID_VALUE;
    n = fk_read_gpus(dir, gpus, FK_MAX_GPUS);
    fd = fk_lock(dir);
    if ((rc = get_proc(dir, pid, &p, key, sizeof key)) != CUDA_SUCCESS)
        goto out;
    if (p.state != FK_CHECKPOINTED) {
        rc = CUDA_ERROR_ILLEGAL_STATE;
        goto out;
    }
    snprintf(target, sizeof target, "%s", p.gpu);
    for (unsigned int k = 0; k < count; k++) {
        char old_s[FK_UUID_LEN], new_s[FK_UUID_LEN];
        size_t used = strlen(pairs);
        fk_uuid_format((const unsigned char *)args->gpuPairs[k].oldUuid.bytes, old_s, sizeof old_s);
        fk_uuid_format((const unsigned char *)args->gpuPairs[k].newUuid.bytes, new_s, sizeof new_s);
        if (fk_find_gpu(gpus, n, new_s) < 0) {
            rc = CUDA_ERROR_INVALID_DEVICE;
            goto out;
        }
        if (fk_uuid_eq(old_s, p.gpu)) {
            covered = 1;
            snprintf(target, sizeof target, "%s", gpus[fk_find_gpu(gpus, n, new_s)].uuid);
        }
        snprintf(pairs + used, sizeof pairs - used, "%s%s:%s", used ? "," : "", old_s, new_s);
    }
    if (count && !covered) { /* "it must contain every checkpointed GPU" */
        rc = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if ((i = fk_find_gpu(gpus, n, target)) < 0) { /* restoring onto a GPU this host lacks */
        rc = CUDA_ERROR_INVALID_DEVICE;
        goto out;
    }
    if (fk_used_on(dir, gpus[i].uuid, key) + p.mem > gpus[i].total) {
        rc = CUDA_ERROR_OUT_OF_MEMORY; /* stays CHECKPOINTED */
        goto out;
    }
    p.state = FK_LOCKED;
    snprintf(p.gpu, sizeof p.gpu, "%s", target);
    snprintf(p.pairs, sizeof p.pairs, "%s", pairs);
    if (fk_proc_write(dir, key, &p) != 0)
        rc = CUDA_ERROR_OPERATING_SYSTEM;
out:
    fk_unlock(fd);
    return rc;
}

/* The six checkpoint calls, one row each: the exported function and its argument; the name
 * their fail/ and delay/ knobs and calls.log line go by; the work done first (NULL: none); the
 * state move made when it succeeds (from -1: none); for the two queries, what they answer
 * through their int pointer. Expanded into CK_CALLS (ck_call runs a row) and the functions. */
enum { CK_ANSWER_NONE, CK_ANSWER_STATE, CK_ANSWER_PID };
#define CK_CALL_LIST(X)                                                                        \
    X(cuCheckpointProcessGetState, int *, "get_state", NULL, -1, -1, CK_ANSWER_STATE)          \
    X(cuCheckpointProcessLock, CUcheckpointLockArgs *, "lock", lock_wait, FK_RUNNING,          \
      FK_LOCKED, CK_ANSWER_NONE)                                                               \
    X(cuCheckpointProcessCheckpoint, CUcheckpointCheckpointArgs *, "checkpoint", args_zeroed,  \
      FK_LOCKED, FK_CHECKPOINTED, CK_ANSWER_NONE)                                              \
    X(cuCheckpointProcessRestore, CUcheckpointRestoreArgs *, "restore", do_restore, -1, -1,    \
      CK_ANSWER_NONE)                                                                          \
    X(cuCheckpointProcessUnlock, CUcheckpointUnlockArgs *, "unlock", args_zeroed, FK_LOCKED,   \
      FK_RUNNING, CK_ANSWER_NONE)                                                              \
    X(cuCheckpointProcessGetRestoreThreadId, int *, "restore_tid", NULL, -1, -1, CK_ANSWER_PID)

#define CK_ENUM(fn, arg_t, knob, work, from, to, answer) CK_##fn,
enum { CK_CALL_LIST(CK_ENUM) };
#undef CK_ENUM

#define CK_ROW(fn, arg_t, knob, work, from, to, answer) [CK_##fn] = {knob, work, from, to, answer},
static const struct {
    const char *name;
    CUresult (*work)(const char *dir, int pid, void *arg);
    int from, to;
    int answer;
} CK_CALLS[] = {CK_CALL_LIST(CK_ROW)};
#undef CK_ROW

/* One checkpoint call: begin (init, delay, injected failure), its row's answer, work and move,
 * then its line in calls.log. */
static CUresult ck_call(int call, int pid, void *arg)
{
    const char *dir;
    char key[FK_KEY_LEN];
    fk_proc p;
    CUresult rc = begin(CK_CALLS[call].name, pid, &dir);
    if (rc != (CUresult)-1)
        goto out;
    rc = CUDA_SUCCESS;
    if (CK_CALLS[call].answer != CK_ANSWER_NONE) {
        if (!arg)
            rc = CUDA_ERROR_INVALID_VALUE;
        else if ((rc = get_proc_locked(dir, pid, &p, key, sizeof key)) == CUDA_SUCCESS)
            *(int *)arg = CK_CALLS[call].answer == CK_ANSWER_STATE ? p.state : pid;
    }
    if (rc == CUDA_SUCCESS && CK_CALLS[call].work)
        rc = CK_CALLS[call].work(dir, pid, arg);
    if (rc == CUDA_SUCCESS && CK_CALLS[call].from >= 0)
        rc = transition(dir, pid, CK_CALLS[call].from, CK_CALLS[call].to);
out:
    log_call(dir, CK_CALLS[call].name, pid, rc);
    return rc;
}

#define CK_EXPORT(fn, arg_t, knob, work, from, to, answer)                                   \
    EXPORT CUresult fn(int pid, arg_t arg)                                                     \
    {                                                                                          \
        return ck_call(CK_##fn, pid, arg);                                                     \
    }
CK_CALL_LIST(CK_EXPORT)
#undef CK_EXPORT


/* -- more driver calls, for torpor's agent (agent/) ----------------------------------------------
 * Memory (cuMemFree_v2, cuMemAllocPitch_v2, the VMM calls, pinned host memory, pointer
 * queries), work (cuLaunchKernel, cuMemcpy*, streams, events), the context stack and
 * cuGetProcAddress(_v2). Each starts with enter(): it first sleeps as
 * "$FAKE_CUDA_STATE_DIR/delay/<its name>" says ("<ms> [pid]", e.g. delay/cuStreamSynchronize),
 * so a test can hold a call in flight; it blocks while the process is LOCKED or CHECKPOINTED;
 * and fail/<its name> makes it return that CUresult without acting (fake_common.h).
 * cuCtxPushCurrent_v2, cuCtxPopCurrent_v2, cuCtxDestroy_v2 and cuGetProcAddress(_v2) do none of
 * that. Work is done when called: a stream or an event never has anything pending.
 */

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    fk_call c;
    long i;
    size_t size = 0;
    CUresult rc;
    if ((rc = enter("cuMemFree_v2", &c)) != CUDA_SUCCESS)
        return rc;
    if (dptr == 0)
        return CUDA_SUCCESS;
    pthread_rwlock_wrlock(&g_mem);
    i = range_at(dptr);
    if (i >= 0 && g_ranges[i].ptr == dptr && g_ranges[i].kind == FK_ALLOC) {
        size = g_ranges[i].size;
        range_del((size_t)i, 1);
    }
    pthread_rwlock_unlock(&g_mem);
    if (!size) /* not an allocation of cuMemAlloc_v2 (a mapping is cuMemUnmap's) */
        return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)(uintptr_t)dptr, (size + page_size() - 1) & ~(page_size() - 1));
    return refund(c.dir, c.key, size);
}

/* Rows of WidthInBytes rounded up to 512 bytes. The memory comes from cuMemAlloc_v2 called
 * by its exported name, as a driver may call its own entry points: under torpor's agent that
 * call is a nested one, which the agent must not count a second time. */
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                   size_t Height, unsigned int ElementSizeBytes)
{
    fk_call c;
    size_t pitch;
    CUresult rc;
    if ((rc = enter("cuMemAllocPitch_v2", &c)) != CUDA_SUCCESS)
        return rc;
    if (!dptr || !pPitch || !WidthInBytes || !Height ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    pitch = (WidthInBytes + 511) & ~(size_t)511;
    rc = cuMemAlloc_v2(dptr, pitch * Height);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

/* -- modules: the agent's fingerprint kernel ---------------------------------------------------
 * One module there is: the agent's PTX (fingerprint.h), recognised by its kernel's name, whose
 * one function cuLaunchKernel runs on the CPU with the same fold the PTX does: tests see the
 * fingerprints the GPU would give (tests/gpu runs the PTX itself, checked against this fold by
 * TORPOR_AGENT_FP_CHECK). Any other image: CUDA_ERROR_INVALID_IMAGE (200). */
#include "fingerprint.h"

static char fp_module, fp_function; /* their addresses are the handles */

EXPORT CUresult cuModuleLoadData(void **module, const void *image)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuModuleLoadData", &c)) != CUDA_SUCCESS)
        return rc;
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    if (!strstr((const char *)image, ".entry " FP_KERNEL "("))
        return 200;
    *module = &fp_module;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(void **f, void *module, const char *name)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuModuleGetFunction", &c)) != CUDA_SUCCESS)
        return rc;
    if (module != &fp_module)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!f || !name || strcmp(name, FP_KERNEL))
        return CUDA_ERROR_NOT_FOUND;
    *f = &fp_function;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleUnload(void *module)
{
    return module == &fp_module ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* torpor_fp(segs, out, nonzero): block b folds segment b (device memory: readable by this
 * process) into out's lanes (out 0: none) and flags in nonzero[b] whether any of its words is
 * not zero, as the PTX does. */
static CUresult run_fingerprints(unsigned int blocks, unsigned int threads, void **params)
{
    const struct fp_seg *segs;
    uint64_t *out;
    uint32_t *nonzero;
    CUresult rc = CUDA_SUCCESS;
    if (threads != FP_LANES || !params || !params[0] || !params[1] || !params[2])
        return CUDA_ERROR_INVALID_VALUE;
    segs = (const struct fp_seg *)(uintptr_t)*(CUdeviceptr *)params[0];
    out = (uint64_t *)(uintptr_t)*(CUdeviceptr *)params[1];
    nonzero = (uint32_t *)(uintptr_t)*(CUdeviceptr *)params[2];
    pthread_rwlock_rdlock(&g_mem);
    if (!dev_ok((CUdeviceptr)(uintptr_t)segs, blocks * sizeof(*segs), CU_MEM_ACCESS_FLAGS_PROT_READ)
        || (out && !dev_ok((CUdeviceptr)(uintptr_t)out,
                           (size_t)blocks * FP_LANES * 2 * sizeof(uint64_t),
                           CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
        || !dev_ok((CUdeviceptr)(uintptr_t)nonzero, blocks * sizeof(*nonzero),
                   CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
        rc = CUDA_ERROR_ILLEGAL_ADDRESS;
    for (unsigned int b = 0; b < blocks && rc == CUDA_SUCCESS; b++)
        if (segs[b].words && !dev_ok(segs[b].ptr, segs[b].words * 8, CU_MEM_ACCESS_FLAGS_PROT_READ))
            rc = CUDA_ERROR_ILLEGAL_ADDRESS;
    for (unsigned int b = 0; b < blocks && rc == CUDA_SUCCESS; b++) {
        const uint64_t *w = (const uint64_t *)(uintptr_t)segs[b].ptr;
        nonzero[b] = (uint32_t)fp_nonzero(w, segs[b].words);
        for (unsigned int t = 0; out && t < FP_LANES; t++)
            fp_lane(w, segs[b].words, t, out + ((size_t)b * FP_LANES + t) * 2);
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

EXPORT CUresult cuLaunchKernel(void *f, unsigned int gridDimX, unsigned int gridDimY,
                               unsigned int gridDimZ, unsigned int blockDimX,
                               unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, void *hStream, void **kernelParams,
                               void **extra)
{
    fk_call c;
    CUresult rc;
    (void)sharedMemBytes, (void)hStream, (void)kernelParams, (void)extra;
    if ((rc = enter("cuLaunchKernel", &c)) != CUDA_SUCCESS)
        return rc;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ)
        return CUDA_ERROR_INVALID_VALUE;
    if (f == &fp_function)
        return run_fingerprints(gridDimX, blockDimX, kernelParams);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemcpyHtoD_v2", &c)) != CUDA_SUCCESS)
        return rc;
    return counted(&c, FK_HTOD, ByteCount, copy_to_device(dstDevice, srcHost, ByteCount));
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemcpyDtoH_v2", &c)) != CUDA_SUCCESS)
        return rc;
    return counted(&c, FK_DTOH, ByteCount, copy_from_device(dstHost, srcDevice, ByteCount));
}

static int stream_ok(CUstream s);

/* Memsets: done when called, like the copies; counted apart from them (copies/<key>). */
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemsetD8_v2", &c)) != CUDA_SUCCESS)
        return rc;
    return counted(&c, FK_MEMSET, N, set_device(dstDevice, uc, N));
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                CUstream hStream)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemsetD8Async", &c)) != CUDA_SUCCESS)
        return rc;
    if (!stream_ok(hStream))
        return CUDA_ERROR_INVALID_HANDLE;
    return counted(&c, FK_MEMSET, N, set_device(dstDevice, uc, N));
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_top == (int)(sizeof t_ctx_stack / sizeof t_ctx_stack[0]))
        return CUDA_ERROR_INVALID_VALUE;
    t_ctx_stack[t_ctx_top++] = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!t_ctx_top)
        return CUDA_ERROR_INVALID_CONTEXT;
    t_ctx_top--;
    if (pctx)
        *pctx = t_ctx_stack[t_ctx_top];
    return CUDA_SUCCESS;
}

/* The process stays registered: the fake has one context a process. */
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    return ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The same context cuCtxCreate_v2 makes (called by its exported name, see above), made current
 * nowhere, as the driver's primary context. */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CUresult rc;
    if (injected(fk_dir(), "cuDevicePrimaryCtxRetain", (int)getpid(), &rc))
        return rc; /* no room for a context, say */
    t_in_primary = 1;
    rc = cuCtxCreate_v2(pctx, 0, dev);
    t_in_primary = 0;
    return rc;
}

/* NULL when there is none (CUDA_SUCCESS all the same, as the driver answers). */
EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    CUresult rc;
    if ((rc = enter_any("cuCtxGetCurrent")) != CUDA_SUCCESS)
        return rc;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_ctx_top ? t_ctx_stack[t_ctx_top - 1] : NULL;
    return CUDA_SUCCESS;
}

/* Replaces the top of this thread's stack (pushes onto an empty one); NULL pops it, or does
 * nothing on an empty stack. */
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult rc;
    if ((rc = enter_any("cuCtxSetCurrent")) != CUDA_SUCCESS)
        return rc;
    if (!ctx) {
        if (t_ctx_top)
            t_ctx_top--;
        return CUDA_SUCCESS;
    }
    if (ctx_device(ctx) < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!t_ctx_top)
        t_ctx_top = 1;
    t_ctx_stack[t_ctx_top - 1] = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    CUresult rc;
    int dev;
    if ((rc = enter_any("cuCtxGetDevice")) != CUDA_SUCCESS)
        return rc;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!t_ctx_top || (dev = ctx_device(t_ctx_stack[t_ctx_top - 1])) < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = dev;
    return CUDA_SUCCESS;
}

/* -- memory queries ------------------------------------------------------------------------- */

/* The process's GPU: its total, and that less what every live process holds on it. */
EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    fk_gpu gpus[FK_MAX_GPUS];
    fk_call c;
    unsigned long long used;
    int i;
    CUresult rc;
    if ((rc = enter("cuMemGetInfo_v2", &c)) != CUDA_SUCCESS)
        return rc;
    if (!free || !total)
        return CUDA_ERROR_INVALID_VALUE;
    if ((i = fk_find_gpu(gpus, fk_read_gpus(c.dir, gpus, FK_MAX_GPUS), c.p.gpu)) < 0)
        return CUDA_ERROR_INVALID_DEVICE;
    used = fk_used_on(c.dir, c.p.gpu, NULL);
    *total = (size_t)gpus[i].total;
    *free = used < gpus[i].total ? (size_t)(gpus[i].total - used) : 0;
    return CUDA_SUCCESS;
}

/* The allocation (cuMemAlloc_v2) or the mapping (cuMemMap) holding dptr; either out may be
 * NULL. CUDA_ERROR_NOT_FOUND for any other address. */
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    fk_call c;
    long i;
    CUresult rc;
    if ((rc = enter("cuMemGetAddressRange_v2", &c)) != CUDA_SUCCESS)
        return rc;
    pthread_rwlock_rdlock(&g_mem);
    if ((i = range_at(dptr)) >= 0) {
        if (pbase)
            *pbase = g_ranges[i].ptr;
        if (psize)
            *psize = g_ranges[i].size;
    }
    pthread_rwlock_unlock(&g_mem);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* RANGE_START_ADDR (CUdeviceptr) and RANGE_SIZE (size_t): the range cuMemGetAddressRange_v2
 * gives; MEMORY_TYPE (unsigned int): CU_MEMORYTYPE_DEVICE for those, CU_MEMORYTYPE_HOST for
 * pinned and registered host memory. Other attributes are CUDA_ERROR_NOT_SUPPORTED here; an
 * address the driver does not know is CUDA_ERROR_INVALID_VALUE. */
EXPORT CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr)
{
    fk_call c;
    long i;
    CUresult rc;
    if ((rc = enter("cuPointerGetAttribute", &c)) != CUDA_SUCCESS)
        return rc;
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    if (attribute != CU_POINTER_ATTRIBUTE_RANGE_START_ADDR &&
        attribute != CU_POINTER_ATTRIBUTE_RANGE_SIZE && attribute != CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
        return CUDA_ERROR_NOT_SUPPORTED;
    rc = CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_rdlock(&g_mem);
    if ((i = range_at(ptr)) >= 0) {
        rc = CUDA_SUCCESS;
        if (attribute == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
            *(CUdeviceptr *)data = g_ranges[i].ptr;
        else if (attribute == CU_POINTER_ATTRIBUTE_RANGE_SIZE)
            *(size_t *)data = g_ranges[i].size;
        else
            *(unsigned int *)data = CU_MEMORYTYPE_DEVICE;
    } else if (attribute == CU_POINTER_ATTRIBUTE_MEMORY_TYPE) {
        for (size_t k = 0; k < g_nhost && rc != CUDA_SUCCESS; k++)
            if (ptr - g_host[k].ptr < g_host[k].size) {
                *(unsigned int *)data = CU_MEMORYTYPE_HOST;
                rc = CUDA_SUCCESS;
            }
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* -- the virtual memory management API (see "device memory" above) ---------------------------- */

/* Checks a CUmemAllocationProp as cuMemCreate and cuMemGetAllocationGranularity take it:
 * pinned memory on a device of this host (other location types exist, not in this fake). */
static CUresult check_prop(const CUmemAllocationProp *prop)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir = fk_dir();
    int n = dir ? fk_read_gpus(dir, gpus, FK_MAX_GPUS) : 0;
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    /* requestedHandleTypes: POSIX file descriptors only (no FABRIC, no Win32 here) */
    if (prop->requestedHandleTypes & ~FK_POSIX_FD)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (prop->location.id < 0 || prop->location.id >= n)
        return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

/* 2 MiB, MINIMUM and RECOMMENDED alike. */
EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity,
                                              const CUmemAllocationProp *prop, int option)
{
    CUresult rc;
    if ((rc = enter_any("cuMemGetAllocationGranularity")) != CUDA_SUCCESS)
        return rc;
    if (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = check_prop(prop)) != CUDA_SUCCESS)
        return rc;
    *granularity = FK_GRANULARITY;
    return CUDA_SUCCESS;
}

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

/* A PROT_NONE range of `size` bytes aligned to `align` (a power of two): at `hint` when that is
 * aligned and free, else wherever the kernel has room (the driver too may ignore the hint). */
static void *reserve(size_t size, size_t align, CUdeviceptr hint)
{
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    uintptr_t m, a;
    void *p;
    if (hint && hint % align == 0) {
        p = mmap((void *)(uintptr_t)hint, size, PROT_NONE, flags | MAP_FIXED_NOREPLACE, -1, 0);
        if (p == (void *)(uintptr_t)hint)
            return p;
        if (p != MAP_FAILED) /* a kernel before 4.17 takes it as a hint only */
            munmap(p, size);
    }
    if (size + align < size)
        return MAP_FAILED;
    if ((p = mmap(NULL, size + align, PROT_NONE, flags, -1, 0)) == MAP_FAILED)
        return p;
    m = (uintptr_t)p;
    a = (m + align - 1) & ~(uintptr_t)(align - 1);
    if (a > m)
        munmap(p, a - m);
    if (m + align > a)
        munmap((void *)(a + size), m + align - a);
    return (void *)a;
}

/* $FAKE_CUDA_STATE_DIR/va_phase holding "<offset>": the process's first reservation that
 * takes no hint starts `offset` bytes past a FK_PHASE_SPAN boundary instead of wherever mmap()
 * (ASLR) puts it, and each later one ends where the one before starts (where that is free;
 * downwards, as mmap() places them), so a test chooses how its allocations fall on the
 * agent's 32 MiB windows (mover.c plan_build: which chunk, which data file) instead of getting
 * one layout at random. The offset must be a multiple of the alignment asked for and below
 * FK_PHASE_SPAN. 1 with *phase, 0 when there is no such file, else -1. */
#define FK_PHASE_SPAN ((size_t)1 << 30)
static int va_phase(const char *dir, size_t align, size_t *phase)
{
    char path[4096], buf[64], *end;
    long long v;
    snprintf(path, sizeof path, "%s/va_phase", dir);
    if (fk_read_file(path, buf, sizeof buf) < 0)
        return 0;
    errno = 0;
    v = strtoll(buf, &end, 0);
    if (errno || end == buf || v < 0 || (size_t)v >= FK_PHASE_SPAN || (size_t)v % align ||
        align > FK_PHASE_SPAN)
        return -1;
    *phase = (size_t)v;
    return 1;
}

/* A va_phase reservation: below the one before (g_va_low, its start; 0 before the first), else
 * at the phase in a span of its own. MAP_FAILED when there is no room. */
static uintptr_t g_va_low;
static pthread_mutex_t g_va_lock = PTHREAD_MUTEX_INITIALIZER;

static void *reserve_phased(size_t size, size_t align, size_t phase)
{
    uintptr_t below;
    void *m = MAP_FAILED;
    pthread_mutex_lock(&g_va_lock);
    below = (g_va_low - size) & ~(uintptr_t)(align - 1);
    if (g_va_low > size && (m = reserve(size, align, below)) != (void *)below) {
        if (m != MAP_FAILED) /* not free there: at the phase again */
            munmap(m, size);
        m = MAP_FAILED;
    }
    if (m == MAP_FAILED && (m = reserve(phase + size, FK_PHASE_SPAN, 0)) != MAP_FAILED && phase) {
        munmap(m, phase);
        m = (char *)m + phase;
    }
    if (m != MAP_FAILED)
        g_va_low = (uintptr_t)m;
    pthread_mutex_unlock(&g_va_lock);
    return m;
}

/* size a multiple of the granularity, alignment 0 (the granularity) or a power of two, flags
 * 0. Reservations hold no memory: they count nowhere. */
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                    CUdeviceptr addr, unsigned long long flags)
{
    fk_call c;
    fk_span *a;
    void *m = MAP_FAILED;
    size_t phase = 0;
    int phased;
    CUresult rc;
    if ((rc = enter("cuMemAddressReserve", &c)) != CUDA_SUCCESS)
        return rc;
    if (!ptr || !size || size % FK_GRANULARITY || flags || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (alignment < FK_GRANULARITY)
        alignment = FK_GRANULARITY;
    if ((phased = va_phase(c.dir, alignment, &phase)) < 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!phased)
        m = reserve(size, alignment, addr);
    else if (addr && (m = reserve(size, alignment, addr)) != (void *)(uintptr_t)addr) {
        if (m != MAP_FAILED) /* the hint was not free: at the phase instead */
            munmap(m, size);
        m = MAP_FAILED;
    }
    if (phased && m == MAP_FAILED)
        m = reserve_phased(size, alignment, phase);
    if (m == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_rwlock_wrlock(&g_mem);
    if ((a = grow(g_reserved, g_nreserved, &g_reserved_cap, sizeof *a))) {
        g_reserved = a;
        g_reserved[g_nreserved++] = (fk_span){(uintptr_t)m, size, 0};
    }
    pthread_rwlock_unlock(&g_mem);
    if (!a) {
        munmap(m, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}

/* ptr and size as cuMemAddressReserve gave them, nothing mapped there any more. */
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    fk_call c;
    size_t i;
    CUresult rc;
    if ((rc = enter("cuMemAddressFree", &c)) != CUDA_SUCCESS)
        return rc;
    rc = CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_wrlock(&g_mem);
    for (i = 0; i < g_nreserved; i++)
        if (g_reserved[i].ptr == ptr && g_reserved[i].size == size)
            break;
    if (i < g_nreserved && !range_overlaps(ptr, size)) {
        munmap((void *)(uintptr_t)ptr, size);
        g_reserved[i] = g_reserved[--g_nreserved];
        rc = CUDA_SUCCESS;
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* The handle with that id (also one released but still mapped), or NULL. Under g_mem. */
static fk_handle *handle_of(CUmemGenericAllocationHandle id, size_t *index)
{
    for (size_t i = 0; i < g_nhandles; i++)
        if (g_handles[i]->id == id) {
            if (index)
                *index = i;
            return g_handles[i];
        }
    return NULL;
}

/* Frees handles taken out of the table (their memory leaves the process's count). */
static void handles_free(fk_call *c, fk_handle *h)
{
    while (h) {
        fk_handle *next = h->next;
        close(h->fd);
        refund(c->dir, c->key, h->size);
        free(h);
        h = next;
    }
}

/* Physical memory: size a multiple of the granularity, flags 0; counted on the process's GPU
 * (CUDA_ERROR_OUT_OF_MEMORY when it does not fit), zeroed. */
/* $FAKE_CUDA_STATE_DIR/dirty present: new physical memory holds 0xA5 bytes, not zeros (a real
 * GPU's new memory holds whatever it held before; only what a program writes is its own), so a
 * test sees a re-creation that forgot to write some bytes back. 0, or -1. */
static int dirty(const char *dir, int fd, size_t size)
{
    static char junk[1 << 20];
    char path[4096];
    snprintf(path, sizeof path, "%s/dirty", dir);
    if (access(path, F_OK) != 0)
        return 0;
    memset(junk, 0xA5, sizeof junk);
    for (size_t done = 0; done < size;) {
        size_t n = size - done < sizeof junk ? size - done : sizeof junk;
        ssize_t w = pwrite(fd, junk, n, (off_t)done);
        if (w <= 0)
            return -1;
        done += (size_t)w;
    }
    return 0;
}

/* h into the handle table, its id in *handle: the table's new array, or NULL (out of memory) */
static fk_handle **handle_add(fk_handle *h, CUmemGenericAllocationHandle *handle)
{
    fk_handle **a;
    pthread_rwlock_wrlock(&g_mem);
    if ((a = grow(g_handles, g_nhandles, &g_handles_cap, sizeof *a))) {
        g_handles = a;
        g_handles[g_nhandles++] = h;
        h->id = g_next_handle++;
        *handle = h->id;
    }
    pthread_rwlock_unlock(&g_mem);
    return a;
}

/* A handle that could not be made: its memfd and the GPU memory charged for it given back */
static CUresult handle_failed(fk_handle *h, fk_call *c, size_t size)
{
    if (h && h->fd >= 0)
        close(h->fd);
    free(h);
    refund(c->dir, c->key, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                            const CUmemAllocationProp *prop, unsigned long long flags)
{
    fk_call c;
    fk_handle *h, **a = NULL;
    CUresult rc;
    if ((rc = enter("cuMemCreate", &c)) != CUDA_SUCCESS)
        return rc;
    if (!handle || !size || size % FK_GRANULARITY || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = check_prop(prop)) != CUDA_SUCCESS || (rc = charge(c.dir, c.key, size)) != 0)
        return rc;
    if ((h = calloc(1, sizeof *h))) {
        char name[32];
        snprintf(name, sizeof name, "fake-cuda-mem.%d", prop->location.id);
        h->fd = memfd_create(name, MFD_CLOEXEC);
        h->size = size;
        h->prop = *prop;
        h->refs = 1;
        if (h->fd >= 0 && ftruncate(h->fd, (off_t)size) == 0 && dirty(c.dir, h->fd, size) == 0)
            a = handle_add(h, handle);
    }
    return a ? CUDA_SUCCESS : handle_failed(h, &c, size);
}

/* Drops one reference; the memory goes once none is left and nothing maps it. */
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    fk_call c;
    fk_handle *h, *gone = NULL;
    size_t i;
    CUresult rc;
    if ((rc = enter("cuMemRelease", &c)) != CUDA_SUCCESS)
        return rc;
    pthread_rwlock_wrlock(&g_mem);
    if (!(h = handle_of(handle, &i)) || h->refs <= 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (--h->refs == 0 && h->maps == 0) {
        g_handles[i] = g_handles[--g_nhandles];
        gone = h;
    }
    pthread_rwlock_unlock(&g_mem);
    handles_free(&c, gone);
    return rc;
}

/* Maps the handle's first `size` bytes at ptr, inside one reservation, where nothing is mapped:
 * ptr and size multiples of the granularity, offset 0 ("currently must be zero"), flags 0.
 * Not accessible before cuMemSetAccess. */
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                         CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    fk_call c;
    fk_handle *h;
    size_t i;
    CUresult rc;
    if ((rc = enter("cuMemMap", &c)) != CUDA_SUCCESS)
        return rc;
    if (!size || size % FK_GRANULARITY || ptr % FK_GRANULARITY || offset || flags ||
        ptr + size < ptr)
        return CUDA_ERROR_INVALID_VALUE;
    rc = CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_wrlock(&g_mem);
    for (i = 0; i < g_nreserved; i++)
        if (ptr >= g_reserved[i].ptr && ptr + size <= g_reserved[i].ptr + g_reserved[i].size)
            break;
    if ((h = handle_of(handle, NULL)) && h->refs > 0 && size <= h->size && i < g_nreserved &&
        !range_overlaps(ptr, size)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0) !=
            MAP_FAILED) {
            if (range_add((fk_range){ptr, size, FK_MAP, CU_MEM_ACCESS_FLAGS_PROT_NONE, h}) == 0) {
                h->maps++;
                rc = CUDA_SUCCESS;
            } else {
                mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            }
        }
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* [ptr, ptr + size) must be whole mappings side by side (one cuMemMap's, or several). The
 * addresses stay reserved (PROT_NONE again); a released handle mapped nowhere any more goes. */
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    fk_call c;
    fk_handle *gone = NULL;
    size_t count = 0, i;
    long first;
    CUresult rc;
    if ((rc = enter("cuMemUnmap", &c)) != CUDA_SUCCESS)
        return rc;
    pthread_rwlock_wrlock(&g_mem);
    if ((first = maps_exactly(ptr, size, &count)) < 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (i = (size_t)first; i < (size_t)first + count; i++) {
            fk_handle *h = g_ranges[i].h;
            size_t k;
            mmap((void *)(uintptr_t)g_ranges[i].ptr, g_ranges[i].size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            if (--h->maps == 0 && h->refs == 0 && handle_of(h->id, &k)) {
                g_handles[k] = g_handles[--g_nhandles];
                h->next = gone;
                gone = h;
            }
        }
        range_del((size_t)first, count);
    }
    pthread_rwlock_unlock(&g_mem);
    handles_free(&c, gone);
    return rc;
}

/* [ptr, ptr + size) must be whole mappings side by side. Each desc names a device of this host
 * (CU_MEM_LOCATION_TYPE_DEVICE) and PROT_NONE, PROT_READ or PROT_READWRITE; the fake has one
 * GPU a process, so the last desc's flags are what the process gets. */
EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                               size_t count)
{
    static const int prot_of[4] = {PROT_NONE, PROT_READ, 0, PROT_READ | PROT_WRITE};
    fk_gpu gpus[FK_MAX_GPUS];
    fk_call c;
    size_t n = 0, i;
    long first;
    int flags = 0, ngpus;
    CUresult rc;
    if ((rc = enter("cuMemSetAccess", &c)) != CUDA_SUCCESS)
        return rc;
    if (!desc || !count)
        return CUDA_ERROR_INVALID_VALUE;
    ngpus = fk_read_gpus(c.dir, gpus, FK_MAX_GPUS);
    for (i = 0; i < count; i++) {
        if (desc[i].location.type <= 0)
            return CUDA_ERROR_INVALID_VALUE;
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return CUDA_ERROR_NOT_SUPPORTED;
        if (desc[i].location.id < 0 || desc[i].location.id >= ngpus)
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
        flags = desc[i].flags;
    }
    pthread_rwlock_wrlock(&g_mem);
    if ((first = maps_exactly(ptr, size, &n)) < 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (i = (size_t)first; i < (size_t)first + n; i++) {
            mprotect((void *)(uintptr_t)g_ranges[i].ptr, g_ranges[i].size, prot_of[flags]);
            g_ranges[i].prot = flags;
        }
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                       CUmemGenericAllocationHandle handle)
{
    fk_call c;
    fk_handle *h;
    CUresult rc;
    if ((rc = enter("cuMemGetAllocationPropertiesFromHandle", &c)) != CUDA_SUCCESS)
        return rc;
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_rdlock(&g_mem);
    if ((h = handle_of(handle, NULL)) && h->refs > 0)
        *prop = h->prop;
    else
        rc = CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* The handle mapped at addr (any address inside a mapping), with one more reference: the
 * caller releases it with cuMemRelease. */
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    fk_call c;
    long i;
    CUresult rc;
    if ((rc = enter("cuMemRetainAllocationHandle", &c)) != CUDA_SUCCESS)
        return rc;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_wrlock(&g_mem);
    if ((i = range_at((CUdeviceptr)(uintptr_t)addr)) >= 0 && g_ranges[i].kind == FK_MAP) {
        g_ranges[i].h->refs++;
        *handle = g_ranges[i].h->id;
    } else {
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* A descriptor of the handle's memfd (POSIX_FD only), for another process or for this one
 * to import. The handle must have asked for it at cuMemCreate (requestedHandleTypes), and an
 * imported handle is not exported again: CUDA_ERROR_INVALID_VALUE, as the H200's driver
 * answered (bench/results/probe_held_memory-h200-2026-12-05.json). Another type:
 * CUDA_ERROR_NOT_SUPPORTED. */
EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle,
                                             CUmemGenericAllocationHandle handle, int handleType,
                                             unsigned long long flags)
{
    fk_call c;
    fk_handle *h;
    CUresult rc;
    if ((rc = enter("cuMemExportToShareableHandle", &c)) != CUDA_SUCCESS)
        return rc;
    if (!shareableHandle || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (handleType != FK_POSIX_FD)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_rwlock_rdlock(&g_mem);
    if (!(h = handle_of(handle, NULL)) || h->refs <= 0 || h->imported ||
        !(h->prop.requestedHandleTypes & FK_POSIX_FD)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        /* inheritable, as nothing says the driver's is not: the agent must not count on it */
        int fd = fcntl(h->fd, F_DUPFD, 0);
        if (fd < 0)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else
            *(int *)shareableHandle = fd;
    }
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* The device a descriptor of one of this fake's memfds was created on ("fake-cuda-mem.<id>"),
 * or -1 when it is not one. */
static int memfd_device(int fd)
{
    char path[64], link[256], *end;
    ssize_t n;
    long dev;
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    n = readlink(path, link, sizeof link - 1);
    if (n <= 0)
        return -1;
    link[n] = 0;
    if (strncmp(link, "/memfd:fake-cuda-mem.", 21))
        return -1;
    dev = strtol(link + 21, &end, 10);
    return end == link + 21 || dev < 0 || dev >= FK_MAX_GPUS ? -1 : (int)dev;
}

/* A new handle over the memory a descriptor of cuMemExportToShareableHandle holds (osHandle:
 * the descriptor itself, cast, as cuda.h says for POSIX_FD); the caller may close its
 * descriptor afterwards. Counted on this process's GPU as a cuMemCreate is. Anything but one
 * of this fake's memfds: CUDA_ERROR_INVALID_VALUE. */
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                               void *osHandle, int shHandleType)
{
    fk_call c;
    fk_handle *h, **a = NULL;
    struct stat st;
    int fd = (int)(intptr_t)osHandle, dev;
    CUresult rc;
    if ((rc = enter("cuMemImportFromShareableHandle", &c)) != CUDA_SUCCESS)
        return rc;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    if (shHandleType != FK_POSIX_FD)
        return CUDA_ERROR_NOT_SUPPORTED;
    if ((dev = memfd_device(fd)) < 0 || fstat(fd, &st) != 0 || st.st_size <= 0 ||
        (size_t)st.st_size % FK_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = charge(c.dir, c.key, (size_t)st.st_size)) != CUDA_SUCCESS)
        return rc;
    if ((h = calloc(1, sizeof *h))) {
        h->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        h->size = (size_t)st.st_size;
        h->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        h->prop.requestedHandleTypes = FK_POSIX_FD;
        h->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        h->prop.location.id = dev;
        h->refs = 1;
        h->imported = 1;
        if (h->fd >= 0)
            a = handle_add(h, handle);
    }
    return a ? CUDA_SUCCESS : handle_failed(h, &c, (size_t)st.st_size);
}

/* -- streams and events --------------------------------------------------------------------- */

/* Each a heap object, its address the handle; listed, so that handles can be checked. */
typedef struct { int kind; unsigned int flags; } fk_obj;
enum { FK_STREAM = 1, FK_EVENT = 2 };
static pthread_mutex_t g_objs_lock = PTHREAD_MUTEX_INITIALIZER;
static fk_obj **g_objs;
static size_t g_nobjs, g_objs_cap;

static void *obj_new(int kind, unsigned int flags)
{
    fk_obj *o = malloc(sizeof *o), **a;
    if (!o)
        return NULL;
    *o = (fk_obj){kind, flags};
    pthread_mutex_lock(&g_objs_lock);
    if ((a = grow(g_objs, g_nobjs, &g_objs_cap, sizeof *a))) {
        g_objs = a;
        g_objs[g_nobjs++] = o;
    }
    pthread_mutex_unlock(&g_objs_lock);
    if (!a) {
        free(o);
        return NULL;
    }
    return o;
}

/* Is h a live object of that kind? With drop: frees it too. */
static int obj_known(const void *h, int kind, int drop)
{
    int found = 0;
    pthread_mutex_lock(&g_objs_lock);
    for (size_t i = 0; i < g_nobjs && !found; i++)
        if (g_objs[i] == h && g_objs[i]->kind == kind) {
            found = 1;
            if (drop) {
                free(g_objs[i]);
                g_objs[i] = g_objs[--g_nobjs];
            }
        }
    pthread_mutex_unlock(&g_objs_lock);
    return found;
}

/* A stream this process made, or a default one: 0 (legacy), CU_STREAM_LEGACY (0x1),
 * CU_STREAM_PER_THREAD (0x2). */
static int stream_ok(CUstream s)
{
    return (uintptr_t)s <= 2 || obj_known(s, FK_STREAM, 0);
}

/* The stream and event calls that only check their handle after enter(): one of this
 * process's (drop: forgotten too); a stream's query and synchronize also take the default
 * streams (stream_ok). */
static CUresult handle_call(const char *call, const void *h, int kind, int drop)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter(call, &c)) != CUDA_SUCCESS)
        return rc;
    if (kind == FK_STREAM && !drop)
        return stream_ok((CUstream)h) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
    return obj_known(h, kind, drop) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Flags: CU_STREAM_DEFAULT (0) or CU_STREAM_NON_BLOCKING (1). */
EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuStreamCreate", &c)) != CUDA_SUCCESS)
        return rc;
    NEED_CURRENT();
    if (!phStream || (Flags & ~1u))
        return CUDA_ERROR_INVALID_VALUE;
    return (*phStream = obj_new(FK_STREAM, Flags)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    return handle_call("cuStreamDestroy_v2", hStream, FK_STREAM, 1);
}

EXPORT CUresult cuStreamQuery(CUstream hStream)
{
    return handle_call("cuStreamQuery", hStream, FK_STREAM, 0);
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    return handle_call("cuStreamSynchronize", hStream, FK_STREAM, 0);
}

/* Flags: CU_EVENT_DEFAULT, BLOCKING_SYNC (1), DISABLE_TIMING (2), INTERPROCESS (4). */
EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuEventCreate", &c)) != CUDA_SUCCESS)
        return rc;
    if (!phEvent || (Flags & ~7u))
        return CUDA_ERROR_INVALID_VALUE;
    return (*phEvent = obj_new(FK_EVENT, Flags)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuEventRecord", &c)) != CUDA_SUCCESS)
        return rc;
    return obj_known(hEvent, FK_EVENT, 0) && stream_ok(hStream) ? CUDA_SUCCESS
                                                                 : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuEventQuery(CUevent hEvent)
{
    return handle_call("cuEventQuery", hEvent, FK_EVENT, 0);
}

EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    return handle_call("cuEventSynchronize", hEvent, FK_EVENT, 0);
}

EXPORT CUresult cuEventDestroy_v2(CUevent hEvent)
{
    return handle_call("cuEventDestroy_v2", hEvent, FK_EVENT, 1);
}

/* Done before they return, from pinned or pageable host memory alike (the driver takes both). */
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost,
                                     size_t ByteCount, CUstream hStream)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemcpyHtoDAsync_v2", &c)) != CUDA_SUCCESS)
        return rc;
    if (!stream_ok(hStream))
        return CUDA_ERROR_INVALID_HANDLE;
    return counted(&c, FK_HTOD, ByteCount, copy_to_device(dstDevice, srcHost, ByteCount));
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                     CUstream hStream)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemcpyDtoHAsync_v2", &c)) != CUDA_SUCCESS)
        return rc;
    if (!stream_ok(hStream))
        return CUDA_ERROR_INVALID_HANDLE;
    return counted(&c, FK_DTOH, ByteCount, copy_from_device(dstHost, srcDevice, ByteCount));
}

/* -- pinned host memory --------------------------------------------------------------------- */

/* Adds host memory to the table unless it shares an address with some already there. Under
 * g_mem, written. */
static CUresult host_add(uintptr_t ptr, size_t size, int registered)
{
    fk_span *a;
    for (size_t i = 0; i < g_nhost; i++)
        if (g_host[i].ptr < ptr + size && ptr < g_host[i].ptr + g_host[i].size)
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (!(a = grow(g_host, g_nhost, &g_host_cap, sizeof *a)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    g_host = a;
    g_host[g_nhost++] = (fk_span){ptr, size, registered};
    return CUDA_SUCCESS;
}

/* Takes out the entry starting at ptr, of that kind; its size, or 0 when there is none. */
static size_t host_take(uintptr_t ptr, int registered)
{
    size_t size = 0;
    pthread_rwlock_wrlock(&g_mem);
    for (size_t i = 0; i < g_nhost; i++)
        if (g_host[i].ptr == ptr && g_host[i].registered == registered) {
            size = g_host[i].size;
            g_host[i] = g_host[--g_nhost];
            break;
        }
    pthread_rwlock_unlock(&g_mem);
    return size;
}

/* Page-aligned and zeroed. Flags: CU_MEMHOSTALLOC_PORTABLE (1), DEVICEMAP (2),
 * WRITECOMBINED (4). Host memory: it counts on no GPU. */
EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    fk_call c;
    void *m;
    CUresult rc;
    if ((rc = enter("cuMemHostAlloc", &c)) != CUDA_SUCCESS)
        return rc;
    if (!pp || !bytesize || (Flags & ~7u))
        return CUDA_ERROR_INVALID_VALUE;
    m = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
             -1, 0);
    if (m == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_rwlock_wrlock(&g_mem);
    rc = host_add((uintptr_t)m, bytesize, 0);
    pthread_rwlock_unlock(&g_mem);
    if (rc != CUDA_SUCCESS)
        munmap(m, bytesize);
    else
        *pp = m;
    return rc;
}

EXPORT CUresult cuMemFreeHost(void *p)
{
    fk_call c;
    size_t size;
    CUresult rc;
    if ((rc = enter("cuMemFreeHost", &c)) != CUDA_SUCCESS)
        return rc;
    if (!(size = host_take((uintptr_t)p, 0)))
        return CUDA_ERROR_INVALID_VALUE;
    munmap(p, size);
    return CUDA_SUCCESS;
}

/* Flags: CU_MEMHOSTREGISTER_PORTABLE (1), DEVICEMAP (2), IOMEMORY (4), READ_ONLY (8). A range
 * sharing an address with pinned or registered memory is
 * CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED. */
EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemHostRegister_v2", &c)) != CUDA_SUCCESS)
        return rc;
    NEED_CURRENT();
    if (!p || !bytesize || (Flags & ~15u) || (uintptr_t)p + bytesize < (uintptr_t)p)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_rwlock_wrlock(&g_mem);
    rc = host_add((uintptr_t)p, bytesize, 1);
    pthread_rwlock_unlock(&g_mem);
    return rc;
}

/* p: the start of a registered range. */
EXPORT CUresult cuMemHostUnregister(void *p)
{
    fk_call c;
    CUresult rc;
    if ((rc = enter("cuMemHostUnregister", &c)) != CUDA_SUCCESS)
        return rc;
    return host_take((uintptr_t)p, 1) ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

/* -- cuGetProcAddress ----------------------------------------------------------------------- */

/* cuGetProcAddress answers from a table, as the driver does: the base name (cuda.h's, without
 * a version suffix) gives the newest version this fake has; cudaVersion and flags are not
 * looked at. Its addresses are hidden aliases of the exports, so a preloaded library that
 * exports the same names (torpor's agent) does not change the answers: the agent must catch
 * this door itself. The _v2 of 12.0 adds symbolStatus (CUdriverProcAddressQueryResult:
 * 0 found, 1 symbol not found). */
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                 uint64_t flags);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    uint64_t flags, int *symbolStatus);

#define FK_PROCS(X)                                                                          \
    X(cuGetErrorName, cuGetErrorName) X(cuGetErrorString, cuGetErrorString)                  \
    X(cuDriverGetVersion, cuDriverGetVersion) X(cuInit, cuInit)                              \
    X(cuDeviceGetCount, cuDeviceGetCount) X(cuDeviceGet, cuDeviceGet)                        \
    X(cuDeviceGetName, cuDeviceGetName) X(cuDeviceGetUuid, cuDeviceGetUuid_v2)               \
    X(cuDeviceTotalMem, cuDeviceTotalMem_v2) X(cuCtxCreate, cuCtxCreate_v2)                  \
    X(cuCtxDestroy, cuCtxDestroy_v2) X(cuCtxPushCurrent, cuCtxPushCurrent_v2)                \
    X(cuCtxPopCurrent, cuCtxPopCurrent_v2) X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain) \
    X(cuCtxGetCurrent, cuCtxGetCurrent) X(cuCtxSetCurrent, cuCtxSetCurrent)                  \
    X(cuCtxGetDevice, cuCtxGetDevice)                                                        \
    X(cuCtxSynchronize, cuCtxSynchronize) X(cuMemAlloc, cuMemAlloc_v2)                       \
    X(cuMemAllocPitch, cuMemAllocPitch_v2) X(cuMemFree, cuMemFree_v2)                        \
    X(cuMemGetInfo, cuMemGetInfo_v2) X(cuMemGetAddressRange, cuMemGetAddressRange_v2)        \
    X(cuPointerGetAttribute, cuPointerGetAttribute)                                          \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity)                          \
    X(cuMemAddressReserve, cuMemAddressReserve) X(cuMemAddressFree, cuMemAddressFree)        \
    X(cuMemCreate, cuMemCreate) X(cuMemRelease, cuMemRelease) X(cuMemMap, cuMemMap)          \
    X(cuMemUnmap, cuMemUnmap) X(cuMemSetAccess, cuMemSetAccess)                              \
    X(cuMemGetAllocationPropertiesFromHandle, cuMemGetAllocationPropertiesFromHandle)        \
    X(cuMemRetainAllocationHandle, cuMemRetainAllocationHandle)                              \
    X(cuMemExportToShareableHandle, cuMemExportToShareableHandle)                            \
    X(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle)                        \
    X(cuLaunchKernel, cuLaunchKernel) X(cuMemcpyHtoD, cuMemcpyHtoD_v2)                       \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2) X(cuStreamSynchronize, cuStreamSynchronize)             \
    X(cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2) X(cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2)    \
    X(cuMemsetD8, cuMemsetD8_v2) X(cuMemsetD8Async, cuMemsetD8Async)                         \
    X(cuStreamCreate, cuStreamCreate) X(cuStreamDestroy, cuStreamDestroy_v2)                 \
    X(cuStreamQuery, cuStreamQuery) X(cuEventCreate, cuEventCreate)                          \
    X(cuEventRecord, cuEventRecord) X(cuEventQuery, cuEventQuery)                            \
    X(cuEventSynchronize, cuEventSynchronize) X(cuEventDestroy, cuEventDestroy_v2)           \
    X(cuMemHostAlloc, cuMemHostAlloc) X(cuMemFreeHost, cuMemFreeHost)                        \
    X(cuMemHostRegister, cuMemHostRegister_v2) X(cuMemHostUnregister, cuMemHostUnregister)   \
    X(cuGetProcAddress, cuGetProcAddress_v2)                                                 \
    X(cuCheckpointProcessGetState, cuCheckpointProcessGetState)                              \
    X(cuCheckpointProcessLock, cuCheckpointProcessLock)                                      \
    X(cuCheckpointProcessCheckpoint, cuCheckpointProcessCheckpoint)                          \
    X(cuCheckpointProcessRestore, cuCheckpointProcessRestore)                                \
    X(cuCheckpointProcessUnlock, cuCheckpointProcessUnlock)                                  \
    X(cuCheckpointProcessGetRestoreThreadId, cuCheckpointProcessGetRestoreThreadId)

#define FK_ALIAS(base, sym) \
    extern __typeof__(sym) fk_proc_##sym __attribute__((alias(#sym), visibility("hidden")));
FK_PROCS(FK_ALIAS)
#define FK_ENTRY(base, sym) {#base, (void *)fk_proc_##sym},
static const struct { const char *name; void *fn; } PROCS[] = { FK_PROCS(FK_ENTRY) };

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    uint64_t flags, int *symbolStatus)
{
    (void)cudaVersion, (void)flags;
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof PROCS / sizeof PROCS[0]; i++)
        if (!strcmp(PROCS[i].name, symbol)) {
            *pfn = PROCS[i].fn;
            break;
        }
    if (symbolStatus)
        *symbolStatus = *pfn ? 0 : 1;
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, uint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
