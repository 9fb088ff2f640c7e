/* A fake libcuda.so.1 for tests without a GPU: the few driver calls a test program needs, and
 * the six cuCheckpointProcess* calls with the exact ABI of cuda.h (CUDA 12.8+), acting on the
 * per-process files under $FAKE_CUDA_STATE_DIR (see fake_common.h for the layout).
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
 * In the target process, cuCtxSynchronize and cuMemAlloc block while the process is LOCKED or
 * CHECKPOINTED, as the real driver's API locks do.
 *
 * Processes are proc/<key> entries (fk_key_of): the caller passes a pid as its /proc numbers
 * it (the host pid, for a program in a container), and the entry is that process's key: the
 * pid itself, or "<FAKE_CUDA_SCOPE>.<innermost pid>" for a scoped program. Faults (fail/,
 * hang/, delay/) and calls.log go by the pid the caller passed; cuCheckpointProcess-
 * GetRestoreThreadId returns it too.
 */
#include "fake_common.h"

#include <pthread.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[16]; } CUuuid;

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    uint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    uint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUcheckpointLockArgs");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "CUcheckpointCheckpointArgs");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "CUcheckpointGpuPair");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUcheckpointRestoreArgs");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "CUcheckpointUnlockArgs");

#define EXPORT __attribute__((visibility("default")))

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
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
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int g_inited;         /* cuInit succeeded in this process */
static int g_registered;     /* this process made a context (it is a "CUDA process") */
static CUdeviceptr g_next_ptr = 0x7f0000000000ULL;

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
    const char *dir;
    int n = 0;
    CUresult rc;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_gpus(&dir, gpus, &n)) != CUDA_SUCCESS)
        return rc;
    if (ordinal < 0 || ordinal >= n)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir;
    int n = 0;
    CUresult rc;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_gpus(&dir, gpus, &n)) != CUDA_SUCCESS)
        return rc;
    if (dev < 0 || dev >= n)
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", gpus[dev].name);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    fk_gpu gpus[FK_MAX_GPUS];
    unsigned char b[16];
    const char *dir;
    int n = 0;
    CUresult rc;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_gpus(&dir, gpus, &n)) != CUDA_SUCCESS)
        return rc;
    if (dev < 0 || dev >= n)
        return CUDA_ERROR_INVALID_DEVICE;
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
    const char *dir;
    int n = 0;
    CUresult rc;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = need_gpus(&dir, gpus, &n)) != CUDA_SUCCESS)
        return rc;
    if (dev < 0 || dev >= n)
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)gpus[dev].total;
    return CUDA_SUCCESS;
}

/* Device addresses: the next one is handed out 1 MiB-aligned after the last, and remembered
 * with its size (cuMemFree_v2 gives the size back, cuMemcpy* check their range). */
typedef struct { CUdeviceptr ptr; size_t size; } fk_alloc;
static pthread_mutex_t g_alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static fk_alloc *g_allocs;
static size_t g_nallocs, g_allocs_cap;

static CUdeviceptr next_ptr(size_t bytesize)
{
    CUdeviceptr ptr;
    pthread_mutex_lock(&g_alloc_lock);
    ptr = g_next_ptr;
    g_next_ptr += (bytesize + 0xfffff) & ~(CUdeviceptr)0xfffff;
    if (g_nallocs == g_allocs_cap) {
        size_t cap = g_allocs_cap ? 2 * g_allocs_cap : 64;
        fk_alloc *a = realloc(g_allocs, cap * sizeof *a);
        if (a) {
            g_allocs = a;
            g_allocs_cap = cap;
        }
    }
    if (g_nallocs < g_allocs_cap)
        g_allocs[g_nallocs++] = (fk_alloc){ptr, bytesize};
    pthread_mutex_unlock(&g_alloc_lock);
    return ptr;
}

/* Forgets the allocation at ptr; returns 1 with its size, or 0 when there is none. */
static int take_alloc(CUdeviceptr ptr, size_t *size)
{
    int found = 0;
    pthread_mutex_lock(&g_alloc_lock);
    for (size_t i = 0; i < g_nallocs; i++)
        if (g_allocs[i].ptr == ptr) {
            *size = g_allocs[i].size;
            g_allocs[i] = g_allocs[--g_nallocs];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&g_alloc_lock);
    return found;
}

/* Is [ptr, ptr + n) inside one live allocation? */
static int in_alloc(CUdeviceptr ptr, size_t n)
{
    int found = 0;
    pthread_mutex_lock(&g_alloc_lock);
    for (size_t i = 0; i < g_nallocs && !found; i++)
        found = ptr >= g_allocs[i].ptr && n <= g_allocs[i].size &&
                ptr - g_allocs[i].ptr <= g_allocs[i].size - n;
    pthread_mutex_unlock(&g_alloc_lock);
    return found;
}

/* Registers the calling process as a CUDA process on GPU `dev`. */
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

EXPORT CUresult cuCtxSynchronize(void)
{
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    return wait_running(&dir, &p, key, sizeof key);
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    fk_gpu gpus[FK_MAX_GPUS];
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    int n, i, fd;
    CUresult rc;
    if (!dptr || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = wait_running(&dir, &p, key, sizeof key)) != CUDA_SUCCESS)
        return rc;
    n = fk_read_gpus(dir, gpus, FK_MAX_GPUS);
    fd = fk_lock(dir);
    if (fk_proc_read(dir, key, &p) != 0) {
        fk_unlock(fd);
        return CUDA_ERROR_DEINITIALIZED;
    }
    i = fk_find_gpu(gpus, n, p.gpu);
    if (i < 0)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else if (fk_used_on(dir, p.gpu, key) + p.mem + bytesize > gpus[i].total)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else {
        p.mem += bytesize;
        rc = fk_proc_write(dir, key, &p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
    }
    fk_unlock(fd);
    if (rc == CUDA_SUCCESS)
        *dptr = next_ptr(bytesize);
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
    const char *dir = fk_dir();
    *dirp = dir;
    if (!g_inited)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dir)
        return CUDA_ERROR_NO_DEVICE;
    if (fault(dir, "delay", call, pid, &v) && v > 0)
        fk_sleep_ms(v);
    if (fault(dir, "fail", call, pid, &v))
        return (CUresult)v;
    return -1;
}

/* Reads the live CUDA process `pid` (as the caller's /proc numbers it), its entry's key to
 * `key`; CUDA_ERROR_INVALID_VALUE when pid is not one. */
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

EXPORT CUresult cuCheckpointProcessGetState(int pid, int *state)
{
    const char *dir;
    char key[FK_KEY_LEN];
    fk_proc p;
    CUresult rc = begin("get_state", pid, &dir);
    if (rc == (CUresult)-1) {
        if (!state)
            rc = CUDA_ERROR_INVALID_VALUE;
        else if ((rc = get_proc(dir, pid, &p, key, sizeof key)) == CUDA_SUCCESS)
            *state = p.state;
    }
    log_call(dir, "get_state", pid, rc);
    return rc;
}

EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    const char *dir;
    char key[FK_KEY_LEN];
    fk_proc p;
    CUresult rc = begin("lock", pid, &dir);
    if (rc == (CUresult)-1) {
        unsigned int timeout = args ? args->timeoutMs : 0;
        if (args && (args->reserved0 || !all_zero(args->reserved1, sizeof args->reserved1)))
            rc = CUDA_ERROR_INVALID_VALUE;
        else if ((rc = get_proc(dir, pid, &p, key, sizeof key)) == CUDA_SUCCESS &&
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
        if (rc == CUDA_SUCCESS)
            rc = transition(dir, pid, FK_RUNNING, FK_LOCKED);
    }
    log_call(dir, "lock", pid, rc);
    return rc;
}

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    const char *dir;
    CUresult rc = begin("checkpoint", pid, &dir);
    if (rc == (CUresult)-1) {
        if (args && !all_zero(args, sizeof *args))
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            rc = transition(dir, pid, FK_LOCKED, FK_CHECKPOINTED);
    }
    log_call(dir, "checkpoint", pid, rc);
    return rc;
}

static CUresult do_restore(const char *dir, int pid, const CUcheckpointRestoreArgs *args)
{
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

EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    const char *dir;
    CUresult rc = begin("restore", pid, &dir);
    if (rc == (CUresult)-1)
        rc = do_restore(dir, pid, args);
    log_call(dir, "restore", pid, rc);
    return rc;
}

EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    const char *dir;
    CUresult rc = begin("unlock", pid, &dir);
    if (rc == (CUresult)-1) {
        if (args && !all_zero(args, sizeof *args))
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            rc = transition(dir, pid, FK_LOCKED, FK_RUNNING);
    }
    log_call(dir, "unlock", pid, rc);
    return rc;
}

EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    const char *dir;
    char key[FK_KEY_LEN];
    fk_proc p;
    CUresult rc = begin("restore_tid", pid, &dir);
    if (rc == (CUresult)-1) {
        if (!tid)
            rc = CUDA_ERROR_INVALID_VALUE;
        else if ((rc = get_proc(dir, pid, &p, key, sizeof key)) == CUDA_SUCCESS)
            *tid = pid;
    }
    log_call(dir, "restore_tid", pid, rc);
    return rc;
}

/* -- more driver calls, for torpor's agent (agent/) ----------------------------------------------
 * Memory (cuMemFree_v2, cuMemAllocPitch_v2), work (cuLaunchKernel, cuMemcpyHtoD_v2,
 * cuMemcpyDtoH_v2, cuStreamSynchronize), context stack (cuCtxPushCurrent_v2,
 * cuCtxPopCurrent_v2, cuCtxDestroy_v2, cuDevicePrimaryCtxRetain) and cuGetProcAddress(_v2).
 * Like cuCtxSynchronize they block while the process is LOCKED or CHECKPOINTED. Each first
 * sleeps as "$FAKE_CUDA_STATE_DIR/delay/<its name>" says ("<ms> [pid]", e.g.
 * delay/cuStreamSynchronize), so a test can hold a call in flight. No data is kept: copies
 * check that the device range lies in one live allocation, cuMemcpyDtoH_v2 writes zeros.
 */

/* Sleeps as delay/<call> says for this process. */
static void call_delay(const char *call)
{
    const char *dir = fk_dir();
    long v;
    if (dir && fault(dir, "delay", call, (int)getpid(), &v) && v > 0)
        fk_sleep_ms(v);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    size_t size;
    int fd;
    CUresult rc;
    call_delay("cuMemFree_v2");
    if ((rc = wait_running(&dir, &p, key, sizeof key)) != CUDA_SUCCESS)
        return rc;
    if (dptr == 0)
        return CUDA_SUCCESS;
    if (!take_alloc(dptr, &size))
        return CUDA_ERROR_INVALID_VALUE;
    fd = fk_lock(dir);
    if (fk_proc_read(dir, key, &p) != 0) {
        rc = CUDA_ERROR_DEINITIALIZED;
    } else {
        p.mem = p.mem > size ? p.mem - size : 0;
        rc = fk_proc_write(dir, key, &p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
    }
    fk_unlock(fd);
    return rc;
}

/* Rows of WidthInBytes rounded up to 512 bytes. The memory comes from cuMemAlloc_v2 called
 * by its exported name, as a driver may call its own entry points: under torpor's agent that
 * call is a nested one, which the agent must not count a second time. */
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                   size_t Height, unsigned int ElementSizeBytes)
{
    size_t pitch;
    CUresult rc;
    call_delay("cuMemAllocPitch_v2");
    if (!dptr || !pPitch || !WidthInBytes || !Height ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    pitch = (WidthInBytes + 511) & ~(size_t)511;
    rc = cuMemAlloc_v2(dptr, pitch * Height);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

EXPORT CUresult cuLaunchKernel(void *f, unsigned int gridDimX, unsigned int gridDimY,
                               unsigned int gridDimZ, unsigned int blockDimX,
                               unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, void *hStream, void **kernelParams,
                               void **extra)
{
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    CUresult rc;
    (void)sharedMemBytes, (void)hStream, (void)kernelParams, (void)extra;
    call_delay("cuLaunchKernel");
    if ((rc = wait_running(&dir, &p, key, sizeof key)) != CUDA_SUCCESS)
        return rc;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    CUresult rc;
    call_delay("cuMemcpyHtoD_v2");
    if ((rc = wait_running(&dir, &p, key, sizeof key)) != CUDA_SUCCESS)
        return rc;
    if ((!srcHost && ByteCount) || !in_alloc(dstDevice, ByteCount))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    CUresult rc;
    call_delay("cuMemcpyDtoH_v2");
    if ((rc = wait_running(&dir, &p, key, sizeof key)) != CUDA_SUCCESS)
        return rc;
    if ((!dstHost && ByteCount) || !in_alloc(srcDevice, ByteCount))
        return CUDA_ERROR_INVALID_VALUE;
    if (ByteCount)
        memset(dstHost, 0, ByteCount);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(void *hStream)
{
    fk_proc p;
    const char *dir;
    char key[FK_KEY_LEN];
    (void)hStream;
    call_delay("cuStreamSynchronize");
    return wait_running(&dir, &p, key, sizeof key);
}

/* The current-context stack of the calling thread (cuCtxCreate_v2 does not push here). */
static __thread CUcontext t_ctx_stack[16];
static __thread int t_ctx_top;

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

/* The same context cuCtxCreate_v2 makes (called by its exported name, see above). */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    return cuCtxCreate_v2(pctx, 0, dev);
}

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
    X(cuCtxSynchronize, cuCtxSynchronize) X(cuMemAlloc, cuMemAlloc_v2)                       \
    X(cuMemAllocPitch, cuMemAllocPitch_v2) X(cuMemFree, cuMemFree_v2)                        \
    X(cuLaunchKernel, cuLaunchKernel) X(cuMemcpyHtoD, cuMemcpyHtoD_v2)                       \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2) X(cuStreamSynchronize, cuStreamSynchronize)             \
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
