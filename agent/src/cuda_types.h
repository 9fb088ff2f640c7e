/* The few CUDA driver types and values the agent needs, as cuda.h (CUDA 12/13) declares them on
 * 64-bit Linux, so that no toolkit is needed to build it. Only the ABI matters here: the size
 * of each type and the values the agent compares against.
 */
#ifndef TORPOR_CUDA_TYPES_H
#define TORPOR_CUDA_TYPES_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;                           /* enum cudaError_enum */
typedef int CUdevice;                           /* CUdevice_v1 */
typedef unsigned long long CUdeviceptr;         /* CUdeviceptr_v2: 64 bits on every 64-bit ABI */
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef int CUdriverProcAddressQueryResult;     /* enum, 12.0+ */

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_SUPPORTED = 801,
};

#endif
