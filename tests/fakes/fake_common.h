/* Shared by fake_libcuda.c and fake_nvml.c: the on-disk state of the fake GPU host.
 *
 * Everything lives under $FAKE_CUDA_STATE_DIR, read at every call (several processes share it):
 *   gpus              one GPU a line, index = line order:  <uuid>|<name>|<total bytes>
 *                     ('#' comments and blank lines are skipped; uuid like GPU-xxxxxxxx-xxxx-...)
 *   proc/<key>        one CUDA process, key=value lines: state=0..3, gpu=<uuid>, mem=<bytes>,
 *                     restored_pairs=<old>:<new>,...  (written atomically: tmp + rename; tmp
 *                     files start with '.', which no key does)
 *   fail/<call>       "<CUresult> [pid] [after=<n>] [times=<k>]": <call> returns that CUresult
 *                     without acting. pid: only that process's calls. after=<n>: the first n
 *                     calls (that the pid filter lets in) go through, whatever they return,
 *                     and only later ones fail; times=<k>: k calls fail, later ones go through
 *                     again. Both count down in the file itself (rewritten under .lock, so every
 *                     thread and process shares one count): "2 after=3" fails the 4th call and
 *                     every one after it, "2 after=3 times=1" the 4th only. Neither: every call.
 *   hang/lock         "[pid]": lock waits out its timeout and returns CUDA_ERROR_TIMEOUT
 *   delay/<call>      "<ms> [pid]": <call> sleeps that long first
 *                     <call>, for fail/ and delay/: a checkpoint call (get_state, lock,
 *                     checkpoint, restore, unlock, restore_tid; pid: the pid passed to it), or
 *                     the exported name of a call the program makes (cuMemcpyDtoHAsync_v2,
 *                     cuMemCreate, cuMemAlloc_v2, ...; pid: its getpid()): every call that
 *                     blocks while LOCKED (fake_libcuda.c) takes both
 *   calls.log         one line per checkpoint-API call: "<call> <pid> <CUresult>"
 *   copies/<key>      what the process copied: "dtoh <n>\nhtod <n>\nmemset <n>" bytes so far
 *   dirty             present: new physical memory (cuMemCreate) holds 0xA5 bytes, not zeros
 *   cuda_version      optional, e.g. "13000" (cuDriverGetVersion / nvmlSystemGetCudaDriverVersion)
 *   driver_version    optional, e.g. "999.0-fake" (nvmlSystemGetDriverVersion)
 *   .lock             flock()ed around every read-modify-write of proc/<key> and fail/ counts
 *
 * The key of a process (fk_key_of, the one place both sides compute it, so they agree):
 *   "<pid>"            normally: the pid, as today;
 *   "<scope>.<nspid>"  when the process's environment has FAKE_CUDA_SCOPE=<scope> (a token of
 *                      [A-Za-z0-9_.-], not starting with '.', at most FK_SCOPE_MAX chars; an
 *                      invalid one is ignored) and nspid is its pid in its own, innermost pid
 *                      namespace. Such a key survives what a containerized program goes
 *                      through: the host pid differs from getpid(), and a CRIU restore changes
 *                      the host pid and the pid namespace but keeps the nspid and environment.
 * The program computes its own key from /proc/self/environ and getpid() (= its innermost
 * NSpid); the host, given a host pid, from /proc/<pid>/environ and the last NSpid of
 * /proc/<pid>/status. The environment is read where the host reads it (the initial block, as
 * /proc shows it), not getenv(), so a later setenv() cannot make the two disagree.
 * A scoped key's process, for liveness and for the pid NVML reports, is found by scanning
 * /proc/[0-9]* (as the caller's /proc shows them) for a live process with that key
 * (fk_host_pid). Inside a container that scan only sees the container, so a program's own
 * memory accounting (cuMemAlloc) ignores processes outside it; the host side sees them all.
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
#define FK_SCOPE_MAX 128
#define FK_KEY_LEN (FK_SCOPE_MAX + 16)

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
    unsigned long long pidns; /* PID namespace inode of the process it is (fk_pidns) */
    char host[64];            /* "<host pid>:<start time>" of it, as the host last saw it */
    char image[FK_UUID_LEN];  /* GPU at the last checkpoint: what a CRIU image of it holds */
    char extra[FK_EXTRA_LEN]; /* unknown lines, kept as they were */
} fk_proc;

enum { FK_RUNNING = 0, FK_LOCKED = 1, FK_CHECKPOINTED = 2, FK_FAILED = 3 };

/* The state directory: $FAKE_CUDA_STATE_DIR, else its copy $TORPOR_FAKE_CUDA_STATE_DIR. An OCI
 * runtime gives a hook only the environment the spec names, and torpor's hooks get TORPOR_*
 * and PATH: a torpord a hook starts (torpord dead, a restore under way) reads the copy. */
static inline const char *fk_dir(void)
{
    const char *d = getenv("FAKE_CUDA_STATE_DIR");
    struct stat st;
    if (!d || !*d)
        d = getenv("TORPOR_FAKE_CUDA_STATE_DIR");
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
    const char *base = strrchr(path, '/');
    size_t len = strlen(data), off = 0;
    int fd;
    /* ".<name>.tmp.<pid>" next to it: a dot file, never mistaken for a proc/ key */
    base = base ? base + 1 : path;
    snprintf(tmp, sizeof tmp, "%.*s.%s.tmp.%d", (int)(base - path), path, base, (int)getpid());
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

/* -- process keys (see the top of this file) ------------------------------------------------ */

/* A valid FAKE_CUDA_SCOPE: [A-Za-z0-9_.-]{1,FK_SCOPE_MAX}, not starting with '.'. */
static inline int fk_scope_ok(const char *s, size_t len)
{
    if (len == 0 || len > FK_SCOPE_MAX || s[0] == '.')
        return 0;
    for (size_t i = 0; i < len; i++) { /* ASCII whatever the locale, as fakegpu.SCOPE_RE */
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return 0;
    }
    return 1;
}

/* A valid proc/ entry name: "<pid>" (returns 1) or "<scope>.<nspid>" (returns 2); else 0. */
static inline int fk_key_kind(const char *key)
{
    const char *dot = strrchr(key, '.'), *d;
    char *end;
    long v;
    if (!*key)
        return 0;
    if (!dot) {
        if (*key == '0')
            return 0;
        v = strtol(key, &end, 10);
        return (!*end && v > 0 && isdigit((unsigned char)*key)) ? 1 : 0;
    }
    for (d = dot + 1; *d; d++)
        if (!isdigit((unsigned char)*d))
            return 0;
    if (dot[1] == 0 || dot[1] == '0' || strtol(dot + 1, NULL, 10) <= 0)
        return 0;
    return fk_scope_ok(key, (size_t)(dot - key)) ? 2 : 0;
}

/* The FAKE_CUDA_SCOPE of /proc/<pid>/environ (pid 0: /proc/self), its first occurrence as
 * getenv() would take it; 1 when there is a valid one (copied to out), else 0. */
static inline int fk_scope_of(int pid, char *out, size_t size)
{
    static const char var[] = "FAKE_CUDA_SCOPE=";
    char path[64], *buf = NULL, *p, *end;
    size_t cap = 0, n = 0;
    int fd, found = 0;
    ssize_t r;
    if (pid > 0)
        snprintf(path, sizeof path, "/proc/%d/environ", pid);
    else
        snprintf(path, sizeof path, "/proc/self/environ");
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return 0;
    for (;;) { /* the whole block: environments can be large */
        if (n + 1 >= cap) {
            char *nb = cap < (64u << 20) ? realloc(buf, cap = cap ? cap * 2 : 16384) : NULL;
            if (!nb)
                break;
            buf = nb;
        }
        r = read(fd, buf + n, cap - 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    if (!buf)
        return 0;
    buf[n] = 0;
    for (p = buf, end = buf + n; p < end; p += strlen(p) + 1)
        if (!strncmp(p, var, sizeof var - 1)) {
            const char *v = p + sizeof var - 1;
            if (fk_scope_ok(v, strlen(v)) && strlen(v) < size) {
                snprintf(out, size, "%s", v);
                found = 1;
            }
            break;
        }
    free(buf);
    return found;
}

/* The last (innermost) value of the NSpid: line of /proc/<pid>/status; -1 when unreadable. */
static inline int fk_nspid_of(int pid)
{
    char path[64], buf[8192], *line, *tok, *save = NULL;
    int last = -1;
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    if (fk_read_file(path, buf, sizeof buf) < 0 || !(line = strstr(buf, "\nNSpid:")))
        return -1;
    line = strtok_r(line + 7, "\n", &save);
    for (tok = line ? strtok_r(line, " \t", &save) : NULL; tok; tok = strtok_r(NULL, " \t", &save))
        last = atoi(tok);
    return last;
}

/* The key of process `pid` (as this process's /proc numbers it), or of the calling process
 * when pid is 0: "<scope>.<nspid>" under a valid FAKE_CUDA_SCOPE, else "<pid>". */
static inline void fk_key_of(int pid, char *out, size_t size)
{
    char scope[FK_SCOPE_MAX + 1];
    int self = pid <= 0, nspid;
    if (self)
        pid = (int)getpid();
    if (fk_scope_of(self ? 0 : pid, scope, sizeof scope)) {
        /* getpid() is the pid in the caller's own (innermost) namespace; the host reads the
         * same number as the last NSpid. Without NSpid (kernel < 4.1) there are no nested
         * views to reconcile and the pid is it. */
        nspid = self ? pid : fk_nspid_of(pid);
        snprintf(out, size, "%s.%d", scope, nspid > 0 ? nspid : pid);
    } else {
        snprintf(out, size, "%d", pid);
    }
}

/* The live process whose key is `key`, by its pid in this process's /proc; 0 when none.
 * "<pid>": that pid if alive. "<scope>.<nspid>": scans /proc/[0-9]* for it (only processes
 * whose innermost NSpid matches have their environment read). */
static inline int fk_host_pid(const char *key)
{
    char k[FK_KEY_LEN];
    int kind = fk_key_kind(key), nspid, found = 0;
    DIR *d;
    struct dirent *e;
    if (kind == 1)
        return fk_alive(atoi(key)) ? atoi(key) : 0;
    if (kind != 2)
        return 0;
    nspid = atoi(strrchr(key, '.') + 1);
    if (!(d = opendir("/proc")))
        return 0;
    while (!found && (e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0 || fk_nspid_of((int)pid) != nspid)
            continue;
        fk_key_of((int)pid, k, sizeof k);
        if (!strcmp(k, key) && fk_alive((int)pid))
            found = (int)pid;
    }
    closedir(d);
    return found;
}

static inline void fk_proc_path(const char *dir, const char *key, char *out, size_t size)
{
    snprintf(out, size, "%s/proc/%s", dir, key);
}

/* 0 on success, -1 when there is no such file. */
static inline int fk_proc_read(const char *dir, const char *key, fk_proc *p)
{
    char path[4096], buf[8192], *line, *save = NULL;
    memset(p, 0, sizeof *p);
    if (!fk_key_kind(key))
        return -1;
    fk_proc_path(dir, key, path, sizeof path);
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
        else if (!strcmp(key, "pidns"))
            p->pidns = strtoull(val, NULL, 10);
        else if (!strcmp(key, "host"))
            snprintf(p->host, sizeof p->host, "%s", val);
        else if (!strcmp(key, "image"))
            snprintf(p->image, sizeof p->image, "%s", val);
        else {
            size_t used = strlen(p->extra);
            snprintf(p->extra + used, sizeof p->extra - used, "%s=%s\n", key, val);
        }
    }
    return 0;
}

static inline int fk_proc_write(const char *dir, const char *key, const fk_proc *p)
{
    char path[4096], sub[4096], buf[8192];
    if (!fk_key_kind(key))
        return -1;
    snprintf(sub, sizeof sub, "%s/proc", dir);
    mkdir(sub, 0755);
    fk_proc_path(dir, key, path, sizeof path);
    snprintf(buf, sizeof buf, "state=%d\ngpu=%s\nmem=%llu\nrestored_pairs=%s\npidns=%llu\n"
             "host=%s\nimage=%s\n%s", p->state, p->gpu, p->mem, p->pairs, p->pidns, p->host,
             p->image, p->extra);
    return fk_write_atomic(path, buf);
}

/* The inode of pid's PID namespace (0: this process's), the same seen from anywhere; 0 when
 * unknown. A CRIU restore of a container makes a new PID namespace: a new incarnation of the
 * same key. (Not the start time: /proc shows it shifted by the reader's time namespace, and
 * CRIU may restore into one.) */
static inline unsigned long long fk_pidns(int pid)
{
    char path[64], link[128];
    ssize_t n;
    if (pid > 0)
        snprintf(path, sizeof path, "/proc/%d/ns/pid", pid);
    else
        snprintf(path, sizeof path, "/proc/self/ns/pid");
    n = readlink(path, link, sizeof link - 1);
    if (n <= 0)
        return 0;
    link[n] = 0;
    return strncmp(link, "pid:[", 5) ? 0 : strtoull(link + 5, NULL, 10);
}

/* The driver state lives in the process: a process CRIU restored from an image into a new PID
 * namespace (same key, another namespace) is CHECKPOINTED on the GPU it was checkpointed on,
 * whatever its original did after the dump (--leave-running). Returns 1 when p changed (the
 * caller writes it). A bare process restored into the same PID namespace is not told apart. */
static inline int fk_adopt(fk_proc *p, unsigned long long pidns_now)
{
    if (!pidns_now || p->pidns == pidns_now)
        return 0;
    if (p->pidns && p->image[0]) {
        p->state = FK_CHECKPOINTED;
        snprintf(p->gpu, sizeof p->gpu, "%s", p->image);
    }
    p->pidns = pidns_now;
    return 1;
}

/* The host side's view of the same event, for host pid `pid`: a PID namespace inode can be
 * reused by the restored container, the host's "<pid>:<start time>" cannot (the host reads
 * /proc from its own namespaces, so start times compare). Returns 1 when p changed. */
static inline int fk_adopt_host(fk_proc *p, int pid)
{
    char path[64], buf[4096], id[64], *c;
    unsigned long long ns = fk_pidns(pid), start = 0;
    int field, moved, changed;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (fk_read_file(path, buf, sizeof buf) >= 0 && (c = strrchr(buf, ')'))) {
        for (field = 2; *c && field < 22; c++)
            if (*c == ' ')
                field++;
        start = strtoull(c, NULL, 10);
    }
    snprintf(id, sizeof id, "%d:%llu", pid, start);
    moved = (p->host[0] && strcmp(p->host, id)) || (p->pidns && ns && p->pidns != ns);
    changed = strcmp(p->host, id) || (ns && p->pidns != ns);
    if (moved && p->image[0]) {
        p->state = FK_CHECKPOINTED;
        snprintf(p->gpu, sizeof p->gpu, "%s", p->image);
    }
    snprintf(p->host, sizeof p->host, "%s", id);
    if (ns)
        p->pidns = ns;
    return changed;
}

/* Bytes held on GPU `uuid` by live processes that are not CHECKPOINTED (skipping the entry
 * `except_key`, if any). */
static inline unsigned long long fk_used_on(const char *dir, const char *uuid,
                                            const char *except_key)
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
        if (!fk_key_kind(e->d_name) || (except_key && !strcmp(e->d_name, except_key)))
            continue;
        if (fk_proc_read(dir, e->d_name, &p) == 0 && p.state != FK_CHECKPOINTED &&
            fk_uuid_eq(p.gpu, uuid) && fk_host_pid(e->d_name) > 0)
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
