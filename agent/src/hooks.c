/* The wrappers: one per line of hooks.def, all of one shape, and the driver's originals.
 *
 * Each wrapper is a hidden function wrap_<symbol>, exported under the driver's name through an
 * alias. The agent itself only ever uses the hidden name: its addresses (in the dlsym and
 * cuGetProcAddress answers) cannot be interposed by anyone else's export of the same name.
 */
#define LOG_PREFIX "hooks: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

struct real_driver real;

static pthread_once_t real_once = PTHREAD_ONCE_INIT;

#define UNPAREN(...) __VA_ARGS__

/* gate enter -> (pre) -> real call -> (post) -> gate exit. A _pre step may make the call
 * itself instead (vmm.c: translated handles, VMM-backed allocations): it sets t.handled and
 * t.rc, and then neither the real call nor the _post step runs. errno is the program's and the
 * driver's only: whatever the agent does around the real call (the first one starts the
 * socket: mkdir, unlink, ...) leaves it as it was. The bookkeeping runs inside the
 * gate, so that a closed gate (no call in flight) also means a table that is up to date. A
 * nested call (the driver calling its own exports, the agent's thread) passes straight
 * through: no waiting, no bookkeeping. */
#define HOOK(name, params, args, step)                                                      \
	static CUresult wrap_##name params                                                  \
	{                                                                                   \
		struct track t = { 0 };                                                     \
		int saved_errno = errno;                                                    \
		int gated = gate_enter();                                                   \
		CUresult rc;                                                                \
                                                                                            \
		if (gated)                                                                  \
			step##_pre(&t, UNPAREN args);                                       \
		errno = saved_errno;                                                        \
		if (t.handled)                                                              \
			rc = t.rc;                                                          \
		else                                                                        \
			rc = real.name ? real.name args : CUDA_ERROR_NOT_SUPPORTED;         \
		saved_errno = errno;                                                        \
		if (gated && !t.handled)                                                    \
			step##_post(&t, rc, UNPAREN args);                                  \
		gate_exit(gated);                                                           \
		errno = saved_errno;                                                        \
		return rc;                                                                  \
	}                                                                                   \
	AGENT_EXPORT __typeof__(wrap_##name) name __attribute__((alias("wrap_" #name)));
#include "hooks.def"
#undef HOOK

void *hook_by_name(const char *name)
{
#define HOOK(name_, params, args, track)  \
	if (!strcmp(name, #name_))        \
		return (void *)wrap_##name_;
#include "hooks.def"
#undef HOOK
	return NULL;
}

int hook_is_wrapper(const void *p)
{
#define HOOK(name, params, args, track) \
	if (p == (const void *)wrap_##name) \
		return 1;
#include "hooks.def"
#undef HOOK
	return 0;
}

/* cuGetProcAddress answers with the driver's function for the version the caller asked for
 * (cuMemAlloc at 3.2+ is cuMemAlloc_v2): matching the address against the originals leaves
 * that choice to the driver. A function the list lacks (an older version, a _ptsz variant)
 * is answered unwrapped. */
void *hook_map_proc(void *p)
{
#define HOOK(name, params, args, track)                  \
	if (p && p == (void *)real.name)                 \
		return (void *)wrap_##name;
#include "hooks.def"
#undef HOOK
	return p;
}

static void *driver_handle; /* the driver's, kept open for good (resolve_real) */

static const char *driver_path(void)
{
	const char *path = getenv("TORPOR_AGENT_LIBCUDA");

	return path && *path ? path : "libcuda.so.1";
}

int driver_loaded(void)
{
	void *h = dlopen(driver_path(), RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);

	if (!h)
		return 0;
	dlclose(h);
	return 1;
}

static void after_fork_child(void)
{
	gate_after_fork();
	track_after_fork();
	vmm_after_fork();
	mover_after_fork();
	control_after_fork();
}

/* The driver the program already loaded (RTLD_NOLOAD: by soname or by file), else loaded now.
 * Looking up through its handle never finds the agent's exports. Kept open for good. */
static void resolve_real(void)
{
	const char *path = driver_path();
	int missing = 0;
	void *h;

	pthread_atfork(NULL, NULL, after_fork_child);
	h = dlopen(path, RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
	if (!h)
		h = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
	driver_handle = h;
	if (!h) {
		pr_warn("cannot load the driver %s: %s; every hooked call answers "
			"CUDA_ERROR_NOT_SUPPORTED", path, dlerror());
		return;
	}
#define HOOK(name, params, args, track)                                   \
	real.name = (__typeof__(real.name))real_dlsym(h, #name);          \
	if (!real.name) {                                                  \
		pr_debug("%s: not in %s", #name, path);                   \
		missing++;                                                 \
	}
#include "hooks.def"
#undef HOOK
	pr_info("driver %s resolved (%d hooked symbols missing from it)", path, missing);
}

void hooks_resolve(void)
{
	pthread_once(&real_once, resolve_real);
}

void *driver_symbol(const char *name)
{
	hooks_resolve();
	return driver_handle ? real_dlsym(driver_handle, name) : NULL;
}

int driver_has(const char *name)
{
	hooks_resolve();
#define HOOK(name_, params, args, track)  \
	if (!strcmp(name, #name_))        \
		return real.name_ != NULL;
#include "hooks.def"
#undef HOOK
	return 0;
}

void agent_start(void)
{
	hooks_resolve();
	control_start();
}
