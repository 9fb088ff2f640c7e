/* Load under the glibc of old CUDA images (CentOS 7: 2.17, UBI 8: 2.28, Ubuntu 20.04: 2.31).
 *
 * torpor-runtime preloads this library from the host into a container's own libc. Built
 * against a glibc >= 2.34, a plain build binds its imports to the newest versions the build
 * host defines (pthread_create@GLIBC_2.34, dlopen@GLIBC_2.34, pthread_sigmask@GLIBC_2.32,
 * fstat@GLIBC_2.33), and an older ld.so refuses the library ("version `GLIBC_2.34' not
 * found"): every process of the container would fail to start. So:
 *
 *  - each of those functions is bound to its oldest version (.symver below): the
 *    architecture's base version (x86_64 GLIBC_2.2.5, aarch64 GLIBC_2.17), or the one it was
 *    introduced with. glibc >= 2.34 keeps these as compatibility symbols in libc.so.6, older
 *    ones define them in libpthread.so.0 / libdl.so.2: the dynamic linker matches a versioned
 *    symbol by its version name in whichever loaded object defines it, so one build serves
 *    both;
 *  - the Makefile links libpthread.so.0 and libdl.so.2 as DT_NEEDED (stubs on glibc >= 2.34):
 *    before 2.34 those functions live only there, and a program that links neither (the
 *    container's /bin/sh) would leave them unresolved;
 *  - fstat, a real function only since 2.33 (before: an inline wrapper of __fxstat), is a
 *    direct newfstatat system call, the one glibc >= 2.33 makes itself into struct stat on
 *    these 64-bit ABIs.
 *
 * tests/unit/test_agent_glibc.py reads the built library's version needs and fails on any
 * GLIBC_x.y newer than 2.17 (torpor-runtime also compares them with a container's libc and
 * skips the preload where they are not met: runtime/libc.py).
 *
 * Included by agent.h before any header that declares strtol or fscanf (the #error below
 * says so at build time), after defining _GNU_SOURCE.
 */
#ifndef TORPOR_GLIBC_COMPAT_H
#define TORPOR_GLIBC_COMPAT_H

#include <features.h> /* __GLIBC__ and the __GLIBC_USE_* switches below */

#if defined(__GLIBC__) && (defined(__x86_64__) || defined(__aarch64__))

#if defined(_STDLIB_H) || defined(_STDIO_H) || defined(_INTTYPES_H) || defined(_WCHAR_H)
#error "glibc_compat.h must come before <stdlib.h>, <stdio.h>, <inttypes.h> and <wchar.h>"
#endif

/* glibc >= 2.38's headers, with _GNU_SOURCE, redirect strtol, strtoul(l), sscanf, fscanf & co.
 * to __isoc23_* (GLIBC_2.38: they also take C23's 0b prefixes), which no older glibc defines:
 * built on such a host (Ubuntu 24.04, Debian 13, the GPU host's 2.39) the library needed
 * GLIBC_2.38, and torpor-runtime skipped the agent in every container of an older libc.
 * The agent reads no 0b numbers: features.h's switch off, as glibc turns it off to build
 * those functions themselves (2.38-2.39 name it C2X_STRTOL, later ones C23_STRTOL). Must come
 * before <stdlib.h>, <stdio.h> or <inttypes.h>: agent.h includes this first. */
#ifdef __GLIBC_USE_C2X_STRTOL
#undef __GLIBC_USE_C2X_STRTOL
#define __GLIBC_USE_C2X_STRTOL 0
#endif
#ifdef __GLIBC_USE_C23_STRTOL
#undef __GLIBC_USE_C23_STRTOL
#define __GLIBC_USE_C23_STRTOL 0
#endif

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef TORPOR_TEST_DRIVER_ONE_FILE
#include <stdio.h>
#include <string.h>
#endif

#if defined(__x86_64__)
#define TORPOR_GLIBC_BASE "GLIBC_2.2.5"
#define TORPOR_GLIBC_2_3_3 "GLIBC_2.3.3"
#define TORPOR_GLIBC_2_12 "GLIBC_2.12"
#else /* aarch64: its first glibc is 2.17, every symbol's oldest version */
#define TORPOR_GLIBC_BASE "GLIBC_2.17"
#define TORPOR_GLIBC_2_3_3 "GLIBC_2.17"
#define TORPOR_GLIBC_2_12 "GLIBC_2.17"
#endif

#define TORPOR_SYMVER(sym, ver) __asm__(".symver " #sym "," #sym "@" ver)

/* libdl before 2.34 */
TORPOR_SYMVER(dlopen, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(dlclose, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(dlerror, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(dladdr, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(dlvsym, TORPOR_GLIBC_BASE);
/* libpthread before 2.34 (pthread_sigmask: moved into libc in 2.32) */
TORPOR_SYMVER(pthread_create, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_join, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_detach, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_once, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_key_create, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_getspecific, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_setspecific, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_mutexattr_init, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_mutexattr_destroy, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_mutexattr_settype, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_mutex_trylock, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_sigmask, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_kill, TORPOR_GLIBC_BASE);
TORPOR_SYMVER(pthread_condattr_setclock, TORPOR_GLIBC_2_3_3);
TORPOR_SYMVER(pthread_setname_np, TORPOR_GLIBC_2_12);

#undef TORPOR_SYMVER

static inline int torpor_fstat(int fd, struct stat *st)
{
	int rc = (int)syscall(SYS_newfstatat, fd, "", st, AT_EMPTY_PATH);

#ifdef TORPOR_TEST_DRIVER_ONE_FILE
	/* a test build only (tests/unit/test_agent_held.py, never a package): the fake libcuda's
	 * exported memfds answer as the real driver's descriptors do, every one the same device
	 * node (/dev/nvidiactl, opened anew for each export) */
	char path[32], link[32] = "";

	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	if (rc == 0 && readlink(path, link, sizeof(link) - 1) > 0 &&
	    !strncmp(link, "/memfd:fake-cuda-mem.", 21)) {
		st->st_dev = 5;
		st->st_ino = 195;
		st->st_mode = S_IFCHR | 0666;
	}
#endif
	return rc;
}
#define fstat(fd, st) torpor_fstat(fd, st)

#endif /* glibc on x86_64 / aarch64 */
#endif /* TORPOR_GLIBC_COMPAT_H */
