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
typedef struct CUevent_st *CUevent;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlaunchConfig_st CUlaunchConfig;  /* only passed through, by pointer */
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;    /* only passed through, by pointer */

/* The virtual memory management API (CUDA 10.2+) */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUmemLocation_st {
	int type; /* CUmemLocationType */
	int id;
} CUmemLocation;
typedef struct CUmemAllocationProp_st {
	int type;                 /* CUmemAllocationType */
	int requestedHandleTypes; /* CUmemAllocationHandleType */
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct CUmemAccessDesc_st {
	CUmemLocation location;
	int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc");

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_SUPPORTED = 801,

	CU_MEM_ALLOCATION_TYPE_PINNED = 1,
	CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1, /* requestedHandleTypes: a bit mask */
	CU_MEM_LOCATION_TYPE_DEVICE = 1,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
	CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
	CU_STREAM_NON_BLOCKING = 1,
	CU_MEMHOSTREGISTER_PORTABLE = 1,
	CU_MEMHOSTREGISTER_READ_ONLY = 8, /* CUDA 11.1: memory the device only reads */
};

#endif
