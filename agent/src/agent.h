/* libtorpor-agent.so internals: what the files of src/ share. See README.md for the design.
 *
 * Conventions (CRIU's): functions return 0 or -errno and unwind with goto; log through the
 * pr_* macros below, each .c file defining LOG_PREFIX before including this header.
 */
#ifndef TORPOR_AGENT_H
#define TORPOR_AGENT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include "glibc_compat.h" /* old glibcs load it too: before stdlib.h/stdio.h */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cuda_types.h"

/* The one way out of the library: everything else is hidden (-fvisibility=hidden). */
#define AGENT_EXPORT __attribute__((visibility("default")))

/* -- logging (log.c) ------------------------------------------------------------------------- */

/* Python logging's numbers, so that one TORPOR_AGENT_LOG_LEVEL serves the CLI and the agent. */
enum { LOG_DEBUG = 10, LOG_INFO = 20, LOG_WARNING = 30, LOG_ERROR = 40 };

#ifndef LOG_PREFIX
#define LOG_PREFIX ""
#endif

void agent_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int agent_log_enabled(int level);

#define pr_err(fmt, ...) agent_log(LOG_ERROR, LOG_PREFIX fmt, ##__VA_ARGS__)
#define pr_perror(fmt, ...) agent_log(LOG_ERROR, LOG_PREFIX fmt ": %m", ##__VA_ARGS__)
#define pr_warn(fmt, ...) agent_log(LOG_WARNING, LOG_PREFIX fmt, ##__VA_ARGS__)
#define pr_pwarn(fmt, ...) agent_log(LOG_WARNING, LOG_PREFIX fmt ": %m", ##__VA_ARGS__)
#define pr_info(fmt, ...) agent_log(LOG_INFO, LOG_PREFIX fmt, ##__VA_ARGS__)
#define pr_debug(fmt, ...) agent_log(LOG_DEBUG, LOG_PREFIX fmt, ##__VA_ARGS__)

/* -- the driver's originals (hooks.c) -------------------------------------------------------- */

/* The exported wrappers, declared from the list; `real` holds the driver's functions of the
 * same types, resolved once (agent_start). A NULL one is missing from the driver. */
#define HOOK(name, params, args, track) CUresult name params;
#include "hooks.def"
#undef HOOK

struct real_driver {
#define HOOK(name, params, args, track) __typeof__(&name) name;
#include "hooks.def"
#undef HOOK
};
extern struct real_driver real;

/* Resolves the originals (once). */
void hooks_resolve(void);
/* Resolves the originals and starts the control socket (once per process): the first driver
 * call does. */
void agent_start(void);
/* A driver function the agent uses but does not hook (cuModuleLoadData...), or NULL. */
void *driver_symbol(const char *name);
/* Does the driver have this hooked symbol? (Resolves the originals.) */
int driver_has(const char *name);
/* The wrapper of a hooked symbol by name, or NULL when it is not hooked. */
void *hook_by_name(const char *name);
/* Is p one of the wrappers? */
int hook_is_wrapper(const void *p);
/* The wrapper standing for driver function p, or p itself when p is not hooked. */
void *hook_map_proc(void *p);
/* Is the driver (TORPOR_AGENT_LIBCUDA, else libcuda.so.1) loaded in this process? */
int driver_loaded(void);

/* -- dlsym (dlsym.c) -------------------------------------------------------------------------- */

/* glibc's dlsym, never ours: the agent looks symbols up through this only. */
void *real_dlsym(void *handle, const char *name);

/* -- the gate (gate.c) ------------------------------------------------------------------------ */

/* Every wrapper: `gated = gate_enter()` ... `gate_exit(gated)`. gate_enter returns 0 (pass
 * straight through: a nested call, or the agent's own thread) or 1 (counted in flight, after
 * waiting while the gate is closed). */
int gate_enter(void);
void gate_exit(int gated);
/* Marks the calling thread as the agent's own: its driver calls never wait at the gate. */
void gate_agent_thread(void);
/* Keeps a closed gate closed: disarms the deadline that would reopen it (the memory is about to
 * be released: only a resume may open it now). 0, or -ETIMEDOUT when it is open already. */
int gate_hold(void);
/* Closes the gate: waits up to timeout_ms for the calls in flight, then synchronizes every
 * known context. 0, or -ETIMEDOUT / -EIO with the gate open again. The gate opens by itself
 * reopen_ms after (0: never; counted as gate.c says), enforced by the waiting calls too. */
int gate_close(long timeout_ms, long long reopen_ms);
void gate_open(void);
/* Enforces the prepare deadline (the control thread, between commands); returns how long to
 * sleep before the next tick (ms, at most 1000), or -1 when no deadline is armed. */
long gate_tick(void);

struct gate_status {
	int closed;
	long in_flight; /* calls inside the driver now */
	long waiting;   /* calls held at the closed gate */
};
void gate_status(struct gate_status *st);
void gate_after_fork(void);

/* -- tracking (track.c) ----------------------------------------------------------------------- */

enum alloc_kind { ALLOC_LINEAR, ALLOC_PITCH, ALLOC_VMM };

struct alloc {
	struct alloc *next;
	CUdeviceptr ptr;
	size_t size;           /* bytes the driver gave: pitch * height for a pitched one */
	size_t pitch, width, height;
	unsigned int elem;
	enum alloc_kind kind;
};

/* What a wrapper's _pre step hands to its _post step. A _pre step that made the call itself
 * sets handled and rc (hooks.c). */
struct track {
	struct alloc *taken;
	int handled;
	CUresult rc;
};

struct track_status {
	long allocations;
	unsigned long long bytes;
	int contexts;
};
void track_status(struct track_status *st);
/* Adds an allocation the agent served itself (vmm.c), so that status counts it. */
void track_add_vmm(CUdeviceptr ptr, size_t size);
/* A known context of device dev (NULL when none). */
CUcontext track_context_of(CUdevice dev);
/* Copies up to max known contexts to out; returns how many there are. */
int track_contexts(CUcontext *out, int max);
void track_forget_context(CUcontext ctx);
void track_after_fork(void);

/* The bookkeeping named in hooks.def: <track>_pre(&t, args...), <track>_post(&t, rc, args...).
 * Steps with nothing to do are empty macros. */
#define none_pre(t, ...) ((void)(t))
#define none_post(t, ...) ((void)(t))

#define ctx_create_pre(t, ...) ((void)(t))
void ctx_create_post(struct track *t, CUresult rc, CUcontext *pctx, unsigned int flags,
		     CUdevice dev);
#define ctx_destroy_pre(t, ...) ((void)(t))
void ctx_destroy_post(struct track *t, CUresult rc, CUcontext ctx);
#define ctx_retain_pre(t, ...) ((void)(t))
void ctx_retain_post(struct track *t, CUresult rc, CUcontext *pctx, CUdevice dev);

void mem_alloc_pre(struct track *t, CUdeviceptr *dptr, size_t bytesize);
void mem_alloc_post(struct track *t, CUresult rc, CUdeviceptr *dptr, size_t bytesize);
#define mem_alloc_pitch_pre(t, ...) ((void)(t))
void mem_alloc_pitch_post(struct track *t, CUresult rc, CUdeviceptr *dptr, size_t *pPitch,
			  size_t width, size_t height, unsigned int elem);
void mem_free_pre(struct track *t, CUdeviceptr dptr);
void mem_free_post(struct track *t, CUresult rc, CUdeviceptr dptr);

#define proc_address_pre(t, ...) ((void)(t))
void proc_address_post(struct track *t, CUresult rc, const char *symbol, void **pfn,
		       int cudaVersion, cuuint64_t flags);
#define proc_address_v2_pre(t, ...) ((void)(t))
void proc_address_v2_post(struct track *t, CUresult rc, const char *symbol, void **pfn,
			  int cudaVersion, cuuint64_t flags,
			  CUdriverProcAddressQueryResult *symbolStatus);

/* -- the virtual memory management API (vmm.c) ---------------------------------------------- */

/* The program's own VMM use and the allocations the agent serves from it. Each _pre step
 * makes the call itself (t->handled): handles are translated (a handle the program holds keeps
 * its value after the agent re-created its memory). */
void vmm_create_pre(struct track *t, CUmemGenericAllocationHandle *handle, size_t size,
		    const CUmemAllocationProp *prop, unsigned long long flags);
void vmm_release_pre(struct track *t, CUmemGenericAllocationHandle handle);
void vmm_map_pre(struct track *t, CUdeviceptr ptr, size_t size, size_t offset,
		 CUmemGenericAllocationHandle handle, unsigned long long flags);
void vmm_unmap_pre(struct track *t, CUdeviceptr ptr, size_t size);
void vmm_access_pre(struct track *t, CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
		    size_t count);
void vmm_retain_pre(struct track *t, CUmemGenericAllocationHandle *handle, void *addr);
void vmm_props_pre(struct track *t, CUmemAllocationProp *prop,
		   CUmemGenericAllocationHandle handle);
void vmm_export_pre(struct track *t, void *shareable, CUmemGenericAllocationHandle handle,
		    int type, unsigned long long flags);
#define vmm_create_post(t, ...) ((void)(t))
#define vmm_release_post(t, ...) ((void)(t))
#define vmm_map_post(t, ...) ((void)(t))
#define vmm_unmap_post(t, ...) ((void)(t))
#define vmm_access_post(t, ...) ((void)(t))
#define vmm_retain_post(t, ...) ((void)(t))
#define vmm_props_post(t, ...) ((void)(t))
#define vmm_export_post(t, ...) ((void)(t))

/* cuMemAlloc of bytesize, served from VMM when it is at least TORPOR_AGENT_VMM_MIN: 1 (served,
 * rc set), 0 (not: the driver's cuMemAlloc serves it). */
int vmm_alloc(CUdeviceptr *dptr, size_t bytesize, CUresult *rc);
/* cuMemFree of an allocation vmm_alloc served: 1 (freed, rc set), 0 (not one of ours). */
int vmm_free(CUdeviceptr dptr, CUresult *rc);

/* One physical allocation the mover can move: its memory mapped whole at src. */
struct movable {
	void *phys; /* vmm.c's */
	CUdeviceptr src;
	size_t size;
	CUdevice dev;
};
/* The movable allocations now (the gate closed): a malloc'd array (NULL when none). */
struct movable *vmm_movables(size_t *n, unsigned long long *bytes);
/* Releases the physical memory of one movable (unmapped everywhere, handle released; the
 * addresses stay reserved). 0 or a CUresult. */
CUresult vmm_drop(void *phys);
/* Re-creates a dropped one: same size and properties, mapped again where it was, access as
 * it was. 0 or a CUresult. */
CUresult vmm_recreate(void *phys);
/* Its data is back: an ordinary allocation again. */
void vmm_reloaded(void *phys);
/* Held memory (mover.c): was TORPOR_AGENT_VMM_EXPORT left on (not 0)? Is this movable's memory
 * exportable as a POSIX file descriptor (created asking for it)? Its descriptor (the driver's
 * call, not the hooked one: the handle stays movable); 0 or a CUresult. Is it dropped (no
 * handle now)? vmm_adopt: imports fd as its handle and maps it where it was, access as it
 * was; 0, or a CUresult with the imported handle released again (still dropped). */
int vmm_hold_enabled(void);
int vmm_exportable(void *phys);
CUresult vmm_export_fd(void *phys, int *fd);
/* Are descriptors a and b one open file description (a duplicate of the other)? 1, 0, or -1
 * when that cannot be told. kcmp(KCMP_FILE), else O_NONBLOCK flipped on a and looked for on b
 * (then set back). */
int fd_same_description(int a, int b);
/* Which of fds[0..n) share an open file description with another of them (shared[i] set, for
 * every one when that cannot be told); the number set. */
int fd_shared_descriptions(const int *fds, int n, unsigned char *shared);
int vmm_dropped(void *phys);
CUresult vmm_adopt(void *phys, int fd);
/* Every descriptor memory was taken back from (vmm.c, "kept") closed: after a prepare's drop. */
void vmm_kept_close_all(void);
/* Before a prepare exports: marks the kept descriptors that are another kept one's description
 * too, which vmm_export_fd then refuses to hand out. */
void vmm_kept_audit(void);
struct vmm_status {
	long movable;
	unsigned long long movable_bytes;
	long dropped;
	unsigned long long program_bytes; /* the program's own cuMemCreate handles (not moved) */
	long whole;        /* movable as a prepare moves them: mapped whole, the GPU may read */
	long unexportable; /* of those, not created exportable: nothing can be held */
	int hold_asked;    /* TORPOR_AGENT_VMM_EXPORT left on */
};
void vmm_status(struct vmm_status *st);
void vmm_after_fork(void);

/* -- moving memory (mover.c; mover.h names the files it is split into) ------------------------ */

/* Held memory (mover.c): at most HOLD_MAX allocations are held through a leave-running
 * checkpoint (PyTorch's expandable segments are one allocation every 20 MiB: 8192 is 160 GiB
 * of them); a program with more is copied back as before. Up to HOLD_DIRECT descriptors go in
 * the message itself, with the data files (control.c; the kernel's SCM_MAX_FD is 253), as
 * before 2026-12-07; more go in one bag (fdbag.h). */
#define HOLD_MAX 8192
#define HOLD_DIRECT 200

struct move_result {
	unsigned long long bytes;
	long chunks, allocations;
	double seconds;
	unsigned long long file_size[16];
	int nfiles, in_memory;
	double host_alloc_seconds; /* in_memory: the slowest worker's populate of its region */
	/* where the seconds went: the slowest worker's staging set-up (map, touch, register),
	 * the workers' copy (staging included), and the GPU memory released (save) or
	 * re-created (load) */
	double staging_seconds, copy_seconds, vmm_seconds;
	/* fingerprints (a save with an index): parts fingerprinted, skipped (the store has
	 * them) and their bytes, the seconds it took; fp_error: why there are none */
	long fp_parts, fp_skipped;
	unsigned long long fp_skipped_bytes;
	double fp_seconds;
	char fp_error[160];
	/* zeros (issue 20): parts found all zero on the GPU, neither copied nor written (a save)
	 * and re-created by a memset (a load), their bytes; zero_error: why none were looked for */
	long zero_parts;
	unsigned long long zero_bytes;
	char zero_error[160];
	int streamed; /* through the image store's stream (a ring and a socket), not files */
	/* held memory: a save's exported descriptors (held of them, the caller's to keep or
	 * close) and the seconds the exports took; a load's: taken back (held_back, nothing
	 * copied) and the seconds the imports took */
	int held, held_back;
	int *hold_fds; /* held of them: mover.c's (one save at a time), set by hold_export */
	char hold_error[160]; /* a save that asked to hold and held nothing: why */
	double hold_seconds, import_seconds;
	/* a save with a plan file: its copy left to torpor's copier (defer.c), or why not */
	int deferred;
	char defer_error[224];
	/* a load's error: its data files are not what was saved to them (short, a checksum or a
	 * fingerprint that does not match): the reply says "damaged" (PROTOCOL.md) */
	int damaged;
	char error[256];
};
/* Copies every movable allocation into the files (striped, one thread a file; nfds 0: into
 * the agent's own memory, one thread a CPU), then drops their physical memory. The gate must
 * be closed. index_fd >= 0: fingerprints every part on the GPU first, skips the parts whose
 * fingerprints are in known_fd (-1: none), and writes the index to index_fd. 0, or -1 with
 * r->error (nothing dropped). host_budget (0: none): refused, before anything is copied,
 * when the parts to copy (zero and skipped parts left out) need more host memory than this.
 * With TORPOR_AGENT_VMM_EXPORT on (the default) and every movable allocation exportable (at most HOLD_MAX),
 * each one's memory is exported to a descriptor before it is released (r->held of them in
 * r->hold_fds, the caller's): the memory stays on the GPU while one of them is open.
 * plan_fd >= 0 (a regular file): the copy is deferred where it can be (defer.c): the memory
 * held, the plan written there, nothing copied (r->deferred); else it copies, r->defer_error
 * saying why. */
int mover_save(const int *fds, int nfds, int known_fd, int index_fd, int ring_fd, int sock_fd,
	       int plan_fd, unsigned long long host_budget, struct move_result *r);
/* Re-creates and reloads what mover_save saved from the same files (none: from the agent's
 * memory), verifying checksums. 0, or -1 with r->error (what was re-created stays; a retry
 * goes on from there). nheld > 0: held, the descriptors a save exported (r->hold_fds, in
 * that order), are taken back first: each one checked to be of the file exported for its
 * allocation and no duplicate, imported and mapped where it was, then every fingerprinted part
 * checked on the GPU, nothing copied (r->held_back); any of that refused (one log line says
 * why), what was imported is let go and the load goes on from the files as without them. The
 * descriptors stay the caller's to close. After a deferred save (mover_deferred) the files
 * hold nothing until torpor's copier has run: without drained the load only takes the held
 * memory back, and a refused import undoes what it imported and changes nothing. */
int mover_load(const int *fds, int nfds, int ring_fd, int sock_fd, const int *held, int nheld,
	       int drained, struct move_result *r);
/* ring_fd >= 0 (with sock_fd, a SOCK_SEQPACKET socket): the data goes to (comes from) torpor's
 * image store through the ring instead of the files' bytes (PROTOCOL.md, "Streaming"): a save
 * still sizes the files (holes) and releases nothing before torpor commits; a load takes the
 * parts in any order. How long a stream waits for torpor: */
void mover_stream_timeout(long long ms);
/* Is there saved memory not yet reloaded? Is it in the agent's memory? */
int mover_pending(void);
/* Is the saved memory's copy deferred (defer.c: the files empty until the copier ran)? */
int mover_deferred(void);
/* The most allocations the next save holds (HOLD_DIRECT, or HOLD_MAX for `prepare ... bag`). */
void mover_hold_max(int n);
/* Are held the descriptors the pending save exported, one an allocation, in its order, as far
 * as their files and descriptions tell (the fingerprints tell the rest, on import)? 0, or -1
 * with why in err. */
int hold_matches(const int *held, int nheld, char *err, size_t errsize);
int mover_in_memory(void);
/* Bytes of the agent's own memory holding saved GPU data. */
unsigned long long mover_host_bytes(void);
void mover_after_fork(void);
/* The mover's tuning from the environment (mover.h, struct mover_tune): read once, at start. */
void mover_tune_read(void);
/* Are the moved parts checked by GPU fingerprints (TORPOR_AGENT_MOVER_CHECK=gpu, the
 * default)? Held memory needs them. */
int mover_gpu_checked(void);

/* -- GPU fingerprints (fingerprint.c, fingerprint.h) ------------------------------------------ */

struct fp_seg;
/* Runs the fingerprint kernel over n segments of the current context's device: lanes gets
 * n * FP_LANES * 2 accumulators (NULL: not asked for), nonzero n flags (1: a word of the
 * segment is not zero). 0, or -1 with err (nothing changed on the GPU). */
int fp_run(const struct fp_seg *segs, size_t n, uint64_t *lanes, uint32_t *nonzero, char *err,
	   size_t errsize);

/* -- allocator caches (caches.c) -------------------------------------------------------------- */

/* Asks the allocators in the program that keep freed device memory (PyTorch, CuPy) to give it
 * back to the driver, through their own Python API. The gate must be open. Returns 0 when
 * something was asked, -1 when there is nothing to ask (no Python, no such module). */
int caches_release(long timeout_ms);

/* -- the control socket (control.c) ----------------------------------------------------------- */

/* Creates $TORPOR_AGENT_DIR/agent-<pid>.sock and its thread; once per process. */
void control_start(void);
void control_after_fork(void);

/* -- small helpers ------------------------------------------------------------------------------ */

/* CLOCK_MONOTONIC in milliseconds. */
long long now_ms(void);
/* getenv() of a number of seconds (fractions allowed), else def. */
double env_seconds(const char *name, double def);

#endif
