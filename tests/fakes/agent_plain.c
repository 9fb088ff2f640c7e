/* A program that calls the driver by plain symbol references, linked against the fake
 * libcuda.so.1, for tests/unit/test_agent.py: under LD_PRELOAD=libtorpor-agent.so its calls
 * bind to the agent's exports. cuInit, cuDeviceGet, cuCtxCreate_v2, cuMemAlloc_v2 of 1 MiB and
 * 3 MiB, cuMemFree_v2 of the first; then prints one JSON line and waits for a line on stdin
 * (the test reads the agent's status meanwhile).
 *
 * "next_same": dlsym(RTLD_NEXT, "dlsym") == dlsym(RTLD_DEFAULT, "dlsym"). True with or without
 * the agent: the object after this program that defines dlsym is the first one that does (the
 * agent when preloaded, else libc). False means the agent's dlsym lost its caller's identity
 * and searched "next" after itself.
 *
 *   cc -o agent_plain agent_plain.c -L<fakes build> -l:libcuda.so.1 -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(int *dev, int ordinal);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, int dev);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);

int main(void)
{
	CUdeviceptr a = 0, b = 0;
	CUcontext ctx;
	int dev = 0, next_same;
	CUresult rc;

	rc = cuInit(0);
	if (!rc)
		rc = cuDeviceGet(&dev, 0);
	if (!rc)
		rc = cuCtxCreate_v2(&ctx, 0, dev);
	if (!rc)
		rc = cuMemAlloc_v2(&a, 1 << 20);
	if (!rc)
		rc = cuMemAlloc_v2(&b, 3 << 20);
	if (!rc)
		rc = cuMemFree_v2(a);
	next_same = dlsym(RTLD_NEXT, "dlsym") == dlsym(RTLD_DEFAULT, "dlsym");
	printf("{\"rc\": %d, \"next_same\": %s}\n", rc, next_same ? "true" : "false");
	fflush(stdout);
	getchar();
	return 0;
}
