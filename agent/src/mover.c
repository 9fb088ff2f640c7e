/* The mover: the program's movable GPU memory (vmm.c) out to host memory or files and back,
 * at PCIe speed.
 *
 * Save: the movable allocations are cut into pieces and packed into chunks, one for each
 * CHUNK-aligned window of device addresses that holds any (a 2 MiB allocation does not cost a
 * write of its own); chunk j goes to sink j % nsinks, appended. In a file, each chunk starts
 * at a multiple of FILE_ALIGN (the gap is a hole: no bytes written), so that the image store,
 * which cuts files into FILE_ALIGN pieces, sees a chunk's bytes the same way wherever it
 * lands: what a chunk holds depends on its window alone, so an allocation that appears or
 * goes away changes one chunk, not every chunk after it (packed back to back, one allocator
 * segment freed between two checkpoints shifted every later chunk, and the store kept
 * nothing after it). One worker thread a sink. A 64-bit checksum of every chunk is kept in
 * the agent's memory (it travels with the process image: CRIU restores it with the rest of
 * the agent).
 * Once every chunk is out, the physical memory of every movable allocation is released
 * (vmm_drop); the addresses stay.
 *
 * Before the copy, one kernel reads every 4 MiB part on the GPU (fingerprint_parts.c): a part
 * that reads all zero stays behind (not copied, not written: a hole in a file, no room in the
 * agent's memory), and so does, into the image store, one the store holds already.
 *
 * Load: every dropped allocation is re-created at its addresses (vmm_recreate), its zero parts
 * memset on the GPU (zeros_fill), then each worker brings its sink's chunks back, checking
 * each checksum.
 *
 * Held memory (TORPOR_AGENT_VMM_EXPORT, on unless 0; vmm.c): a save whose every movable allocation is
 * exportable also exports each one to a POSIX file descriptor once every byte is out, before
 * the drop. The driver frees released memory only once no descriptor of it is open (measured
 * on the H200: bench/probe_held_memory.c), and its checkpoint then leaves that memory alone
 * (its checkpoint of 4 GiB held took 0.31 s against 2.27 s). So while torpor keeps the
 * descriptors through the pause, the memory never leaves the GPU: the load imports each one,
 * maps it where its allocation was, and copies nothing. All or nothing: an allocation that
 * is not exportable (the program's own cuMemCreate), more than HOLD_MAX of them, or any
 * export refused, and nothing is held (the save goes on as before); any descriptor at the
 * load not the file exported for its allocation (its fstat identity), or an import or a map
 * refused, and the load copies everything back from the files as before. The data files are
 * written either way: they are the checkpoint.
 *
 * A sink is a data file, or (a prepare without files: a suspend) a region of the agent's own
 * anonymous memory, one a worker, populated by its worker (the kernel zeroes its pages in
 * parallel) and kept until the load unmaps it. Either way each worker has two pinned staging
 * buffers and a stream for each: while one buffer is summed and written to (read from) its
 * sink, the GPU copies the next chunk into (out of) the other. Copying straight between the
 * GPU and a registered region or a registered tmpfs mapping was measured slower on the H200
 * host (bench/host_paths.c: registering 16 GB took 1.9-2.6 s and unregistering it 1.2-2.4 s,
 * 4.5 s for tmpfs pages; the staged copy into /dev/shm moved the same 16 GB in 0.7 s).
 *
 * Staging buffers are anonymous memory with transparent huge pages, touched by their worker
 * and registered with the driver: that is faster to set up than cuMemHostAlloc (measured on
 * an H200 host: 4 GiB registered in 0.07 s after a 0.1 s parallel touch, against 1.6 s for
 * cuMemHostAlloc), and it is unmapped once the move is over, so the process image stays as
 * small as it was.
 *
 * This file holds the plan (which chunk holds which bytes, in which sink) and the save and the
 * load around it; mover_workers.c the threads that copy, stream.c the image store's ring and
 * fingerprint_parts.c the parts' fingerprints (mover.h: what they share).
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mover.h"

struct mover_plan plan;

/* -- the plan ----------------------------------------------------------------------------------- */

struct unmap_job {
	unsigned char *region[MAX_FILES];
	size_t size[MAX_FILES];
};

static void unmap_all(struct unmap_job *j)
{
	for (int k = 0; k < MAX_FILES; k++)
		if (j->region[k])
			munmap(j->region[k], j->size[k]);
}

static void *unmap_main(void *arg)
{
	unmap_all(arg);
	free(arg);
	return NULL;
}

/* The regions go in a thread of their own: giving back tens of GB of pages takes seconds
 * (1.8 s for 68 GB measured on the H200 host), and the program may run meanwhile. */
static void regions_free(void)
{
	struct unmap_job *j = calloc(1, sizeof(*j));
	pthread_attr_t attr;
	pthread_t t;
	sigset_t all, old;
	int any = 0, started = 0;

	for (int k = 0; k < MAX_FILES; k++) {
		any |= plan.region[k] != NULL;
		if (j) {
			j->region[k] = plan.region[k];
			j->size[k] = plan.region_size[k];
		} else if (plan.region[k]) {
			munmap(plan.region[k], plan.region_size[k]);
		}
		plan.region[k] = NULL;
	}
	if (!j)
		return;
	if (any) {
		sigfillset(&all);
		pthread_sigmask(SIG_SETMASK, &all, &old); /* none of the program's handlers runs there */
		pthread_attr_init(&attr);
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		started = pthread_create(&t, &attr, unmap_main, j) == 0;
		pthread_attr_destroy(&attr);
		pthread_sigmask(SIG_SETMASK, &old, NULL);
	}
	if (!started) {
		unmap_all(j);
		free(j);
	}
}

static void plan_free(void)
{
	regions_free();
	free(plan.mv);
	free(plan.pieces);
	free(plan.chunks);
	free(plan.segs);
	memset(&plan, 0, sizeof(plan));
}

static int by_device(const void *a, const void *b)
{
	const struct movable *x = a, *y = b;

	return x->dev != y->dev ? (x->dev < y->dev ? -1 : 1) : (x->src < y->src ? -1 : x->src > y->src);
}


/* Pieces packed into chunks, one a CHUNK-aligned window of one device's addresses; chunk j to
 * file j % nfiles, at an offset aligned to `align` (files: FILE_ALIGN, regions: 1). */
static int plan_build(int nfiles, size_t align)
{
	size_t cap_p, cap_c;
	unsigned long long off[MAX_FILES] = { 0 };

	plan.mv = vmm_movables(&plan.nmv, &plan.bytes);
	if (!plan.mv && plan.nmv)
		return -ENOMEM;
	qsort(plan.mv, plan.nmv, sizeof(*plan.mv), by_device);
	/* a chunk per window an allocation touches: its whole windows, and one at either end */
	cap_c = plan.bytes / CHUNK + 2 * plan.nmv + 1;
	cap_p = cap_c + plan.nmv;
	plan.chunks = calloc(cap_c, sizeof(*plan.chunks));
	plan.pieces = calloc(cap_p, sizeof(*plan.pieces));
	if (!plan.chunks || !plan.pieces)
		return -ENOMEM;
	plan.nfiles = nfiles;
	for (size_t m = 0; m < plan.nmv; m++) {
		for (size_t done = 0; done < plan.mv[m].size;) {
			struct chunk *c = plan.nchunks ? &plan.chunks[plan.nchunks - 1] : NULL;
			CUdeviceptr at = plan.mv[m].src + done;
			size_t len = plan.mv[m].size - done, room = CHUNK - at % CHUNK;

			if (!c || c->dev != plan.mv[m].dev || c->window != at / CHUNK) {
				if (plan.nchunks == cap_c || plan.npieces == cap_p)
					return -ENOMEM; /* cannot happen: sized above */
				c = &plan.chunks[plan.nchunks];
				c->file = plan.nchunks % nfiles;
				c->first = plan.npieces;
				c->dev = plan.mv[m].dev;
				c->window = at / CHUNK;
				plan.nchunks++;
			}
			if (plan.npieces == cap_p)
				return -ENOMEM;
			if (len > room)
				len = room;
			plan.pieces[plan.npieces++] = (struct piece){ m, done, len, c->len };
			c->npieces++;
			c->len += len;
			done += len;
		}
	}
	for (size_t j = 0; j < plan.nchunks; j++) {
		struct chunk *c = &plan.chunks[j];

		c->file_off = round_up(off[c->file], align);
		off[c->file] = c->file_off + c->len;
		if ((j == 0 || c->dev != plan.chunks[j - 1].dev) && plan.ndevs < MAX_DEVICES)
			plan.dev_first[plan.ndevs++] = j;
	}
	memcpy(plan.file_size, off, sizeof(off));
	return 0;
}

int mover_pending(void)
{
	return plan.pending;
}

int mover_deferred(void)
{
	return plan.pending && plan.deferred;
}

/* Workers for a save into the agent's memory: one a CPU the program may run on, at most
 * MAX_FILES. */
static int memory_sinks(void)
{
	cpu_set_t set;
	int n = 0;

	if (sched_getaffinity(0, sizeof(set), &set) == 0)
		n = CPU_COUNT(&set);
	if (n < 1)
		n = (int)sysconf(_SC_NPROCESSORS_ONLN);
	if (tune.workers) /* TORPOR_AGENT_MOVER_WORKERS */
		n = tune.workers;
	return n < 1 ? 1 : n > MAX_FILES ? MAX_FILES : n;
}

/* Every data file at its full size (its holes too); 0, or -1 with r->error. */
static int size_files(const int *fds, int nfds, struct move_result *r)
{
	for (int k = 0; !plan.in_memory && k < nfds; k++)
		if (ftruncate(fds[k], plan.file_size[k]) < 0) {
			snprintf(r->error, sizeof(r->error), "sizing data file %d: %s", k,
				 strerror(errno));
			return -1;
		}
	return 0;
}

/* The host memory a save's sinks take: every part that is copied out (zero parts and those
 * the store has stay behind). */
unsigned long long host_bytes_needed(void)
{
	unsigned long long n = 0;

	for (size_t j = 0; j < plan.nchunks; j++)
		for (int q = 0; q < PARTS; q++)
			if (!part_stays(&plan.chunks[j].part[q], 1))
				n += part_len(&plan.chunks[j], q);
	return n;
}

void hold_close(struct move_result *r)
{
	for (int i = 0; i < r->held; i++)
		close(r->hold_fds[i]);
	r->held = 0;
	plan.nhold = 0;
}

/* Every movable allocation's memory exported to a descriptor (r->hold_fds), each one's file
 * remembered (plan.hold), or none: the memory is held only if all of it can be. */
/* Room in the program's descriptor table for holding n allocations: one exported descriptor
 * each now, and at the held resume the descriptors given back beside one kept for each
 * (vmm.c): 2n more than it has open, and a margin for the program. Nothing in why, or why
 * not (then nothing is held: a program that meets its limit half-way through would see its
 * own opens fail). */
static void hold_room(size_t n, char *why, size_t whysize)
{
	struct rlimit rl;
	struct dirent *e;
	long open_now = 0;
	DIR *d;

	if (getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_cur == RLIM_INFINITY)
		return;
	if (!(d = opendir("/proc/self/fd")))
		return;
	while ((e = readdir(d)))
		open_now += e->d_name[0] != '.';
	closedir(d);
	if ((unsigned long long)open_now + 2ULL * n + 64 > (unsigned long long)rl.rlim_cur)
		snprintf(why, whysize, "the program's limit on open files (%llu) leaves no room for "
			 "2 x %zu descriptors beside its %ld open", (unsigned long long)rl.rlim_cur, n,
			 open_now);
}

/* What the next save may hold: HOLD_DIRECT, or HOLD_MAX for a client that takes a bag
 * (`prepare ... bag`): a torpor before bags could not take more (control.c). */
static int hold_max = HOLD_DIRECT;

void mover_hold_max(int n)
{
	hold_max = n < HOLD_MAX ? n : HOLD_MAX;
}

void hold_export(struct move_result *r)
{
	static int fds[HOLD_MAX]; /* one save at a time (the control thread's) */
	long long t0 = now_ms();
	char why[160] = "";

	plan.nhold = r->held = 0;
	r->hold_fds = fds;
	r->hold_error[0] = 0;
	if (!vmm_hold_enabled() || !plan.nmv)
		return;
	if (plan.nmv > (size_t)hold_max)
		snprintf(why, sizeof(why), "%zu allocations, more than %d%s", plan.nmv, hold_max,
			 hold_max < HOLD_MAX ? " (a client that takes no bag of them)" : "");
	else if (!plan.fingerprinted)
		snprintf(why, sizeof(why), "the parts have no GPU fingerprints to check the memory "
			 "by when it is taken back (%.70s)", r->fp_error[0] ? r->fp_error :
			 "TORPOR_AGENT_MOVER_CHECK=host");
	if (!why[0])
		hold_room(plan.nmv, why, sizeof(why));
	if (!why[0])
		vmm_kept_audit(); /* which kept descriptors vmm_export_fd may hand out */
	for (size_t m = 0; !why[0] && m < plan.nmv; m++)
		if (!vmm_exportable(plan.mv[m].phys))
			snprintf(why, sizeof(why), "an allocation of %zu bytes at 0x%llx is not "
				 "exportable (the program's own, created without POSIX file "
				 "descriptors)", plan.mv[m].size, plan.mv[m].src);
	for (size_t m = 0; !why[0] && m < plan.nmv; m++) {
		struct stat st;
		int fd = -1;
		CUresult rc = vmm_export_fd(plan.mv[m].phys, &fd);

		if (rc != CUDA_SUCCESS || fd < 0) {
			snprintf(why, sizeof(why), "exporting %zu bytes at 0x%llx: CUresult %d",
				 plan.mv[m].size, plan.mv[m].src, rc);
			break;
		}
		r->hold_fds[r->held++] = fd;
		if (fstat(fd, &st) < 0) {
			snprintf(why, sizeof(why), "fstat of an exported descriptor: %s",
				 strerror(errno));
			break;
		}
		/* the driver's descriptors are all one file (/dev/nvidiactl, opened anew for each
		 * export): the file says what kind of descriptor comes back, and only the memory
		 * itself, its fingerprints checked on import (hold_import), that it is this
		 * allocation's */
		plan.hold[plan.nhold++] = (struct held_id){ m, st.st_dev, st.st_ino };
	}
	if (why[0]) {
		hold_close(r);
		snprintf(r->hold_error, sizeof(r->hold_error), "%s", why);
		pr_info("nothing held through the checkpoint: %s", why);
	}
	r->hold_seconds = seconds_since(t0);
}

/* A deferred save whose release failed after `dropped` allocations: nothing is in the files,
 * so those take their held memory back (nothing copied), everything held is let go, and the
 * save is undone. */
static void undrop_held(size_t dropped, struct move_result *r)
{
	if (dropped < plan.nmv) { /* its release failed, maybe after its unmap: mapped again */
		const struct movable *mv = &plan.mv[dropped];
		CUcontext ctx = track_context_of(mv->dev);

		if (ctx)
			real.cuCtxSetCurrent(ctx);
		if (vmm_recreate(mv->phys) != CUDA_SUCCESS)
			pr_err("mapping %zu bytes at 0x%llx again after a failed release failed",
			       mv->size, mv->src);
	}
	for (int k = 0; k < plan.nhold; k++) {
		const struct movable *mv = &plan.mv[plan.hold[k].mv];
		CUcontext ctx = track_context_of(mv->dev);
		CUresult rc;

		if (plan.hold[k].mv >= dropped)
			continue;
		if (ctx)
			real.cuCtxSetCurrent(ctx);
		rc = vmm_adopt(mv->phys, r->hold_fds[k]);
		if (rc != CUDA_SUCCESS)
			pr_err("taking back %zu bytes at 0x%llx after a failed release: CUresult %d: "
			       "that memory is lost", mv->size, mv->src, rc);
		vmm_reloaded(mv->phys);
	}
	hold_close(r);
	plan_free();
	r->deferred = 0;
}

int mover_save(const int *fds, int nfds, int known_fd, int index_fd, int ring_fd, int sock_fd,
	       int plan_fd, unsigned long long host_budget, struct move_result *r)
{
	long long t0 = now_ms(), t1;
	size_t dropped = 0, nknown = 0;
	XXH128_canonical_t *known = NULL;
	int ret, in_memory = nfds == 0, gpu_check, deferred = 0;
	const char *check = getenv("TORPOR_AGENT_FP_CHECK");
	const char *zeros = getenv("TORPOR_AGENT_ZEROS"); /* "0": every part is copied */

	failed = 0; /* an earlier run's: a save with nothing to move runs no worker to reset it */

	memset(r, 0, sizeof(*r));
	if (plan.pending) {
		snprintf(r->error, sizeof(r->error), "already prepared");
		return -1;
	}
	if (nfds < 0 || nfds > MAX_FILES) {
		snprintf(r->error, sizeof(r->error), "give 0 to %d data files", MAX_FILES);
		return -1;
	}
	for (int k = 0; k < nfds; k++) {
		struct stat st;

		if (fstat(fds[k], &st) < 0 || !S_ISREG(st.st_mode)) {
			snprintf(r->error, sizeof(r->error), "data file %d is not a regular file", k);
			return -1;
		}
	}
	if (index_fd >= 0 && in_memory) {
		snprintf(r->error, sizeof(r->error), "fingerprints are for data files only");
		return -1;
	}
	if (ring_fd >= 0 && (in_memory || index_fd < 0)) {
		snprintf(r->error, sizeof(r->error), "a stream into the image store needs the data "
			 "files and the fingerprints");
		return -1;
	}
	if (known_read(known_fd, &known, &nknown, r->error, sizeof(r->error)))
		return -1;
	if (ring_fd >= 0 && stream_open(ring_fd, sock_fd, r->error, sizeof(r->error))) {
		free(known);
		return -1;
	}
	plan_free();
	if (plan_build(in_memory ? memory_sinks() : nfds, in_memory ? 1 : FILE_ALIGN)) {
		plan_free();
		stream_close();
		free(known);
		snprintf(r->error, sizeof(r->error), "out of memory");
		return -1;
	}
	plan.in_memory = in_memory;
	fp_checking = check && *check && strcmp(check, "0");
	/* TORPOR_AGENT_MOVER_CHECK=gpu: every part fingerprinted in the zero scan's pass, for a
	 * check on the GPU after the reload instead of the host's sums (not where the image
	 * store is involved: its index and stream keep their own rules) */
	gpu_check = tune.gpu_check && index_fd < 0 && ring_fd < 0;
	fingerprint_parts(known, nknown, index_fd >= 0 || gpu_check, !zeros || strcmp(zeros, "0"), r);
	plan.gpu_check = gpu_check && plan.fingerprinted;
	free(known);
	/* host_budget (suspend: what the host has for it): known only now, after the zero scan,
	 * is how much of the program's GPU memory must go to host memory; refused before a byte
	 * is copied rather than the host running out half-way (a JAX arena is mostly zeros) */
	if (host_budget) {
		unsigned long long need = host_bytes_needed();

		if (need > host_budget) {
			snprintf(r->error, sizeof(r->error), "its GPU data needs %llu bytes of host "
				 "memory (%llu bytes of zero parts stay on the GPU); %llu bytes are "
				 "available for it", need, (unsigned long long)r->zero_bytes, host_budget);
			plan_free();
			stream_close();
			return -1;
		}
	}
	sinks_layout();
	/* Every file at its full size before the first byte is written (and so a file ending in
	 * skipped parts or a hole has it too): a tmpfs mounted huge=within_size (suspend_dir's)
	 * gives a write huge pages only where the file's size already covers them, and the
	 * workers wrote 1 MiB at a time (TORPOR_AGENT_MOVER_WRITE=block), each past the end of a
	 * growing file: measured on Linux 6.18, 256 MiB written so got no 2 MiB page, and every
	 * page once the file was sized first. */
	ret = tune.presize || plan_fd >= 0 ? size_files(fds, nfds, r) : 0;
	/* defer (defer.c): held, the plan written, nothing copied here: another process copies */
	if (!ret && plan_fd >= 0)
		deferred = defer_save(plan_fd, in_memory, index_fd, ring_fd, r) == 0;
	if (!ret && plan.nchunks && !deferred)
		ret = run_workers(in_memory ? NULL : fds, plan.nfiles, 1, r);
	if (!ret && !tune.presize && plan_fd < 0) /* TORPOR_AGENT_MOVER_PRESIZE=0: as before */
		ret = size_files(fds, nfds, r);
	/* the index before anything is released: without it the skipped parts are lost */
	if (!ret && index_fd >= 0)
		ret = index_write(index_fd, r->error, sizeof(r->error));
	/* streamed: nothing is released before the store has made the parts durable */
	if (!ret && stream_active())
		ret = stream_commit(r);
	r->streamed = stream_active();
	stream_close();
	if (ret) {
		hold_close(r);
		plan_free(); /* the agent's regions too: nothing was released */
		return -1;
	}
	/* every byte is out (or deferred: held already): held (exported, the memory lives on
	 * while a descriptor does), then the GPU memory released */
	if (!deferred)
		hold_export(r);
	t1 = now_ms();
	for (size_t m = 0; m < plan.nmv; m++) {
		if (vmm_drop(plan.mv[m].phys) != CUDA_SUCCESS) {
			snprintf(r->error, sizeof(r->error), "releasing GPU memory failed after %zu of "
				 "%zu allocations", dropped, plan.nmv);
			if (deferred) { /* nothing is in the files: the held memory is the way back */
				undrop_held(dropped, r);
				return -1;
			}
			hold_close(r); /* the reload copies: nothing is held */
			plan.pending = 1; /* the caller reloads: the copy is complete */
			return -1;
		}
		dropped++;
	}
	vmm_kept_close_all(); /* none open in the program through the checkpoint and the dump */
	plan.pending = 1;
	plan.deferred = deferred; /* the files have no data until torpor's copier has run */
	r->vmm_seconds = seconds_since(t1);
	r->chunks = plan.nchunks;
	r->allocations = plan.nmv;
	r->nfiles = in_memory ? 0 : nfds;
	r->in_memory = in_memory;
	if (!in_memory)
		memcpy(r->file_size, plan.file_size, sizeof(r->file_size));
	r->seconds = seconds_since(t0);
	pr_info("%s %llu bytes (%zu allocations, %zu chunks, %d %s; %llu bytes of zero parts "
		"stay behind) in %.3f s", deferred ? "left to the copier" : "saved", r->bytes,
		plan.nmv, plan.nchunks, plan.nfiles, in_memory ? "regions of host memory" : "files",
		r->zero_bytes, r->seconds);
	if (r->held)
		pr_info("%d allocations held on the GPU by their descriptors (exported in %.3f s)",
			r->held, r->hold_seconds);
	return 0;
}

int mover_in_memory(void)
{
	return plan.pending && plan.in_memory;
}

unsigned long long mover_host_bytes(void)
{
	unsigned long long n = 0;

	for (int k = 0; k < MAX_FILES; k++)
		n += plan.region[k] ? plan.region_size[k] : 0;
	return n;
}

static int mover_load_from(const int *fds, int nfds, struct move_result *r);

/* Do two of fds share one open file description (one a duplicate of the other)? 0: none;
 * k + 1 of one that shares with an earlier one (or of one for which that cannot be told). */
static int shared_description(const int *fds, int n)
{
	static unsigned char shared[HOLD_MAX]; /* the control thread's: a load's */

	if (n > HOLD_MAX)
		return 1;
	if (!fd_shared_descriptions(fds, n, shared))
		return 0;
	for (int k = n - 1; k >= 0; k--) /* the later one of the first pair, as it was given */
		if (shared[k])
			return k + 1;
	return 0;
}

/* Are held the descriptors the save exported, one an allocation, in its order, as far as their
 * files tell (the real driver's are all one file: the fingerprints tell the rest, on import),
 * and no description given twice? 0, or -1 with why in err. */
int hold_matches(const int *held, int nheld, char *err, size_t errsize)
{
	int k;

	if (!plan.pending || nheld != plan.nhold) {
		snprintf(err, errsize, "%d descriptors given, %d held", nheld,
			 plan.pending ? plan.nhold : 0);
		return -1;
	}
	for (k = 0; k < nheld; k++) {
		struct stat st;

		if (fstat(held[k], &st) < 0 || st.st_dev != plan.hold[k].dev ||
		    st.st_ino != plan.hold[k].ino) {
			snprintf(err, errsize, "descriptor %d is not the file exported for its "
				 "allocation", k);
			return -1;
		}
	}
	/* one file is no proof (the driver's are all one device node), but one description
	 * given for two allocations would map one memory at both: the fingerprints cannot
	 * tell two allocations of the same bytes (zeros) apart */
	k = shared_description(held, nheld);
	if (k) {
		snprintf(err, errsize, "descriptor %d is a duplicate of another (or cannot be told "
			 "from one)", k - 1);
		return -1;
	}
	return 0;
}

/* The first n held allocations imported by a refused hold_import let go again: a deferred
 * save's memory lives on in the descriptors (the files being no way back), for a retry from
 * the start; any other's load re-creates fresh memory of each allocation's size for the copy
 * from the files (an import refused may have been another allocation's memory, of another
 * size, or another program's). */
static void hold_undo(int n)
{
	while (n-- > 0) {
		const struct movable *m = &plan.mv[plan.hold[n].mv];
		CUcontext ctx = track_context_of(m->dev);

		if (ctx)
			real.cuCtxSetCurrent(ctx);
		if (vmm_drop(m->phys) != CUDA_SUCCESS)
			pr_err("letting 0x%llx go again after a refused import failed: it stays "
			       "mapped", m->src);
	}
}

/* Takes the held memory back (nothing copied): 0, or -1 with why in err. Every descriptor is
 * checked before anything is imported, and every fingerprinted part after; whatever a refused
 * take-back imported is let go again (hold_undo). */
static int hold_import(const int *held, int nheld, char *err, size_t errsize)
{
	char why[112];
	int k;

	if (nheld != plan.nhold) {
		snprintf(err, errsize, "%d descriptors given, %d held", nheld, plan.nhold);
		return -1;
	}
	if (hold_matches(held, nheld, err, errsize))
		return -1;
	for (k = 0; k < nheld; k++) {
		if (!vmm_dropped(plan.mv[plan.hold[k].mv].phys)) {
			snprintf(err, errsize, "the memory was re-created already (a resume before)");
			return -1;
		}
	}
	for (k = 0; k < nheld; k++) {
		const struct movable *mv = &plan.mv[plan.hold[k].mv];
		CUcontext ctx = track_context_of(mv->dev);
		CUresult rc;

		if (ctx)
			real.cuCtxSetCurrent(ctx);
		rc = vmm_adopt(mv->phys, held[k]);
		if (rc != CUDA_SUCCESS) {
			snprintf(err, errsize, "taking back %zu bytes at 0x%llx: CUresult %d", mv->size,
				 mv->src, rc);
			hold_undo(k);
			return -1;
		}
	}
	/* nothing else says each descriptor came back to its own allocation, nor that the
	 * memory is what was saved: every fingerprinted part read on the GPU */
	if (fingerprints_match(why, sizeof(why))) {
		snprintf(err, errsize, "the memory taken back %s", why);
		hold_undo(nheld);
		return -1;
	}
	return 0;
}

/* The held memory taken back (hold_import): the program's again, nothing copied. 0. */
static int held_back(long long t0, struct move_result *r)
{
	for (size_t m = 0; m < plan.nmv; m++)
		vmm_reloaded(plan.mv[m].phys);
	r->held_back = 1;
	r->allocations = plan.nmv;
	r->import_seconds = r->seconds = seconds_since(t0);
	pr_info("took back %zu allocations held on the GPU in %.3f s: nothing copied", plan.nmv,
		r->seconds);
	plan_free();
	return 0;
}

int mover_load(const int *fds, int nfds, int ring_fd, int sock_fd, const int *held, int nheld,
	       int drained, struct move_result *r)
{
	long long t0 = now_ms();
	int ret;

	failed = 0; /* an earlier run's (see mover_save) */
	memset(r, 0, sizeof(*r));
	if (!plan.pending) {
		snprintf(r->error, sizeof(r->error), "nothing to resume");
		return -1;
	}
	/* deferred (defer.c): until torpor says its copier filled the files (drained), the held
	 * memory is the only copy of the data: taken back, or nothing changes. A stream comes
	 * from the image store, which only a pack of the filled files gave it (a restored
	 * checkpoint's: the agent was dumped deferred) */
	if (plan.deferred && !drained && ring_fd < 0) {
		char why[160];

		if (nheld <= 0) {
			snprintf(r->error, sizeof(r->error), "the GPU data is not in the files yet (a "
				 "deferred copy): resume held=N, or add drained once the copier is done");
			return -1;
		}
		if (hold_import(held, nheld, why, sizeof(why))) {
			snprintf(r->error, sizeof(r->error), "held memory not taken back (%s), and the "
				 "files have no data yet (a deferred copy): nothing changed", why);
			pr_warn("%s", r->error);
			r->import_seconds = seconds_since(t0);
			return -1;
		}
		return held_back(t0, r);
	}
	if (nheld > 0 && ring_fd < 0) {
		char why[160];

		if (!hold_import(held, nheld, why, sizeof(why)))
			return held_back(t0, r);
		pr_warn("held memory not taken back (%s): reloading it from %s", why,
			plan.in_memory ? "the agent's memory" : "the files");
		r->import_seconds = seconds_since(t0);
	}
	if (ring_fd >= 0) {
		if (plan.in_memory || nfds) {
			snprintf(r->error, sizeof(r->error), "a stream from the image store replaces the "
				 "data files, and is for GPU data saved to files");
			return -1;
		}
		if (!plan.segs && segs_build()) {
			snprintf(r->error, sizeof(r->error), "out of memory");
			return -1;
		}
		if (stream_open(ring_fd, sock_fd, r->error, sizeof(r->error)))
			return -1;
		for (size_t j = 0; j < plan.nchunks; j++)
			for (int q = 0; q < PARTS; q++)
				plan.chunks[j].part[q].received = 0;
	} else if (plan.in_memory && nfds) {
		snprintf(r->error, sizeof(r->error), "the GPU data is in the agent's memory: resume "
			 "without files");
		return -1;
	}
	ret = mover_load_from(fds, nfds, r);
	r->streamed = stream_active();
	stream_close();
	if (ret && plan.deferred) {
		/* the files failed a deferred save's load (a copier that did not finish them): the
		 * memory re-created for them goes again, so that the held memory, still the only
		 * copy, can be taken back by a later try */
		for (size_t m = 0; m < plan.nmv; m++)
			if (!vmm_dropped(plan.mv[m].phys) && vmm_drop(plan.mv[m].phys) != CUDA_SUCCESS)
				pr_err("letting 0x%llx go again after a failed load failed",
				       plan.mv[m].src);
	}
	if (ret)
		return -1;
	r->seconds = seconds_since(t0);
	pr_info("reloaded %llu bytes%s and memset %llu bytes of zero parts in %.3f s", r->bytes,
		r->streamed ? " from the image store's stream" : "", r->zero_bytes, r->seconds);
	plan_free();
	return 0;
}

/* mover_load from files (fds), the agent's memory (none), or the open stream. */
static int mover_load_from(const int *fds, int nfds, struct move_result *r)
{
	long long t1;
	int streamed = stream_active();

	if (!streamed && !plan.in_memory && nfds != plan.nfiles) {
		snprintf(r->error, sizeof(r->error), "%d data files given, %d were saved to", nfds,
			 plan.nfiles);
		return -1;
	}
	for (int k = 0; k < nfds; k++) {
		struct stat st;

		if (fstat(fds[k], &st) < 0 || !S_ISREG(st.st_mode) ||
		    (unsigned long long)st.st_size < plan.file_size[k]) {
			r->damaged = 1;
			snprintf(r->error, sizeof(r->error), "data file %d is missing or shorter than "
				 "the %llu bytes saved to it", k, plan.file_size[k]);
			return -1;
		}
	}
	t1 = now_ms();
	for (size_t m = 0; m < plan.nmv; m++) {
		CUcontext ctx = track_context_of(plan.mv[m].dev);
		CUresult rc;

		if (ctx)
			real.cuCtxSetCurrent(ctx);
		rc = vmm_recreate(plan.mv[m].phys);
		if (rc != CUDA_SUCCESS) {
			snprintf(r->error, sizeof(r->error), "re-creating %zu bytes of GPU memory on "
				 "device %d: CUresult %d%s", plan.mv[m].size, plan.mv[m].dev, rc,
				 rc == CUDA_ERROR_OUT_OF_MEMORY ? " (out of memory: the GPU has no room)"
								: "");
			return -1;
		}
	}
	if (zeros_fill(r))
		return -1;
	r->vmm_seconds = seconds_since(t1);
	if (plan.nchunks && run_workers(plan.in_memory || streamed ? NULL : fds, plan.nfiles, 0, r))
		return -1;
	if (streamed && stream_complete(r))
		return -1;
	if (fingerprints_verify(plan.in_memory || streamed ? NULL : fds, r))
		return -1;
	for (size_t m = 0; m < plan.nmv; m++)
		vmm_reloaded(plan.mv[m].phys);
	r->chunks = plan.nchunks;
	r->allocations = plan.nmv;
	r->nfiles = nfds;
	return 0;
}

/* The child of fork() has no GPU memory of its own to reload (CUDA does not survive fork):
 * it starts with nothing saved (the parent's tables are leaked, not freed: another thread may
 * have been using them). */
void mover_after_fork(void)
{
	memset(&plan, 0, sizeof(plan));
	workers_after_fork();
}
