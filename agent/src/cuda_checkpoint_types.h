/* The CUDA driver's checkpoint API (cuCheckpointProcess*, CUDA 12.8+) as cuda.h declares it on
 * 64-bit Linux: argument structs (each 64 bytes, reserved fields zeroed) and process states.
 * Shared by the fake libcuda (tests/fakes) and the cuda-checkpoint stand-in (bench/upstream);
 * torpor itself calls these through ctypes (shim/torpor/driver.py).
 */
#ifndef TORPOR_CUDA_CHECKPOINT_TYPES_H
#define TORPOR_CUDA_CHECKPOINT_TYPES_H

#include <stdint.h>

typedef struct { char bytes[16]; } CUuuid;

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    uint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    uint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUcheckpointLockArgs");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "CUcheckpointCheckpointArgs");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "CUcheckpointGpuPair");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUcheckpointRestoreArgs");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "CUcheckpointUnlockArgs");

/* CUprocessState */
enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
};

#endif
