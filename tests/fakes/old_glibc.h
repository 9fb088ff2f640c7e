/* For tests/unit/test_agent_glibc.py's run under an older glibc only: force-included (with
 * -D_GNU_SOURCE) into the fake libcuda and a driver-calling test library built on this host,
 * so that they too load with that glibc. The agent's own bindings (agent/src/glibc_compat.h),
 * plus what the fakes use besides: dlsym, pthread_rwlock_*, stat (a function only since
 * glibc 2.33: a newfstatat system call here, as glibc >= 2.33 makes it).
 */
#include <features.h>
#include "../../agent/src/glibc_compat.h"

#if defined(__GLIBC__) && defined(__x86_64__)
#include <sys/stat.h>
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_init,pthread_rwlock_init@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_destroy,pthread_rwlock_destroy@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_rdlock,pthread_rwlock_rdlock@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_wrlock,pthread_rwlock_wrlock@GLIBC_2.2.5");
__asm__(".symver pthread_rwlock_unlock,pthread_rwlock_unlock@GLIBC_2.2.5");
static inline int torpor_test_stat(const char *path, struct stat *st)
{
	return (int)syscall(SYS_newfstatat, AT_FDCWD, path, st, 0);
}
#define stat(path, st) torpor_test_stat(path, st)
#endif
