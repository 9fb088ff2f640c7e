/* A fake libnvidia-ml.so.1: enough NVML for pynvml (nvidia-ml-py) to list the fake GPUs of
 * $FAKE_CUDA_STATE_DIR (fake_common.h), their memory and their running compute processes.
 *
 * Memory used on a GPU = the mem of the live processes on it that are not CHECKPOINTED;
 * running processes = those same processes (a checkpointed process holds no GPU memory or
 * handles, as with the real driver). Struct layouts follow nvml.h / pynvml.
 * A process is reported by its pid as the caller's /proc numbers it: for a scoped entry
 * ("<scope>.<nspid>", fake_common.h) the pid of the live process with that key, found by
 * scanning /proc (fk_host_pid); an entry whose process is not found is skipped.
 */
#include "fake_common.h"

typedef int nvmlReturn_t;
struct nvmlDevice_st { int index; };
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2 << 24U)))

typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* = nvmlProcessInfo_v2_t = v3 */

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(nvmlMemory_v2 == 0x02000028, "nvmlMemory_v2");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");

#define EXPORT __attribute__((visibility("default")))

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

static struct nvmlDevice_st g_devs[FK_MAX_GPUS];
static int g_init_count;

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir = fk_dir();
    (void)flags;
    if (!dir || fk_read_gpus(dir, gpus, FK_MAX_GPUS) < 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    for (int i = 0; i < FK_MAX_GPUS; i++)
        g_devs[i].index = i;
    g_init_count++;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    if (g_init_count <= 0)
        return NVML_ERROR_UNINITIALIZED;
    g_init_count--;
    return NVML_SUCCESS;
}

static nvmlReturn_t need_init(const char **dir, fk_gpu *gpus, int *n)
{
    if (g_init_count <= 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!(*dir = fk_dir()) || (*n = fk_read_gpus(*dir, gpus, FK_MAX_GPUS)) < 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    return NVML_SUCCESS;
}

/* Resolves a handle to its GPU (read afresh). */
static nvmlReturn_t dev_of(nvmlDevice_t h, const char **dir, fk_gpu *gpus, fk_gpu **g)
{
    int n = 0;
    nvmlReturn_t rc = need_init(dir, gpus, &n);
    if (rc != NVML_SUCCESS)
        return rc;
    if (h < g_devs || h >= g_devs + FK_MAX_GPUS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (h->index >= n)
        return NVML_ERROR_GPU_IS_LOST;
    *g = &gpus[h->index];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_str(char *out, unsigned int length, const char *s)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

static void read_opt(const char *name, char *out, size_t size, const char *dflt)
{
    char path[4096], buf[256];
    const char *dir = fk_dir();
    snprintf(out, size, "%s", dflt);
    if (dir) {
        snprintf(path, sizeof path, "%s/%s", dir, name);
        if (fk_read_file(path, buf, sizeof buf) > 0 && *fk_trim(buf))
            snprintf(out, size, "%s", fk_trim(buf));
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    char v[128];
    if (g_init_count <= 0)
        return NVML_ERROR_UNINITIALIZED;
    read_opt("driver_version", v, sizeof v, "999.0-fake");
    return copy_str(version, length, v);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    char v[128], nv[160];
    if (g_init_count <= 0)
        return NVML_ERROR_UNINITIALIZED;
    read_opt("driver_version", v, sizeof v, "999.0-fake");
    snprintf(nv, sizeof nv, "13.%s", v);
    return copy_str(version, length, nv);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    char v[64];
    if (!cudaDriverVersion)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g_init_count <= 0)
        return NVML_ERROR_UNINITIALIZED;
    read_opt("cuda_version", v, sizeof v, "13000");
    *cudaDriverVersion = atoi(v) > 0 ? atoi(v) : 13000;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir;
    int n = 0;
    nvmlReturn_t rc;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = need_init(&dir, gpus, &n)) != NVML_SUCCESS)
        return rc;
    *deviceCount = (unsigned int)n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir;
    int n = 0;
    nvmlReturn_t rc;
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = need_init(&dir, gpus, &n)) != NVML_SUCCESS)
        return rc;
    if (index >= (unsigned int)n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_devs[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    fk_gpu gpus[FK_MAX_GPUS];
    const char *dir;
    int n = 0, i;
    nvmlReturn_t rc;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = need_init(&dir, gpus, &n)) != NVML_SUCCESS)
        return rc;
    if ((i = fk_find_gpu(gpus, n, uuid)) < 0)
        return NVML_ERROR_NOT_FOUND;
    *device = &g_devs[i];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc = dev_of(device, &dir, gpus, &g);
    return rc != NVML_SUCCESS ? rc : copy_str(uuid, length, g->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc = dev_of(device, &dir, gpus, &g);
    return rc != NVML_SUCCESS ? rc : copy_str(name, length, g->name);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = dev_of(device, &dir, gpus, &g)) == NVML_SUCCESS)
        *index = (unsigned int)device->index;
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    return nvmlDeviceGetIndex(device, minorNumber);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    unsigned long long used;
    nvmlReturn_t rc;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = dev_of(device, &dir, gpus, &g)) != NVML_SUCCESS)
        return rc;
    used = fk_used_on(dir, g->uuid, NULL);
    memory->total = g->total;
    memory->used = used;
    memory->free = used < g->total ? g->total - used : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlMemory_t m;
    nvmlReturn_t rc;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if ((rc = nvmlDeviceGetMemoryInfo(device, &m)) != NVML_SUCCESS)
        return rc;
    memory->total = m.total;
    memory->reserved = 0;
    memory->free = m.free;
    memory->used = m.used;
    return NVML_SUCCESS;
}

/* The compute processes on a GPU: live, on it, not CHECKPOINTED. Returns their count. */
static int procs_on(const char *dir, const char *uuid, nvmlProcessInfo_t *out, int max)
{
    char path[4096];
    int n = 0;
    DIR *d;
    struct dirent *e;
    snprintf(path, sizeof path, "%s/proc", dir);
    if (!(d = opendir(path)))
        return 0;
    while ((e = readdir(d))) {
        fk_proc p;
        int pid;
        if (!fk_key_kind(e->d_name))
            continue;
        if (fk_proc_read(dir, e->d_name, &p) != 0 || p.state == FK_CHECKPOINTED ||
            !fk_uuid_eq(p.gpu, uuid) || (pid = fk_host_pid(e->d_name)) <= 0)
            continue;
        if (n < max) {
            out[n].pid = (unsigned int)pid;
            out[n].usedGpuMemory = p.mem;
            out[n].gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            out[n].computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        }
        n++;
    }
    closedir(d);
    return n;
}

#define MAX_PROCS 1024

static nvmlReturn_t running(nvmlDevice_t device, unsigned int *count, void *infos, int v1)
{
    static nvmlProcessInfo_t found[MAX_PROCS];
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc;
    int n;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = dev_of(device, &dir, gpus, &g)) != NVML_SUCCESS)
        return rc;
    n = procs_on(dir, g->uuid, found, MAX_PROCS);
    if (n > MAX_PROCS)
        n = MAX_PROCS;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < (unsigned int)n) {
        *count = (unsigned int)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        if (v1) {
            ((nvmlProcessInfo_v1_t *)infos)[i].pid = found[i].pid;
            ((nvmlProcessInfo_v1_t *)infos)[i].usedGpuMemory = found[i].usedGpuMemory;
        } else {
            ((nvmlProcessInfo_t *)infos)[i] = found[i];
        }
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    return running(device, infoCount, infos, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    return running(device, infoCount, infos, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
                                                         unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos)
{
    return running(device, infoCount, infos, 1);
}

static nvmlReturn_t none_running(nvmlDevice_t device, unsigned int *count)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = dev_of(device, &dir, gpus, &g)) == NVML_SUCCESS)
        *count = 0;
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *c,
                                                             nvmlProcessInfo_t *i)
{
    (void)i;
    return none_running(d, c);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c,
                                                               nvmlProcessInfo_t *i)
{
    (void)i;
    return none_running(d, c);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = dev_of(device, &dir, gpus, &g)) != NVML_SUCCESS)
        return rc;
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = (unsigned int)(0x18 + device->index);
    pci->device = 0;
    pci->pciDeviceId = 0x233510DE;
    pci->pciSubSystemId = 0x18B010DE;
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                       int *minor)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc;
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = dev_of(device, &dir, gpus, &g)) == NVML_SUCCESS) {
        *major = 9;
        *minor = 0;
    }
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode)
{
    fk_gpu gpus[FK_MAX_GPUS], *g;
    const char *dir;
    nvmlReturn_t rc;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = dev_of(device, &dir, gpus, &g)) == NVML_SUCCESS)
        *mode = 1; /* NVML_FEATURE_ENABLED: restore needs persistence mode */
    return rc;
}
