/* A stand-in for NVIDIA's cuda-checkpoint utility (r555+ command line), for the upstream leg of
 * bench/upstream_path.py: podman + runc + CRIU's own cuda plugin (plugins/cuda), which runs
 * `cuda-checkpoint` from PATH. NVIDIA's public repository holds only the first, toggle-only
 * build (no --action), which the plugin refuses; this tool makes the same driver calls the
 * plugin asks for, one call per command, and nothing else:
 *   -h | --help                              usage (the plugin looks for "--action" in it)
 *   --get-state --pid PID                    running | locked | checkpointed | failed
 *   --get-restore-tid --pid PID              the restore thread's TID
 *   --action lock --pid PID [--timeout MS]   cuCheckpointProcessLock
 *   --action checkpoint --pid PID            cuCheckpointProcessCheckpoint
 *   --action restore --pid PID [--device-map OLD=NEW,...]  cuCheckpointProcessRestore
 *   --action unlock --pid PID                cuCheckpointProcessUnlock
 * Exit 0 done; 1 the driver said no (its error on stderr); 2 bad usage. libcuda.so.1 is loaded
 * at run time ($TORPOR_LIBCUDA names another, as for torpor: the tests' fake driver).
 * Where CALL_LOG exists (the benchmark creates it for its upstream leg; CRIU runs this tool
 * with runc's environment, so no variable reaches it), each call appends one line
 * "<what> <pid> <exit code>": proof that the plugin ran it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_checkpoint_types.h"

#ifndef CALL_LOG
#define CALL_LOG "/run/torpor-cuda-checkpoint-standin.log"
#endif

typedef int CUresult;
#define MAX_PAIRS 64

static void *lib;

static void *sym(const char *name)
{
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "cuda-checkpoint: the driver has no %s (driver 570 or newer needed)\n", name);
        exit(1);
    }
    return f;
}

static int check(CUresult rc, const char *call, int pid)
{
    const char *name = NULL, *text = NULL;
    CUresult (*get_name)(CUresult, const char **) = dlsym(lib, "cuGetErrorName");
    CUresult (*get_text)(CUresult, const char **) = dlsym(lib, "cuGetErrorString");
    if (rc == 0)
        return 0;
    if (get_name)
        get_name(rc, &name);
    if (get_text)
        get_text(rc, &text);
    fprintf(stderr, "cuda-checkpoint: %s(pid %d) failed: %s (%s)\n", call, pid,
            name ? name : "CUresult", text ? text : "unknown error");
    return 1;
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: cuda-checkpoint --action lock|checkpoint|restore|unlock --pid PID\n"
            "                       [--timeout MS] [--device-map OLD_UUID=NEW_UUID,...]\n"
            "       cuda-checkpoint --get-state --pid PID\n"
            "       cuda-checkpoint --get-restore-tid --pid PID\n"
            "torpor's stand-in for NVIDIA's cuda-checkpoint (r555+ command line): one driver call\n"
            "per command (cuCheckpointProcess*).\n");
}

/* "GPU-8c6d1b2e-...": 32 hex digits, dashes and the GPU-/MIG- prefix skipped */
static int parse_uuid(const char *s, CUuuid *out)
{
    int n = 0;
    if (!strncmp(s, "GPU-", 4) || !strncmp(s, "MIG-", 4))
        s += 4;
    for (; *s && n < 32; s++) {
        int v;
        if (*s == '-')
            continue;
        if (*s >= '0' && *s <= '9') v = *s - '0';
        else if (*s >= 'a' && *s <= 'f') v = *s - 'a' + 10;
        else if (*s >= 'A' && *s <= 'F') v = *s - 'A' + 10;
        else return -1;
        if (n % 2 == 0) out->bytes[n / 2] = (char)(v << 4);
        else out->bytes[n / 2] |= (char)v;
        n++;
    }
    return n == 32 && *s == '\0' ? 0 : -1;
}

static int parse_map(char *map, CUcheckpointGpuPair *pairs, unsigned *count)
{
    char *save = NULL;
    for (char *item = strtok_r(map, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq || *count >= MAX_PAIRS)
            return -1;
        *eq = '\0';
        if (parse_uuid(item, &pairs[*count].oldUuid) || parse_uuid(eq + 1, &pairs[*count].newUuid))
            return -1;
        (*count)++;
    }
    return 0;
}

static int run(int argc, char **argv);

int main(int argc, char **argv)
{
    int rc = run(argc, argv);
    FILE *log = access(CALL_LOG, W_OK) == 0 ? fopen(CALL_LOG, "a") : NULL;
    if (log) {
        const char *what = "?", *pid = "?";
        for (int i = 1; i < argc; i++) {
            if (!strncmp(argv[i], "--get-", 6) || !strcmp(argv[i], "-h")) what = argv[i];
            else if (!strcmp(argv[i], "--action") && i + 1 < argc) what = argv[i + 1];
            else if (!strcmp(argv[i], "--pid") && i + 1 < argc) pid = argv[i + 1];
        }
        fprintf(log, "%s %s %d\n", what, pid, rc);
        fclose(log);
    }
    return rc;
}

static int run(int argc, char **argv)
{
    enum { O_ACTION = 1, O_PID, O_TIMEOUT, O_MAP, O_STATE, O_TID };
    static const struct option opts[] = {
        {"action", required_argument, NULL, O_ACTION}, {"pid", required_argument, NULL, O_PID},
        {"timeout", required_argument, NULL, O_TIMEOUT},
        {"device-map", required_argument, NULL, O_MAP},
        {"get-state", no_argument, NULL, O_STATE}, {"get-restore-tid", no_argument, NULL, O_TID},
        {"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
    const char *action = NULL;
    char *map = NULL, *end;
    long pid = -1, timeout = 0;
    int what = 0, c;

    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'h': usage(stdout); return 0;
        case O_ACTION: action = optarg; what = O_ACTION; break;
        case O_STATE: case O_TID: what = c; break;
        case O_MAP: map = optarg; break;
        case O_PID:
            errno = 0;
            pid = strtol(optarg, &end, 10);
            if (errno || *end || pid <= 0 || pid > INT_MAX) pid = -2;
            break;
        case O_TIMEOUT:
            errno = 0;
            timeout = strtol(optarg, &end, 10);
            if (errno || *end || timeout < 0 || timeout > (long)UINT_MAX) timeout = -1;
            break;
        default: usage(stderr); return 2;
        }
    }
    if (!what || pid < 0 || timeout < 0 || optind != argc) {
        fprintf(stderr, "cuda-checkpoint: %s\n", pid == -2 ? "--pid takes a process id"
                        : timeout < 0 ? "--timeout takes milliseconds"
                        : "give --action, --get-state or --get-restore-tid with --pid (-h)");
        return 2;
    }
    if (what == O_ACTION && strcmp(action, "lock") && strcmp(action, "checkpoint") &&
        strcmp(action, "restore") && strcmp(action, "unlock")) {
        fprintf(stderr, "cuda-checkpoint: unknown action '%s' (lock, checkpoint, restore, unlock)\n",
                action);
        return 2;
    }
    const char *path = getenv("TORPOR_LIBCUDA");
    lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "cuda-checkpoint: no NVIDIA driver: %s\n", dlerror());
        return 1;
    }
    CUresult (*init)(unsigned) = sym("cuInit");
    if (check(init(0), "cuInit", (int)pid))
        return 1;

    if (what == O_STATE) {
        static const char *names[] = {"running", "locked", "checkpointed", "failed"};
        int state = -1;
        CUresult (*f)(int, int *) = sym("cuCheckpointProcessGetState");
        if (check(f((int)pid, &state), "cuCheckpointProcessGetState", (int)pid))
            return 1;
        printf("%s\n", state >= 0 && state <= CU_PROCESS_STATE_FAILED ? names[state] : "unknown");
        return 0;
    }
    if (what == O_TID) {
        int tid = 0;
        CUresult (*f)(int, int *) = sym("cuCheckpointProcessGetRestoreThreadId");
        if (check(f((int)pid, &tid), "cuCheckpointProcessGetRestoreThreadId", (int)pid))
            return 1;
        printf("%d\n", tid);
        return 0;
    }
    if (!strcmp(action, "lock")) {
        CUcheckpointLockArgs args = {.timeoutMs = (unsigned)timeout};
        CUresult (*f)(int, CUcheckpointLockArgs *) = sym("cuCheckpointProcessLock");
        return check(f((int)pid, &args), "cuCheckpointProcessLock", (int)pid);
    }
    if (!strcmp(action, "checkpoint")) {
        CUcheckpointCheckpointArgs args = {0};
        CUresult (*f)(int, CUcheckpointCheckpointArgs *) = sym("cuCheckpointProcessCheckpoint");
        return check(f((int)pid, &args), "cuCheckpointProcessCheckpoint", (int)pid);
    }
    if (!strcmp(action, "restore")) {
        static CUcheckpointGpuPair pairs[MAX_PAIRS];
        CUcheckpointRestoreArgs args = {0};
        unsigned count = 0;
        if (map && parse_map(map, pairs, &count)) {
            fprintf(stderr, "cuda-checkpoint: --device-map takes OLD_UUID=NEW_UUID,... (at most %d)\n",
                    MAX_PAIRS);
            return 2;
        }
        args.gpuPairs = count ? pairs : NULL;
        args.gpuPairsCount = count;
        CUresult (*f)(int, CUcheckpointRestoreArgs *) = sym("cuCheckpointProcessRestore");
        return check(f((int)pid, &args), "cuCheckpointProcessRestore", (int)pid);
    }
    CUcheckpointUnlockArgs args = {0};
    CUresult (*f)(int, CUcheckpointUnlockArgs *) = sym("cuCheckpointProcessUnlock");
    return check(f((int)pid, &args), "cuCheckpointProcessUnlock", (int)pid);
}