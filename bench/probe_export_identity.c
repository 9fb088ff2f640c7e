/* bench/probe_export_identity.c: what the driver's exported POSIX descriptors are, for the
 * agent's held memory (agent/src/mover.c, "held"; not yet run on a GPU host).
 *
 * The agent tells held descriptors apart by their files (fstat's st_dev/st_ino), and holds
 * nothing when two allocations' descriptors are one file. If the driver's descriptors are all
 * one device node or one anonymous inode, that check turns the hold off everywhere: this says
 * which. It also asks whether an imported handle can be exported again (the H200 refused it in
 * probe_held_memory's holder, another process), in this process and after the original handle
 * is released: a held resume leaves the agent's allocations imported.
 *
 *   gcc -O1 bench/probe_export_identity.c -ldl -o /tmp/probe_export_identity && /tmp/probe_export_identity
 */
#define _GNU_SOURCE
#include "../agent/src/cuda_types.h"
#include <dlfcn.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
int main(void)
{
	void *l = dlopen("libcuda.so.1", RTLD_NOW);
	if (!l) { printf("no libcuda\n"); return 1; }
	CUresult (*Init)(unsigned) = dlsym(l, "cuInit");
	CUresult (*DevGet)(CUdevice *, int) = dlsym(l, "cuDeviceGet");
	CUresult (*Retain)(CUcontext *, CUdevice) = dlsym(l, "cuDevicePrimaryCtxRetain");
	CUresult (*SetCur)(CUcontext) = dlsym(l, "cuCtxSetCurrent");
	CUresult (*Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long) = dlsym(l, "cuMemCreate");
	CUresult (*Export)(void *, CUmemGenericAllocationHandle, int, unsigned long long) = dlsym(l, "cuMemExportToShareableHandle");
	CUresult (*Import)(CUmemGenericAllocationHandle *, void *, int) = dlsym(l, "cuMemImportFromShareableHandle");
	CUresult (*Release)(CUmemGenericAllocationHandle) = dlsym(l, "cuMemRelease");
	CUdevice d; CUcontext c;
	printf("init %d %d %d %d\n", Init(0), DevGet(&d, 0), Retain(&c, d), SetCur(c));
	CUmemAllocationProp p; memset(&p, 0, sizeof p);
	p.type = 1; p.requestedHandleTypes = 1; p.location.type = 1; p.location.id = 0;
	CUmemGenericAllocationHandle h[2], hi = 0, hn;
	for (int i = 0; i < 2; i++) {
		int fd = -1, fd2 = -1; struct stat st; char path[64], link[256] = "";
		printf("create %d\n", Create(&h[i], 2 << 20, &p, 0));
		printf("export %d fd %d\n", Export(&fd, h[i], 1, 0), fd);
		fstat(fd, &st); snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
		if (readlink(path, link, sizeof link - 1) < 0)
			strcpy(link, "?");
		printf("fd %d dev %lu ino %lu rdev %lu mode %o link %s\n", fd, (unsigned long)st.st_dev, (unsigned long)st.st_ino, (unsigned long)st.st_rdev, st.st_mode, link);
		printf("export again %d fd %d\n", Export(&fd2, h[i], 1, 0), fd2);
		fstat(fd2, &st); printf("  again dev %lu ino %lu\n", (unsigned long)st.st_dev, (unsigned long)st.st_ino);
		if (i == 0) {
			printf("import own %d\n", Import(&hi, (void *)(intptr_t)fd, 1));
			int fd3 = -1;
			printf("export imported %d fd %d\n", Export(&fd3, hi, 1, 0), fd3);
			printf("release orig %d\n", Release(h[i]));
			printf("import after release %d\n", Import(&hn, (void *)(intptr_t)fd2, 1));
			fd3 = -1;
			printf("export imported (after orig released) %d fd %d\n", Export(&fd3, hn, 1, 0), fd3);
		}
	}
	return 0;
}
