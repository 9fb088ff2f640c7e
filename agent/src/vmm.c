/* The driver's virtual memory management API, the program's and the agent's.
 *
 * Memory the mover can release and re-create at the same address must come from this API:
 * an address reservation (cuMemAddressReserve), physical memory (cuMemCreate, a handle) mapped
 * into it (cuMemMap) and made accessible (cuMemSetAccess). The agent serves every cuMemAlloc of
 * at least TORPOR_AGENT_VMM_MIN bytes (default 2 MiB) that way itself (vmm_alloc), and tracks
 * the program's own use of the API (PyTorch expandable_segments, vLLM): the handles and where
 * they are mapped, with the access set on each mapping.
 *
 * TORPOR_AGENT_VMM_EXPORT (read once, with TORPOR_AGENT_VMM_MIN; on unless it is 0, since
 * held memory was measured on the H100 on 2026-12-06): the physical memory of every
 * cuMemAlloc the agent serves is created exportable as a POSIX file descriptor
 * (requestedHandleTypes), so that a leave-running checkpoint can hold it on the GPU through
 * the driver's checkpoint instead of copying it back (mover.c, "held"). A driver that refuses
 * that (any answer but out of memory) gets the allocation without it, one warning, and is not
 * asked again. The program's own cuMemCreate keeps the program's properties.
 *
 * Releasing (vmm_drop) unmaps a handle everywhere and releases it; the reservations stay.
 * Re-creating (vmm_recreate) makes a new handle of the same size and properties and maps it
 * where the old one was. The new handle has another value: the program keeps the old one, so
 * every hooked call taking or giving a handle translates (`id` is the value the program knows,
 * `real` the driver's now). A handle exported to another process (cuMemExportToShareableHandle)
 * is not movable: the other process maps that very memory. A mapping of a handle the agent
 * never saw created (imported from another process) is not movable either.
 *
 * A handle taken back from a held descriptor (vmm_adopt) is an imported one, which the driver
 * does not export again (the H200 refused it; tests/fakes' libcuda does too): the next
 * leave-running checkpoint would hold nothing. So the agent keeps a duplicate of the
 * descriptor it took the memory back from (close-on-exec, its file noted) and hands out
 * duplicates of it instead (vmm_export_fd). The kept descriptor is closed whenever the memory
 * would go or leave the program: the mover's drop, the program's release or cuMemFree, and in
 * a child after fork, where it would keep the parent's memory alive for the child's life and
 * be a descriptor CRIU cannot dump. Found to be another file (the program closed it and opened
 * something else there), it is forgotten, not closed.
 *
 * One mutex over both lists, never held across a driver call that can block on the GPU (the
 * VMM calls do not). Lists are linked: programs hold thousands of mappings at most, and these
 * calls are rare next to kernel launches (allocators cache).
 */
#define LOG_PREFIX "vmm: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_ACCESS 8  /* access descriptors kept per mapping (devices that may access it) */
#define MAX_DEVICES 64

struct phys {
	struct phys *next;
	CUmemGenericAllocationHandle id;   /* the value the program holds */
	CUmemGenericAllocationHandle real; /* the driver's handle now; 0 while dropped */
	size_t size;
	CUmemAllocationProp prop;
	CUdeviceptr own_va;  /* served a cuMemAlloc: the reservation (the program never saw the
			      * handle) */
	size_t own_asked;    /* ... and the size the program asked for */
	int nmaps;
	int refs;            /* the program's references: cuMemCreate, cuMemRetainAllocationHandle */
	unsigned dropped_by_program : 1; /* released as often as referenced: gone once its last
					  * mapping goes */
	unsigned shared : 1;             /* exported: not movable */
	unsigned moved : 1;              /* dropped by the mover: its data is in the files */
	int kept;            /* 1 + its slot in kept[]: the descriptor it was taken back from */
};

struct vmap {
	struct vmap *next;
	CUdeviceptr ptr;
	size_t size, offset;
	struct phys *ph; /* NULL: a handle the agent does not know */
	unsigned long long flags;
	CUmemAccessDesc access[MAX_ACCESS];
	int naccess;
};

static struct {
	pthread_mutex_t lock;
	struct phys *phys;
	struct vmap *maps;
	size_t min_size;             /* cuMemAlloc at least this: served from VMM (0: never) */
	size_t granularity[MAX_DEVICES];
	int disabled;                /* the driver refused; cuMemAlloc goes to the driver */
	int exportable;              /* TORPOR_AGENT_VMM_EXPORT not 0: asked for, and on; 0 once the
				      * driver refused it */
	int export_asked;            /* TORPOR_AGENT_VMM_EXPORT not 0 (vmm_hold_enabled) */
} vm = { .lock = PTHREAD_MUTEX_INITIALIZER };

static pthread_once_t min_once = PTHREAD_ONCE_INIT;

static void read_min(void)
{
	const char *v = getenv("TORPOR_AGENT_VMM_MIN");
	char *end;
	unsigned long long n;

	vm.min_size = 2ULL << 20;
	if (!v || !*v)
		return;
	n = strtoull(v, &end, 0);
	if (end == v || *end) {
		pr_warn("TORPOR_AGENT_VMM_MIN=%s is not a number of bytes: 2 MiB", v);
		return;
	}
	vm.min_size = n; /* 0: never */
	pr_info("cuMemAlloc of at least %llu bytes served from VMM%s", n, n ? "" : " (never)");
}

static void read_knobs(void)
{
	const char *v = getenv("TORPOR_AGENT_VMM_EXPORT");

	read_min();
	/* on unless turned off: 0, off, false or no (any case) turn it off; unset, empty, 1, on,
	 * true or yes leave it on; anything else leaves it on with a warning */
	vm.export_asked = 1;
	if (v && (!strcmp(v, "0") || !strcasecmp(v, "off") || !strcasecmp(v, "false") ||
		  !strcasecmp(v, "no")))
		vm.export_asked = 0;
	else if (v && *v && strcmp(v, "1") && strcasecmp(v, "on") && strcasecmp(v, "true") &&
		 strcasecmp(v, "yes"))
		pr_warn("TORPOR_AGENT_VMM_EXPORT=%s is not 0/off/false/no or 1/on/true/yes: on", v);
	vm.exportable = vm.export_asked;
	if (vm.exportable)
		pr_info("VMM allocations created exportable (POSIX file descriptors): held through "
			"a leave-running checkpoint");
}

/* -- lookups, under vm.lock ------------------------------------------------------------------ */

static struct phys *phys_by_id(CUmemGenericAllocationHandle id)
{
	for (struct phys *p = vm.phys; p; p = p->next)
		if (p->id == id && !p->own_va)
			return p;
	return NULL;
}

static struct phys *phys_by_real(CUmemGenericAllocationHandle real)
{
	for (struct phys *p = vm.phys; p; p = p->next)
		if (p->real == real)
			return p;
	return NULL;
}

static void phys_unlink(struct phys *ph)
{
	for (struct phys **pp = &vm.phys; *pp; pp = &(*pp)->next)
		if (*pp == ph) {
			*pp = ph->next;
			return;
		}
}

/* The descriptors the held memory was taken back from (one a phys at most), in a fixed array a
 * child after fork can close without walking the lists. Under vm.lock. */
static struct kept_fd {
	int fd1; /* the descriptor + 1; 0: a free slot */
	dev_t dev;
	ino_t ino;
	int marked; /* a device node or an anonymous inode: its description carries O_APPEND */
	int shared; /* marked, and another kept one's description too (vmm_kept_audit) */
} kept[HOLD_MAX];

/* kcmp(KCMP_FILE) of two of this process's descriptors: 0 one description, 1 or 2 their
 * order, -1 with errno. */
static long kcmp_file(pid_t pid, int a, int b)
{
#ifdef TORPOR_TEST_NO_KCMP
	/* a test build only (tests/unit/test_agent_held_bag.py): as under a seccomp profile that
	 * refuses kcmp (Docker's and Podman's defaults without CAP_SYS_PTRACE) */
	(void)pid, (void)a, (void)b;
	errno = EPERM;
	return -1;
#else
	return syscall(SYS_kcmp, pid, pid, 0 /* KCMP_FILE */, a, b);
#endif
}

int fd_same_description(int a, int b)
{
	int fa, fb, now;
	long rc;

	if (a == b)
		return 1;
	rc = kcmp_file(getpid(), a, b);
	if (rc >= 0)
		return rc == 0;
	/* no kcmp here (a kernel without it, a seccomp profile that refuses it): the status
	 * flags are the description's, O_NONBLOCK flipped on a shows on b */
	if ((fa = fcntl(a, F_GETFL)) < 0 || (fb = fcntl(b, F_GETFL)) < 0 ||
	    fcntl(a, F_SETFL, fa ^ O_NONBLOCK) < 0)
		return -1;
	now = fcntl(b, F_GETFL);
	fcntl(a, F_SETFL, fa);
	return now < 0 ? -1 : ((now ^ fb) & O_NONBLOCK) != 0;
}

struct kcmp_order {
	pid_t pid;
	const int *fds;
	int failed;
};

/* qsort_r's order of indices into o->fds by their open file descriptions, kcmp's own (an
 * order of the kernel's objects, the same for the same description); a failure is noted. */
static int kcmp_compare(const void *a, const void *b, void *arg)
{
	struct kcmp_order *o = arg;
	int i = *(const int *)a, j = *(const int *)b;
	long rc;

	if (o->failed)
		return 0;
	rc = kcmp_file(o->pid, o->fds[i], o->fds[j]);
	if (rc < 0 || rc > 2) {
		o->failed = 1;
		return 0;
	}
	return rc == 0 ? 0 : rc == 1 ? -1 : 1;
}

/* Without kcmp (a seccomp profile that refuses it: Docker's and Podman's defaults without
 * CAP_SYS_PTRACE): O_NONBLOCK set on each one to one bit of its index, on all of them in
 * order, then read back. A description two share carries the bit of the one set last, which
 * the other reads back where their indices differ, and over every bit of the index each pair
 * differs once; set first upward, then downward, both of each pair are marked (what
 * vmm_kept_audit needs: the one it must not hand out may be either). 4 n log n calls; each
 * one's status flags set back after. -1: no memory for it. */
static int shared_by_flags(const int *fds, int n, unsigned char *shared)
{
	int *fl = malloc(sizeof(int) * (size_t)n);

	if (!fl)
		return -1;
	for (int i = 0; i < n; i++)
		if ((fl[i] = fcntl(fds[i], F_GETFL)) < 0)
			shared[i] = 1; /* cannot be told */
	for (int pass = 0; pass < 2 * 32 && (1L << pass / 2) < n; pass++) {
		int bit = pass / 2;

		for (int k = 0; k < n; k++) {
			int i = pass % 2 ? n - 1 - k : k;

			if (fl[i] >= 0)
				fcntl(fds[i], F_SETFL, (fl[i] & ~O_NONBLOCK) |
					  ((i >> bit) & 1 ? O_NONBLOCK : 0));
		}
		for (int i = 0; i < n; i++) {
			int now;

			if (fl[i] < 0)
				continue;
			now = fcntl(fds[i], F_GETFL);
			if (now < 0 || !!(now & O_NONBLOCK) != ((i >> bit) & 1))
				shared[i] = 1;
		}
	}
	for (int i = 0; i < n; i++)
		if (fl[i] >= 0)
			fcntl(fds[i], F_SETFL, fl[i]);
	free(fl);
	return 0;
}

/* Which of fds[0..n) share an open file description with another of them: shared[i] set for
 * each of them (also when that cannot be told); the number set. Sorted by kcmp's order (n log n calls: a program holds thousands of allocations'
 * descriptors); without kcmp, by their status flags (shared_by_flags); for a few, pairwise
 * (fd_same_description). */
int fd_shared_descriptions(const int *fds, int n, unsigned char *shared)
{
	struct kcmp_order o = { getpid(), fds, 0 };
	int *idx, count = 0;

	memset(shared, 0, (size_t)n);
	if (n < 2)
		return 0;
	idx = n > 16 ? malloc(sizeof(int) * (size_t)n) : NULL;
	if (idx) {
		for (int i = 0; i < n; i++)
			idx[i] = i;
		qsort_r(idx, (size_t)n, sizeof(int), kcmp_compare, &o);
		for (int i = 1; !o.failed && i < n; i++) {
			long rc = kcmp_file(o.pid, fds[idx[i - 1]], fds[idx[i]]);

			if (rc < 0)
				o.failed = 1;
			else if (rc == 0)
				shared[idx[i - 1]] = shared[idx[i]] = 1;
		}
		free(idx);
		if (!o.failed)
			goto counted;
		memset(shared, 0, (size_t)n);
		if (!shared_by_flags(fds, n, shared))
			goto counted;
		memset(shared, 0, (size_t)n);
	}
	for (int j = 1; j < n; j++)
		for (int i = 0; i < j; i++)
			if (fd_same_description(fds[i], fds[j]))
				shared[i] = shared[j] = 1;
counted:
	for (int i = 0; i < n; i++)
		count += shared[i];
	return count;
}

/* Does fd (of the file recorded in k) still look like the one kept? A device node or an
 * anonymous inode is the same file for every descriptor of it (the driver's are all
 * /dev/nvidiactl): the O_APPEND that kept_add set on the kept one's description, which no
 * driver descriptor of the program carries, tells it from one the program opened later under
 * that number. */
static int kept_is(const struct kept_fd *k, int fd)
{
	struct stat st;
	int fl;

	if (fstat(fd, &st) != 0 || st.st_dev != k->dev || st.st_ino != k->ino)
		return 0;
	return !k->marked || ((fl = fcntl(fd, F_GETFL)) >= 0 && (fl & O_APPEND));
}

/* Under vm.lock: the kept descriptor, if it is still the file it was (else forgotten, not
 * closed); -1 if none. */
static int kept_get(struct phys *ph)
{
	struct kept_fd *k = ph->kept ? &kept[ph->kept - 1] : NULL;

	if (!k)
		return -1;
	if (kept_is(k, k->fd1 - 1))
		return k->fd1 - 1;
	pr_warn("the descriptor 0x%llx was taken back from is another file now: not kept",
		ph->id);
	k->fd1 = 0;
	ph->kept = 0;
	return -1;
}

/* Before a prepare hands out kept descriptors (mover.c, hold_export): which marked ones share
 * their description with another kept one (or cannot be told from one)? The mark is the
 * description's, and the program's own export of memory taken back gets a duplicate of it:
 * put at another allocation's kept number, it would pass for that one's, and a prepare would
 * hand out this memory as that allocation's. Such a one is not handed out (vmm_export_fd). */
void vmm_kept_audit(void)
{
	static int fds[HOLD_MAX], slot[HOLD_MAX];
	static unsigned char shared[HOLD_MAX];
	int n = 0, marked = 0;

	pthread_mutex_lock(&vm.lock);
	for (int i = 0; i < HOLD_MAX; i++) {
		kept[i].shared = 0;
		/* one the program closed, or put something else at (kept_get forgets it when its
		 * allocation is exported): not in the comparison, which it would make fail */
		if (kept[i].fd1 && kept_is(&kept[i], kept[i].fd1 - 1)) {
			marked |= kept[i].marked;
			slot[n] = i;
			fds[n++] = kept[i].fd1 - 1;
		}
	}
	if (marked && fd_shared_descriptions(fds, n, shared))
		for (int k = 0; k < n; k++)
			kept[slot[k]].shared = shared[k] && kept[slot[k]].marked;
	pthread_mutex_unlock(&vm.lock);
}

/* Under vm.lock: the kept descriptor out of the table, to be closed (kept_close) once the
 * lock is let go: the close may be what frees the GPU memory, a driver call the lock is never
 * held across. -1 if none. */
static int kept_take(struct phys *ph)
{
	int fd = kept_get(ph);

	if (fd >= 0) {
		kept[ph->kept - 1].fd1 = 0;
		ph->kept = 0;
	}
	return fd;
}

static void kept_close(int fd)
{
	if (fd >= 0)
		close(fd);
}

/* Where kept descriptors go: high, away from the numbers a program opens and closes (as CRIU
 * keeps its own), under the soft limit with room for all of them, but not above 4096 (the
 * kernel sizes a process's descriptor table to its highest descriptor: PyTorch raises the
 * limit to a million); else anywhere above 2. */
static int kept_floor(void)
{
	struct rlimit rl;
	rlim_t top;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
		return 3;
	top = rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > 4096 ? 4096 : rl.rlim_cur;
	return top >= 4 * HOLD_DIRECT ? (int)(top - 2 * HOLD_DIRECT) : 3;
}

/* Under vm.lock: a duplicate of fd kept for ph. Its identity is what tells it from whatever
 * the program opens under that number later: its file, and for a device node or an anonymous
 * inode (one file for every descriptor of it: the driver's are all /dev/nvidiactl) O_APPEND
 * set on its description (kept_is). None kept (no slot, no descriptor, a mark that does not
 * hold): the next prepare asks the driver, which may refuse an imported handle, and that
 * checkpoint copies. */
static void kept_add(struct phys *ph, int fd)
{
	static int warned;
	char path[40], link[64] = "";
	struct stat st;
	int i, dup = -1, shared, fl;

	kept_close(kept_take(ph)); /* none: adopted from a dropped handle */
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	if (fstat(fd, &st) < 0)
		return;
	shared = S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ||
		 (readlink(path, link, sizeof(link) - 1) > 0 && !strncmp(link, "anon_inode:", 11));
	/* the description is the client's too (and the copier's): O_APPEND means nothing to a
	 * device node or to an import */
	if (shared && ((fl = fcntl(fd, F_GETFL)) < 0 ||
		       (!(fl & O_APPEND) && fcntl(fd, F_SETFL, fl | O_APPEND) < 0) ||
		       !(fcntl(fd, F_GETFL) & O_APPEND))) {
		if (!warned++)
			pr_info("held memory: the driver's descriptors cannot be marked (%s): none "
				"kept (a periodic checkpoint holds every other time)", strerror(errno));
		return;
	}
	for (i = 0; i < HOLD_MAX && kept[i].fd1; i++)
		;
	if (i < HOLD_MAX) {
		dup = fcntl(fd, F_DUPFD_CLOEXEC, kept_floor());
		if (dup < 0)
			dup = fcntl(fd, F_DUPFD_CLOEXEC, 3);
	}
	if (dup < 0) {
		if (!warned++)
			pr_warn("held memory: no descriptor kept for 0x%llx (%s): the next checkpoint "
				"may copy it", ph->id, i < HOLD_MAX ? strerror(errno) : "no slot");
		return;
	}
	kept[i] = (struct kept_fd){ .fd1 = dup + 1, .dev = st.st_dev, .ino = st.st_ino,
				    .marked = shared };
	ph->kept = i + 1;
}

/* Every kept descriptor closed: after a prepare's drop none may stay open in the program
 * through the driver's checkpoint and CRIU's dump (the dropped ones' went with the drop; an
 * allocation the prepare did not move, unmapped or exported since it was taken back, keeps
 * its own until here). */
void vmm_kept_close_all(void)
{
	static int fds[HOLD_MAX]; /* the control thread's: a prepare's */
	int n = 0;

	pthread_mutex_lock(&vm.lock);
	for (struct phys *ph = vm.phys; ph; ph = ph->next) {
		int fd = kept_take(ph);

		if (fd >= 0 && n < HOLD_MAX)
			fds[n++] = fd;
	}
	pthread_mutex_unlock(&vm.lock);
	while (n)
		kept_close(fds[--n]);
}

static struct phys *phys_new(CUmemGenericAllocationHandle h, size_t size,
			     const CUmemAllocationProp *prop)
{
	struct phys *ph = calloc(1, sizeof(*ph));

	if (!ph)
		return NULL;
	ph->id = ph->real = h;
	ph->refs = 1;
	ph->size = size;
	ph->prop = *prop;
	ph->next = vm.phys;
	vm.phys = ph;
	return ph;
}

static struct vmap *map_new(CUdeviceptr ptr, size_t size, size_t offset, struct phys *ph,
			    unsigned long long flags)
{
	struct vmap *m = calloc(1, sizeof(*m));

	if (!m)
		return NULL;
	m->ptr = ptr;
	m->size = size;
	m->offset = offset;
	m->ph = ph;
	m->flags = flags;
	m->next = vm.maps;
	vm.maps = m;
	if (ph)
		ph->nmaps++;
	return m;
}

/* Records access descriptors on every mapping inside [ptr, ptr + size). */
static void access_record(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
			  size_t count)
{
	for (struct vmap *m = vm.maps; m; m = m->next) {
		if (m->ptr < ptr || m->ptr + m->size > ptr + size)
			continue;
		for (size_t i = 0; i < count; i++) {
			int k;

			for (k = 0; k < m->naccess; k++)
				if (m->access[k].location.type == desc[i].location.type &&
				    m->access[k].location.id == desc[i].location.id)
					break;
			if (k == m->naccess) {
				if (m->naccess == MAX_ACCESS) {
					pr_warn("0x%llx: more than %d access descriptors: not all are "
						"restored", m->ptr, MAX_ACCESS);
					continue;
				}
				m->naccess++;
			}
			m->access[k] = desc[i];
		}
	}
}

/* The driver's handle now for the program's handle value (and its entry, or NULL when the
 * agent does not know it: then the value goes to the driver as it is). */
static CUmemGenericAllocationHandle translate(CUmemGenericAllocationHandle id, struct phys **out)
{
	struct phys *ph;

	pthread_mutex_lock(&vm.lock);
	ph = phys_by_id(id);
	if (ph)
		id = ph->real;
	pthread_mutex_unlock(&vm.lock);
	if (out)
		*out = ph;
	return id;
}

/* -- the program's calls ----------------------------------------------------------------------- */

void vmm_create_pre(struct track *t, CUmemGenericAllocationHandle *handle, size_t size,
		    const CUmemAllocationProp *prop, unsigned long long flags)
{
	t->handled = 1;
	t->rc = real.cuMemCreate ? real.cuMemCreate(handle, size, prop, flags)
				 : CUDA_ERROR_NOT_SUPPORTED;
	if (t->rc != CUDA_SUCCESS || !handle || !prop)
		return;
	pthread_mutex_lock(&vm.lock);
	/* A value the driver gives again may equal an id the program still holds from before
	 * a re-creation: then the program could not tell the two apart. Rare (the driver's
	 * handles are pointers); the newer one (first in the list) is what that value means
	 * from now on. */
	if (phys_by_id(*handle))
		pr_warn("handle 0x%llx given again while the program holds an older handle of that "
			"value: the value means the newer one from now on", *handle);
	if (!phys_new(*handle, size, prop))
		pr_err("out of memory: handle 0x%llx not tracked (not movable)", *handle);
	pthread_mutex_unlock(&vm.lock);
}

/* Under vm.lock: the handle is gone once the program released it and nothing maps it. */
static void phys_maybe_free(struct phys *ph)
{
	if (ph->dropped_by_program && ph->nmaps == 0) {
		phys_unlink(ph);
		kept_close(kept_take(ph)); /* none left: the program's release took it */
		free(ph);
	}
}

void vmm_release_pre(struct track *t, CUmemGenericAllocationHandle handle)
{
	struct phys *ph;
	CUmemGenericAllocationHandle h = translate(handle, &ph);
	int fd = -1;

	t->handled = 1;
	t->rc = real.cuMemRelease ? real.cuMemRelease(h) : CUDA_ERROR_NOT_SUPPORTED;
	if (t->rc != CUDA_SUCCESS || !ph)
		return;
	pthread_mutex_lock(&vm.lock);
	if (--ph->refs <= 0) {
		fd = kept_take(ph); /* the program let go: the memory goes with its last mapping */
		ph->dropped_by_program = 1;
		phys_maybe_free(ph);
	}
	pthread_mutex_unlock(&vm.lock);
	kept_close(fd);
}

void vmm_map_pre(struct track *t, CUdeviceptr ptr, size_t size, size_t offset,
		 CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	struct phys *ph;
	CUmemGenericAllocationHandle h = translate(handle, &ph);

	t->handled = 1;
	t->rc = real.cuMemMap ? real.cuMemMap(ptr, size, offset, h, flags)
			      : CUDA_ERROR_NOT_SUPPORTED;
	if (t->rc != CUDA_SUCCESS)
		return;
	pthread_mutex_lock(&vm.lock);
	if (!map_new(ptr, size, offset, ph, flags))
		pr_err("out of memory: mapping 0x%llx not tracked", ptr);
	pthread_mutex_unlock(&vm.lock);
}

void vmm_unmap_pre(struct track *t, CUdeviceptr ptr, size_t size)
{
	t->handled = 1;
	t->rc = real.cuMemUnmap ? real.cuMemUnmap(ptr, size) : CUDA_ERROR_NOT_SUPPORTED;
	if (t->rc != CUDA_SUCCESS)
		return;
	pthread_mutex_lock(&vm.lock);
	for (struct vmap **pp = &vm.maps; *pp;) {
		struct vmap *m = *pp;

		if (m->ptr >= ptr && m->ptr + m->size <= ptr + size) {
			*pp = m->next;
			if (m->ph) {
				m->ph->nmaps--;
				phys_maybe_free(m->ph);
			}
			free(m);
		} else {
			pp = &m->next;
		}
	}
	pthread_mutex_unlock(&vm.lock);
}

void vmm_access_pre(struct track *t, CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
		    size_t count)
{
	t->handled = 1;
	t->rc = real.cuMemSetAccess ? real.cuMemSetAccess(ptr, size, desc, count)
				    : CUDA_ERROR_NOT_SUPPORTED;
	if (t->rc != CUDA_SUCCESS || !desc)
		return;
	pthread_mutex_lock(&vm.lock);
	access_record(ptr, size, desc, count);
	pthread_mutex_unlock(&vm.lock);
}

void vmm_retain_pre(struct track *t, CUmemGenericAllocationHandle *handle, void *addr)
{
	struct phys *ph;

	t->handled = 1;
	t->rc = real.cuMemRetainAllocationHandle ? real.cuMemRetainAllocationHandle(handle, addr)
						 : CUDA_ERROR_NOT_SUPPORTED;
	if (t->rc != CUDA_SUCCESS || !handle)
		return;
	pthread_mutex_lock(&vm.lock);
	ph = phys_by_real(*handle);
	if (ph && !ph->own_va) {
		*handle = ph->id;
		ph->refs++;
	}
	pthread_mutex_unlock(&vm.lock);
}

void vmm_props_pre(struct track *t, CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
	t->handled = 1;
	handle = translate(handle, NULL);
	t->rc = real.cuMemGetAllocationPropertiesFromHandle
			? real.cuMemGetAllocationPropertiesFromHandle(prop, handle)
			: CUDA_ERROR_NOT_SUPPORTED;
}

void vmm_export_pre(struct track *t, void *shareable, CUmemGenericAllocationHandle handle,
		    int type, unsigned long long flags)
{
	struct phys *ph;

	t->handled = 1;
	handle = translate(handle, &ph);
	t->rc = real.cuMemExportToShareableHandle
			? real.cuMemExportToShareableHandle(shareable, handle, type, flags)
			: CUDA_ERROR_NOT_SUPPORTED;
	if (t->rc != CUDA_SUCCESS && ph && type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR &&
	    shareable) {
		/* taken back from a held descriptor, the handle is an imported one, which the
		 * driver does not export: the program's export of its own memory gets what the
		 * driver gave for it before (a duplicate of the kept descriptor, as the driver's
		 * own, inheritable) */
		int fd;

		pthread_mutex_lock(&vm.lock);
		fd = kept_get(ph);
		fd = fd >= 0 ? fcntl(fd, F_DUPFD, 3) : -1;
		pthread_mutex_unlock(&vm.lock);
		if (fd >= 0) {
			*(int *)shareable = fd;
			t->rc = CUDA_SUCCESS;
		}
	}
	if (t->rc != CUDA_SUCCESS || !ph)
		return;
	pthread_mutex_lock(&vm.lock);
	if (!ph->shared)
		pr_info("handle 0x%llx exported: stays with the driver's checkpoint", ph->id);
	ph->shared = 1;
	pthread_mutex_unlock(&vm.lock);
}

/* -- cuMemAlloc served from VMM ---------------------------------------------------------------- */

static CUresult granularity_of(CUdevice dev, size_t *g)
{
	CUmemAllocationProp prop = { .type = CU_MEM_ALLOCATION_TYPE_PINNED,
				     .location = { CU_MEM_LOCATION_TYPE_DEVICE, dev } };
	CUresult rc;

	if (dev < 0 || dev >= MAX_DEVICES)
		return CUDA_ERROR_NOT_SUPPORTED;
	if (vm.granularity[dev]) {
		*g = vm.granularity[dev];
		return CUDA_SUCCESS;
	}
	if (!real.cuMemGetAllocationGranularity)
		return CUDA_ERROR_NOT_SUPPORTED;
	rc = real.cuMemGetAllocationGranularity(g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (rc == CUDA_SUCCESS && *g)
		vm.granularity[dev] = *g;
	else if (rc == CUDA_SUCCESS)
		rc = CUDA_ERROR_NOT_SUPPORTED;
	return rc;
}

int vmm_alloc(CUdeviceptr *dptr, size_t bytesize, CUresult *rc)
{
	CUmemAllocationProp prop = { .type = CU_MEM_ALLOCATION_TYPE_PINNED };
	CUmemAccessDesc acc = { .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	CUmemGenericAllocationHandle h = 0;
	CUdeviceptr va = 0;
	CUdevice dev;
	struct phys *ph;
	size_t g, asize;

	pthread_once(&min_once, read_knobs);
	if (!dptr || !vm.min_size || bytesize < vm.min_size || vm.disabled)
		return 0;
	if (!real.cuCtxGetDevice || !real.cuMemAddressReserve || !real.cuMemCreate ||
	    !real.cuMemMap || !real.cuMemSetAccess || !real.cuMemUnmap || !real.cuMemRelease ||
	    !real.cuMemAddressFree)
		goto disable;
	if (real.cuCtxGetDevice(&dev) != CUDA_SUCCESS)
		return 0; /* no current context: the driver says what is wrong */
	*rc = granularity_of(dev, &g);
	if (*rc != CUDA_SUCCESS)
		goto disable;
	asize = (bytesize + g - 1) / g * g;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = dev;
	acc.location = prop.location;

	*rc = real.cuMemAddressReserve(&va, asize, g, 0, 0);
	if (*rc != CUDA_SUCCESS)
		goto fallback;
	if (vm.exportable) {
		prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
		*rc = real.cuMemCreate(&h, asize, &prop, 0);
		if (*rc != CUDA_SUCCESS && *rc != CUDA_ERROR_OUT_OF_MEMORY) {
			/* two threads may both get here: both warn, both stop asking */
			pr_warn("the driver refuses exportable VMM memory (CUresult %d): allocations "
				"are not held through a leave-running checkpoint", *rc);
			vm.exportable = 0;
			prop.requestedHandleTypes = 0;
		}
	}
	if (!prop.requestedHandleTypes)
		*rc = real.cuMemCreate(&h, asize, &prop, 0);
	if (*rc == CUDA_ERROR_OUT_OF_MEMORY) {
		real.cuMemAddressFree(va, asize);
		return 1; /* as cuMemAlloc would answer */
	}
	if (*rc != CUDA_SUCCESS)
		goto err_free;
	*rc = real.cuMemMap(va, asize, 0, h, 0);
	if (*rc != CUDA_SUCCESS)
		goto err_release;
	*rc = real.cuMemSetAccess(va, asize, &acc, 1);
	if (*rc != CUDA_SUCCESS)
		goto err_unmap;

	pthread_mutex_lock(&vm.lock);
	ph = phys_new(h, asize, &prop);
	if (ph) {
		ph->own_va = va;
		ph->own_asked = bytesize;
		if (!map_new(va, asize, 0, ph, 0)) {
			phys_unlink(ph);
			free(ph);
			ph = NULL;
		} else {
			access_record(va, asize, &acc, 1);
		}
	}
	pthread_mutex_unlock(&vm.lock);
	if (!ph) {
		*rc = CUDA_ERROR_OUT_OF_MEMORY; /* host memory, for our tables */
		goto err_unmap;
	}
	track_add_vmm(va, bytesize);
	*dptr = va;
	*rc = CUDA_SUCCESS;
	return 1;

err_unmap:
	real.cuMemUnmap(va, asize);
err_release:
	real.cuMemRelease(h);
err_free:
	real.cuMemAddressFree(va, asize);
	if (*rc == CUDA_ERROR_OUT_OF_MEMORY)
		return 1;
fallback:
	pr_warn("cuMemAlloc(%zu) from VMM: CUresult %d; the driver's cuMemAlloc serves it (not "
		"movable)", bytesize, *rc);
	return 0;
disable:
	pr_warn("the driver lacks the VMM API (or refuses it): allocations are not movable");
	vm.disabled = 1;
	return 0;
}

int vmm_free(CUdeviceptr dptr, CUresult *rc)
{
	struct phys *ph = NULL;
	struct vmap *m = NULL;
	size_t size;
	int fd = -1;

	pthread_mutex_lock(&vm.lock);
	for (ph = vm.phys; ph && ph->own_va != dptr; ph = ph->next)
		;
	if (ph) {
		phys_unlink(ph);
		fd = kept_take(ph);
		for (struct vmap **pp = &vm.maps; *pp; pp = &(*pp)->next)
			if ((*pp)->ph == ph) {
				m = *pp;
				*pp = m->next;
				break;
			}
	}
	pthread_mutex_unlock(&vm.lock);
	if (!ph)
		return 0;
	size = ph->size;
	*rc = CUDA_SUCCESS;
	if (ph->real) { /* a dropped one (never while the gate is open) has nothing mapped */
		/* cuMemFree waits for the work that may still use the memory; so must we */
		if (real.cuCtxSynchronize)
			real.cuCtxSynchronize();
		*rc = real.cuMemUnmap(dptr, size);
		if (*rc == CUDA_SUCCESS)
			*rc = real.cuMemRelease(ph->real);
	}
	if (*rc == CUDA_SUCCESS)
		*rc = real.cuMemAddressFree(dptr, size);
	if (*rc != CUDA_SUCCESS)
		pr_warn("cuMemFree(0x%llx) of a VMM allocation: CUresult %d", dptr, *rc);
	kept_close(fd); /* after the release: the memory goes with it */
	free(m);
	free(ph);
	return 1;
}

/* A mapping of the whole handle that the GPU can read: what a prepare copies through (under
 * vm.lock). */
static struct vmap *whole_map(const struct phys *ph)
{
	for (struct vmap *m = vm.maps; m; m = m->next)
		if (m->ph == ph && m->offset == 0 && m->size == ph->size && m->naccess)
			return m;
	return NULL;
}

/* -- for the mover (the gate closed) ---------------------------------------------------------- */

struct movable *vmm_movables(size_t *n, unsigned long long *bytes)
{
	struct movable *out = NULL;
	size_t count = 0, cap = 0;

	*bytes = 0;
	pthread_mutex_lock(&vm.lock);
	for (struct phys *ph = vm.phys; ph; ph = ph->next) {
		struct vmap *whole;

		if (ph->shared || !ph->real || ph->moved)
			continue;
		whole = whole_map(ph);
		if (!whole)
			continue;
		if (count == cap) {
			struct movable *more = realloc(out, (cap ? 2 * cap : 64) * sizeof(*out));

			if (!more) {
				free(out);
				out = NULL;
				count = 0;
				break;
			}
			out = more;
			cap = cap ? 2 * cap : 64;
		}
		out[count++] = (struct movable){ .phys = ph, .src = whole->ptr, .size = ph->size,
						 .dev = ph->prop.location.id };
		*bytes += ph->size;
	}
	pthread_mutex_unlock(&vm.lock);
	*n = count;
	return out;
}

CUresult vmm_drop(void *p)
{
	struct phys *ph = p;
	CUresult rc = CUDA_SUCCESS;
	int fd;

	/* The mappings stay in the list (vmm_recreate maps them again); the driver unmaps. */
	for (struct vmap *m = vm.maps; m && rc == CUDA_SUCCESS; m = m->next)
		if (m->ph == ph)
			rc = real.cuMemUnmap(m->ptr, m->size);
	if (rc == CUDA_SUCCESS)
		rc = real.cuMemRelease(ph->real);
	if (rc != CUDA_SUCCESS) {
		pr_err("releasing 0x%llx (%zu bytes): CUresult %d", ph->id, ph->size, rc);
		return rc;
	}
	pthread_mutex_lock(&vm.lock);
	ph->real = 0;
	ph->moved = 1;
	fd = kept_take(ph); /* a duplicate went with the held ones, if held: the program keeps none */
	pthread_mutex_unlock(&vm.lock);
	kept_close(fd);
	return CUDA_SUCCESS;
}

CUresult vmm_recreate(void *p)
{
	struct phys *ph = p;
	CUmemGenericAllocationHandle h = ph->real;
	CUresult rc = CUDA_SUCCESS;

	if (!h) {
		rc = real.cuMemCreate(&h, ph->size, &ph->prop, 0);
		if (rc != CUDA_SUCCESS)
			return rc;
		pthread_mutex_lock(&vm.lock);
		ph->real = h;
		pthread_mutex_unlock(&vm.lock);
	}
	/* Maps every mapping of it; one already mapped (an earlier, failed try) answers
	 * CUDA_ERROR_INVALID_VALUE... so unmap first, ignoring the answer. */
	for (struct vmap *m = vm.maps; m && rc == CUDA_SUCCESS; m = m->next) {
		if (m->ph != ph)
			continue;
		real.cuMemUnmap(m->ptr, m->size);
		rc = real.cuMemMap(m->ptr, m->size, m->offset, h, m->flags);
		if (rc == CUDA_SUCCESS && m->naccess)
			rc = real.cuMemSetAccess(m->ptr, m->size, m->access, m->naccess);
	}
	if (rc != CUDA_SUCCESS)
		pr_err("re-creating 0x%llx (%zu bytes): CUresult %d", ph->id, ph->size, rc);
	return rc;
}

/* -- held memory (mover.c): exported before the drop, imported back instead of a copy ------- */

int vmm_hold_enabled(void)
{
	pthread_once(&min_once, read_knobs);
	return vm.export_asked;
}

int vmm_exportable(void *p)
{
	const struct phys *ph = p;

	return ph->real && (ph->prop.requestedHandleTypes &
			    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

/* The driver's call itself, not the hooked one: that one marks the handle shared (not
 * movable), for the program's exports. */
CUresult vmm_export_fd(void *p, int *fd)
{
	struct phys *ph = p;
	CUresult rc;
	int k;

	pthread_mutex_lock(&vm.lock);
	k = kept_get(ph); /* taken back from a descriptor: a duplicate of it */
	if (k >= 0 && kept[ph->kept - 1].shared) {
		pthread_mutex_unlock(&vm.lock);
		pr_warn("the descriptor kept for 0x%llx is another kept one's too (the program put "
			"one of its own there): not handed out", ph->id);
		return CUDA_ERROR_INVALID_VALUE;
	}
	*fd = k >= 0 ? fcntl(k, F_DUPFD_CLOEXEC, 3) : -1;
	pthread_mutex_unlock(&vm.lock);
	if (k >= 0)
		return *fd >= 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
	if (!real.cuMemExportToShareableHandle)
		return CUDA_ERROR_NOT_SUPPORTED;
	*fd = -1;
	rc = real.cuMemExportToShareableHandle(fd, ph->real, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
					       0);
	/* whatever the driver made it: a child the program spawns (posix_spawn, vfork: no fork
	 * handler runs) must not keep this memory alive */
	if (rc == CUDA_SUCCESS && *fd >= 0)
		fcntl(*fd, F_SETFD, FD_CLOEXEC);
	return rc;
}

int vmm_dropped(void *p)
{
	const struct phys *ph = p;

	return !ph->real;
}

/* The imported handle becomes ph->real and is mapped where the dropped one was, access as it
 * was (vmm_recreate's loop, with a handle already set). Refused, it is unmapped and released
 * again and ph stays dropped: a fresh one is created for the copy from the files. */
CUresult vmm_adopt(void *p, int fd)
{
	struct phys *ph = p;
	CUmemGenericAllocationHandle h = 0;
	CUresult rc;

	if (ph->real)
		return CUDA_ERROR_INVALID_VALUE; /* re-created already (an earlier try) */
	if (!real.cuMemImportFromShareableHandle)
		return CUDA_ERROR_NOT_SUPPORTED;
	rc = real.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
						 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&vm.lock);
	ph->real = h;
	pthread_mutex_unlock(&vm.lock);
	rc = vmm_recreate(ph);
	if (rc == CUDA_SUCCESS) {
		pthread_mutex_lock(&vm.lock);
		kept_add(ph, fd);
		pthread_mutex_unlock(&vm.lock);
		return rc;
	}
	for (struct vmap *m = vm.maps; m; m = m->next)
		if (m->ph == ph)
			real.cuMemUnmap(m->ptr, m->size); /* the ones not mapped answer an error */
	real.cuMemRelease(h);
	pthread_mutex_lock(&vm.lock);
	ph->real = 0;
	pthread_mutex_unlock(&vm.lock);
	return rc;
}

/* The data is back: the handle is an ordinary one again. */
void vmm_reloaded(void *p)
{
	struct phys *ph = p;

	pthread_mutex_lock(&vm.lock);
	ph->moved = 0;
	pthread_mutex_unlock(&vm.lock);
}

void vmm_status(struct vmm_status *st)
{
	memset(st, 0, sizeof(*st));
	pthread_mutex_lock(&vm.lock);
	for (struct phys *ph = vm.phys; ph; ph = ph->next) {
		if (!ph->moved && ph->real && !ph->own_va)
			st->program_bytes += ph->size;
		if (ph->moved) {
			st->dropped++;
		} else if (!ph->shared && ph->real) {
			st->movable++;
			st->movable_bytes += ph->size;
			if (whole_map(ph)) { /* what vmm_movables gives a prepare */
				st->whole++;
				st->unexportable += !vmm_exportable(ph);
			}
		}
	}
	pthread_mutex_unlock(&vm.lock);
	st->hold_asked = vmm_hold_enabled();
}

/* The child of fork() has no GPU memory (CUDA does not survive fork): forget it all (leaked:
 * another thread may have been walking the lists). */
void vmm_after_fork(void)
{
	for (int i = 0; i < HOLD_MAX; i++) { /* the parent's memory: not the child's to keep */
		if (kept[i].fd1 && kept_is(&kept[i], kept[i].fd1 - 1))
			close(kept[i].fd1 - 1);
		kept[i].fd1 = 0;
	}
	pthread_mutex_init(&vm.lock, NULL);
	vm.phys = NULL;
	vm.maps = NULL;
	memset(vm.granularity, 0, sizeof(vm.granularity));
}
