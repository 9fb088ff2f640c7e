/* bench/driver_loader.h: what the benches written against the driver API share (host_bounds.c,
 * probe_held_memory.c): libcuda.so.1 opened at run time, its calls looked up by their exported
 * names (cuda.h's _v2 names where there are two), so they build with the agent's own
 * declarations (agent/src/cuda_types.h) and no toolkit, and run on tests/fakes' libcuda too.
 * Define BENCH_NAME (the prefix of their error lines) and BENCH_FAIL (their exit code for a
 * missing driver or call) before including it.
 */
#ifndef TORPOR_BENCH_DRIVER_LOADER_H
#define TORPOR_BENCH_DRIVER_LOADER_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static inline double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* libcuda.so.1, or the program ends with one line */
static inline void *driver_open(void)
{
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

	if (!lib) {
		fprintf(stderr, BENCH_NAME ": %s\n", dlerror());
		exit(BENCH_FAIL);
	}
	return lib;
}

/* a call the driver must have, or the program ends with one line */
static inline void *sym(void *lib, const char *name)
{
	void *p = dlsym(lib, name);

	if (!p) {
		fprintf(stderr, BENCH_NAME ": libcuda.so.1 has no %s\n", name);
		exit(BENCH_FAIL);
	}
	return p;
}

#endif
