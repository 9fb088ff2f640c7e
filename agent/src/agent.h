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
#include <stddef.h>
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

enum alloc_kind { ALLOC_LINEAR, ALLOC_PITCH };

struct alloc {
	struct alloc *next;
	CUdeviceptr ptr;
	size_t size;           /* bytes the driver gave: pitch * height for a pitched one */
	size_t pitch, width, height;
	unsigned int elem;
	enum alloc_kind kind;
};

/* What a wrapper's _pre step hands to its _post step. */
struct track {
	struct alloc *taken;
};

struct track_status {
	long allocations;
	unsigned long long bytes;
	int contexts;
};
void track_status(struct track_status *st);
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

#define mem_alloc_pre(t, ...) ((void)(t))
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
