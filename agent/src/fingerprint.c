/* GPU fingerprints of saved memory (fingerprint.h): the kernel, loaded from PTX through the
 * driver's module API (not hooked: the agent's own), run over a list of segments. The mover
 * (fingerprint_parts.c) turns the lanes into one fingerprint a part.
 *
 * The module is loaded for each run and unloaded after: a handle kept across a checkpoint
 * would name a module of a driver state that the restore replaced, and the JIT of this one
 * kernel costs milliseconds (the driver caches it). Its small buffers (the segment table, the
 * zero flags, the lanes when asked for) come from the driver's cuMemAlloc, not the agent's
 * movable memory.
 */
#define LOG_PREFIX "fingerprint: "
#include "agent.h" /* first: _GNU_SOURCE */
#include "fingerprint.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct CUmod_st *CUmodule;

#define BATCH 2048 /* segments a launch: 32 KiB of table, 8 MiB of lanes on the GPU */

int fp_run(const struct fp_seg *segs, size_t n, uint64_t *lanes, uint32_t *nonzero, char *err,
	   size_t errsize)
{
	CUresult (*load)(CUmodule *, const void *) = driver_symbol("cuModuleLoadData");
	CUresult (*get)(CUfunction *, CUmodule, const char *) = driver_symbol("cuModuleGetFunction");
	CUresult (*unload)(CUmodule) = driver_symbol("cuModuleUnload");
	size_t batch = n < BATCH ? n : BATCH, lane_bytes = (size_t)FP_LANES * 2 * sizeof(uint64_t);
	CUdeviceptr table = 0, out = 0, nz = 0;
	CUmodule mod = NULL;
	CUfunction fn;
	CUresult rc;
	int ret = -1;

	if (!n)
		return 0;
	if (!load || !get || !unload || !real.cuLaunchKernel || !real.cuMemAlloc_v2 ||
	    !real.cuMemFree_v2 || !real.cuMemcpyHtoD_v2 || !real.cuMemcpyDtoH_v2) {
		snprintf(err, errsize, "the driver lacks the module API");
		return -1;
	}
	if ((rc = load(&mod, FP_PTX)) != CUDA_SUCCESS) {
		snprintf(err, errsize, "cuModuleLoadData of the fingerprint kernel: CUresult %d", rc);
		return -1;
	}
	if ((rc = get(&fn, mod, FP_KERNEL)) != CUDA_SUCCESS) {
		snprintf(err, errsize, "cuModuleGetFunction: CUresult %d", rc);
		goto out;
	}
	if ((rc = real.cuMemAlloc_v2(&table, batch * sizeof(*segs))) != CUDA_SUCCESS ||
	    (rc = real.cuMemAlloc_v2(&nz, batch * sizeof(*nonzero))) != CUDA_SUCCESS ||
	    (lanes && (rc = real.cuMemAlloc_v2(&out, batch * lane_bytes)) != CUDA_SUCCESS)) {
		snprintf(err, errsize, "%zu KiB of GPU memory for fingerprints: CUresult %d%s",
		    batch * (sizeof(*segs) + sizeof(*nonzero) + (lanes ? lane_bytes : 0)) >> 10, rc,
		    rc == CUDA_ERROR_OUT_OF_MEMORY ? " (the GPU is full)" : "");
		goto out;
	}
	for (size_t done = 0; done < n; done += batch) {
		size_t k = n - done < batch ? n - done : batch;
		void *params[] = { &table, &out, &nz };

		if ((rc = real.cuMemcpyHtoD_v2(table, segs + done, k * sizeof(*segs))) ||
		    (rc = real.cuLaunchKernel(fn, (unsigned)k, 1, 1, FP_LANES, 1, 1, 0, NULL, params,
					      NULL)) ||
		    (rc = real.cuMemcpyDtoH_v2(nonzero + done, nz, k * sizeof(*nonzero))) ||
		    (lanes && (rc = real.cuMemcpyDtoH_v2(lanes + done * FP_LANES * 2, out,
						      k * lane_bytes)))) {
			snprintf(err, errsize, "fingerprint kernel over %zu segments: CUresult %d", k, rc);
			goto out;
		}
	}
	ret = 0;
out:
	if (out)
		real.cuMemFree_v2(out);
	if (nz)
		real.cuMemFree_v2(nz);
	if (table)
		real.cuMemFree_v2(table);
	unload(mod);
	return ret;
}
