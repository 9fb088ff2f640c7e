/* Shared by fake_libcuda.c and fake_nvml.c: the on-disk state of the fake GPU host.
 *
 * Everything lives under $FAKE_CUDA_STATE_DIR, read at every call (several processes share it):
 *   gpus              one GPU a line, index = line order:  <uuid>|<name>|<total bytes>
 *                     ('#' comments and blank lines are skipped; uuid like GPU-xxxxxxxx-xxxx-...)
 *   proc/<pid>        one CUDA process, key=value lines: state=0..3, gpu=<uuid>, mem=<bytes>,
 *                     restored_pairs=<old>:<new>,...  (written atomically: tmp + rename)
 *   fail/<call>       "<CUresult> [pid]": <call> returns that CUresult without changing state
 *   hang/lock         "[pid]": lock waits out its timeout and returns CUDA_ERROR_TIMEOUT
 *   delay/<call>      "<ms> [pid]": <call> sleeps that long first
 *   calls.log         one line per checkpoint-API call: "<call> <pid> <CUresult>"
 *   cuda_version      optional, e.g. "13000" (cuDriverGetVersion / nvmlSystemGetCudaDriverVersion)
 *   driver_version    optional, e.g. "999.0-fake" (nvmlSystemGetDriverVersion)
 *   .lock             flock()ed around every read-modify-write of proc/<pid>
 */
#ifndef FAKE_COMMON_H
#define FAKE_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FK_MAX_GPUS 64
#define FK_UUID_LEN 96
#define FK_NAME_LEN 96
#define FK_PAIRS_LEN 2048
#define FK_EXTRA_LEN 2048

typedef struct {
    char uuid[FK_UUID_LEN];
    char name[FK_NAME_LEN];
    unsigned long long total;
} fk_gpu;

typedef struct {
    int state;
    char gpu[FK_UUID_LEN];
    unsigned long long mem;
    char pairs[FK_PAIRS_LEN];
    char extra[FK_EXTRA_LEN]; /* unknown lines, kept as they were */
} fk_proc;

enum { FK_RUNNING = 0, FK_LOCKED = 1, FK_CHECKPOINTED = 2, FK_FAILED = 3 };

static inline const char *fk_dir(void)
{
    const char *d = getenv("FAKE_CUDA_STATE_DIR");
    struct stat st;
    if (!d || !*d || stat(d, &st) != 0 || !S_ISDIR(st.st_mode))
        return NULL;
    return d;
}

static inline void fk_sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static inline double fk_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000.0 + ts.tv_nsec / 1e6;
}

static inline char *fk_trim(char *s)
{
    char *e;
    while (*s && isspace((unsigned char)*s))
        s++;
    e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = 0;
    return s;
}

/* Reads a small file whole; returns its length or -1. */
static inline int fk_read_file(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    size_t n = 0;
    ssize_t r;
    if (fd < 0)
        return -1;
    while (n + 1 < size && (r = read(fd, buf + n, size - 1 - n)) != 0) {
        if (r < 0) {
            if (errno == EINTR)
                continue;
            close(fd);
            return -1;
        }
        n += (size_t)r;
    }
    buf[n] = 0;
    close(fd);
    return (int)n;
}

static inline int fk_write_atomic(const char *path, const char *data)
{
    char tmp[4096 + 32];
    size_t len = strlen(data), off = 0;
    int fd;
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    while (off < len) {
        ssize_t w = write(fd, data + off, len - off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            close(fd);
            unlink(tmp);
            return -1;
        }
        off += (size_t)w;
    }
    close(fd);
    if (rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* "GPU-8c6d..." / "MIG-..." / bare -> 16 bytes; 0 on success. */
static inline int fk_uuid_parse(const char *s, unsigned char out[16])
{
    int n = 0;
    if (!strncasecmp(s, "GPU-", 4) || !strncasecmp(s, "MIG-", 4))
        s += 4;
    for (; *s && n < 32; s++) {
        int v;
        if (*s == '-')
            continue;
        if (*s >= '0' && *s <= '9')
            v = *s - '0';
        else if (*s >= 'a' && *s <= 'f')
            v = *s - 'a' + 10;
        else if (*s >= 'A' && *s <= 'F')
            v = *s - 'A' + 10;
        else
            return -1;
        if (n % 2 == 0)
            out[n / 2] = (unsigned char)(v << 4);
        else
            out[n / 2] |= (unsigned char)v;
        n++;
    }
    while (*s && isspace((unsigned char)*s))
        s++;
    return (n == 32 && *s == 0) ? 0 : -1;
}

static inline void fk_uuid_format(const unsigned char b[16], char *out, size_t size)
{
    snprintf(out, size,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

/* Same GPU? Compares the 16 bytes when both parse, else the strings (case-insensitive). */
static inline int fk_uuid_eq(const char *a, const char *b)
{
    unsigned char x[16], y[16];
    if (fk_uuid_parse(a, x) == 0 && fk_uuid_parse(b, y) == 0)
        return memcmp(x, y, 16) == 0;
    return strcasecmp(a, b) == 0;
}

/* The GPUs; returns their count, or -1 when there is no gpus file. */
static inline int fk_read_gpus(const char *dir, fk_gpu *g, int max)
{
    char path[4096], buf[65536], *line, *save = NULL;
    int n = 0;
    snprintf(path, sizeof path, "%s/gpus", dir);
    if (fk_read_file(path, buf, sizeof buf) < 0)
        return -1;
    for (line = strtok_r(buf, "\n", &save); line && n < max; line = strtok_r(NULL, "\n", &save)) {
        char *uuid, *name, *total, *t = fk_trim(line);
        if (!*t || *t == '#')
            continue;
        uuid = t;
        name = strchr(uuid, '|');
        if (!name)
            continue;
        *name++ = 0;
        total = strchr(name, '|');
        if (total)
            *total++ = 0;
        snprintf(g[n].uuid, FK_UUID_LEN, "%s", fk_trim(uuid));
        snprintf(g[n].name, FK_NAME_LEN, "%s", fk_trim(name));
        g[n].total = total ? strtoull(fk_trim(total), NULL, 0) : 0;
        n++;
    }
    return n;
}

static inline int fk_find_gpu(const fk_gpu *g, int n, const char *uuid)
{
    for (int i = 0; i < n; i++)
        if (fk_uuid_eq(g[i].uuid, uuid))
            return i;
    return -1;
}

/* Alive = kill(pid, 0) works (EPERM counts as alive) and it is not a zombie. */
static inline int fk_alive(int pid)
{
    char path[64], buf[1024], *p;
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) != 0 && errno != EPERM)
        return 0;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (fk_read_file(path, buf, sizeof buf) > 0 && (p = strrchr(buf, ')')) && p[1] && p[2])
        if (p[2] == 'Z' || p[2] == 'X' || p[2] == 'x')
            return 0;
    return 1;
}

static inline void fk_proc_path(const char *dir, int pid, char *out, size_t size)
{
    snprintf(out, size, "%s/proc/%d", dir, pid);
}

/* 0 on success, -1 when there is no such file. */
static inline int fk_proc_read(const char *dir, int pid, fk_proc *p)
{
    char path[4096], buf[8192], *line, *save = NULL;
    memset(p, 0, sizeof *p);
    fk_proc_path(dir, pid, path, sizeof path);
    if (fk_read_file(path, buf, sizeof buf) < 0)
        return -1;
    for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '='), *key, *val;
        if (!eq)
            continue;
        *eq = 0;
        key = fk_trim(line);
        val = fk_trim(eq + 1);
        if (!strcmp(key, "state"))
            p->state = atoi(val);
        else if (!strcmp(key, "gpu"))
            snprintf(p->gpu, sizeof p->gpu, "%s", val);
        else if (!strcmp(key, "mem"))
            p->mem = strtoull(val, NULL, 10);
        else if (!strcmp(key, "restored_pairs"))
            snprintf(p->pairs, sizeof p->pairs, "%s", val);
        else {
            size_t used = strlen(p->extra);
            snprintf(p->extra + used, sizeof p->extra - used, "%s=%s\n", key, val);
        }
    }
    return 0;
}

static inline int fk_proc_write(const char *dir, int pid, const fk_proc *p)
{
    char path[4096], sub[4096], buf[8192];
    snprintf(sub, sizeof sub, "%s/proc", dir);
    mkdir(sub, 0755);
    fk_proc_path(dir, pid, path, sizeof path);
    snprintf(buf, sizeof buf, "state=%d\ngpu=%s\nmem=%llu\nrestored_pairs=%s\n%s", p->state,
             p->gpu, p->mem, p->pairs, p->extra);
    return fk_write_atomic(path, buf);
}

/* Bytes held on GPU `uuid` by live processes that are not CHECKPOINTED (skipping `except_pid`). */
static inline unsigned long long fk_used_on(const char *dir, const char *uuid, int except_pid)
{
    char path[4096];
    unsigned long long used = 0;
    DIR *d;
    struct dirent *e;
    snprintf(path, sizeof path, "%s/proc", dir);
    if (!(d = opendir(path)))
        return 0;
    while ((e = readdir(d))) {
        fk_proc p;
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0 || pid == except_pid)
            continue;
        if (fk_proc_read(dir, (int)pid, &p) == 0 && p.state != FK_CHECKPOINTED &&
            fk_uuid_eq(p.gpu, uuid) && fk_alive((int)pid))
            used += p.mem;
    }
    closedir(d);
    return used;
}

/* flock()ed guard for read-modify-write of the state directory. */
static inline int fk_lock(const char *dir)
{
    char path[4096];
    int fd;
    snprintf(path, sizeof path, "%s/.lock", dir);
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        while (flock(fd, LOCK_EX) != 0 && errno == EINTR)
            ;
    return fd;
}

static inline void fk_unlock(int fd)
{
    if (fd >= 0)
        close(fd);
}

#endif
