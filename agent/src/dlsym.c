/* dlsym(): the second door to the driver.
 *
 * A program that dlopen()s libcuda and looks its functions up through the handle (libcudart,
 * ctypes, most frameworks) does not meet the agent's exported names: a lookup through a handle
 * searches that library and its dependencies only, never LD_PRELOAD. So the agent exports
 * dlsym too, and answers a lookup of a hooked name with its wrapper (dlsym_answer below).
 *
 * Every other lookup goes to glibc's dlsym unchanged, *as a tail jump*: glibc reads the
 * caller's return address to resolve RTLD_NEXT (and to pick the caller's namespace). A C
 * wrapper that calls glibc's dlsym would make every RTLD_NEXT lookup start after the agent
 * instead of after its caller: an interposer's dlsym(RTLD_NEXT, "malloc") could find itself
 * and recurse (HAMi-core carries a recursion detector for exactly that). C cannot promise a
 * tail call, so the exported entry point is a few lines of assembly per architecture: it asks
 * dlsym_answer() and, when that does not answer, jumps to glibc's dlsym with the caller's
 * return address still on the stack.
 *
 * glibc's own dlsym is found with dlvsym(RTLD_NEXT, "dlsym", <version>): dlvsym is not
 * interposed, and __libc_dlsym is private since glibc 2.34.
 */
#define LOG_PREFIX "dlsym: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>

/* Used by the assembly below; hidden like everything not AGENT_EXPORTed. */
void *(*torpor_glibc_dlsym)(void *, const char *);
int dlsym_answer(void *handle, const char *name, void *caller, void **answer);

static pthread_once_t glibc_once = PTHREAD_ONCE_INIT;

/* A dlsym that always fails, in case glibc's cannot be found (it always can). */
static void *no_dlsym(void *handle, const char *name)
{
	(void)handle;
	(void)name;
	return NULL;
}

static void find_glibc_dlsym(void)
{
	/* The architecture's base version first (the one every program linked before 2.34
	 * binds to), then GLIBC_2.34 where dlsym moved into libc. */
	static const char *const versions[] = {
#if defined(__x86_64__)
		"GLIBC_2.2.5",
#elif defined(__aarch64__)
		"GLIBC_2.17",
#endif
		"GLIBC_2.34",
	};
	void *f = NULL;

	for (size_t i = 0; !f && i < sizeof(versions) / sizeof(versions[0]); i++)
		f = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
	if (!f)
		pr_err("glibc's dlsym not found: dlsym lookups will fail");
	torpor_glibc_dlsym = f ? (void *(*)(void *, const char *))f : no_dlsym;
}

void *real_dlsym(void *handle, const char *name)
{
	pthread_once(&glibc_once, find_glibc_dlsym);
	return torpor_glibc_dlsym(handle, name);
}

static const void *object_of(const void *p)
{
	Dl_info info;

	return p && dladdr(p, &info) ? info.dli_fbase : NULL;
}

/* Answers dlsym(handle, name) called from `caller` when name is hooked: returns 1 with the
 * answer in *answer, or 0 to let glibc answer (also makes sure torpor_glibc_dlsym is set).
 *
 *   RTLD_NEXT                       glibc: the caller's "next" is the caller's business
 *   a name not in hooks.def         glibc
 *   not found through the handle    NULL, glibc's error left for dlerror()
 *   found in the caller's own
 *     object (a driver that looks
 *     itself up, as on WSL)         the driver's own function
 *   found in the agent itself       (RTLD_DEFAULT, or the main program's handle: the global
 *                                   scope, where the preloaded agent comes first) the wrapper
 *                                   when the driver is there and has the symbol, else NULL: a
 *                                   program probing for CUDA without a driver sees none, as
 *                                   before
 *   found elsewhere (the driver)    the wrapper
 */
int dlsym_answer(void *handle, const char *name, void *caller, void **answer)
{
	void *wrapper, *found;
	int saved_errno = errno; /* dlsym() is not expected to touch errno */

	pthread_once(&glibc_once, find_glibc_dlsym);
	errno = saved_errno;
	if (handle == RTLD_NEXT || !name || name[0] != 'c' || name[1] != 'u')
		return 0;
	wrapper = hook_by_name(name);
	if (!wrapper)
		return 0;
	found = torpor_glibc_dlsym(handle, name);
	if (!found) {
		*answer = NULL;
	} else if (hook_is_wrapper(found)) {
		if (torpor_glibc_dlsym(RTLD_NEXT, name) || (driver_loaded() && driver_has(name))) {
			(void)dlerror(); /* a successful lookup leaves no error behind */
			*answer = wrapper;
		} else {
			/* Failing again, so that dlerror() has glibc's "undefined symbol" (the
			 * dlopen of driver_loaded() reset it): callers print it. */
			(void)torpor_glibc_dlsym(RTLD_NEXT, name);
			*answer = NULL;
		}
	} else if (object_of(found) == object_of(caller)) {
		*answer = found;
	} else {
		*answer = wrapper;
	}
	pr_debug("%s via %s: %p", name,
		 handle == RTLD_DEFAULT ? "RTLD_DEFAULT" : "a handle", *answer);
	errno = saved_errno;
	return 1;
}

/* void *dlsym(void *handle, const char *name): exported (.globl, default visibility). */
#if defined(__x86_64__)
__asm__(".text\n"
	".globl dlsym\n"
	".type dlsym, @function\n"
	".p2align 4\n"
	"dlsym:\n"
	".cfi_startproc\n"
#ifdef __CET__
	"	endbr64\n"			/* an indirect-branch target under CET/IBT */
#endif
	"	pushq %rdi\n"			/* handle */
	".cfi_adjust_cfa_offset 8\n"
	"	pushq %rsi\n"			/* name */
	".cfi_adjust_cfa_offset 8\n"
	"	subq $8, %rsp\n"		/* the answer; %rsp is 16-byte aligned for the call */
	".cfi_adjust_cfa_offset 8\n"
	"	movq 24(%rsp), %rdx\n"		/* caller: our return address */
	"	movq %rsp, %rcx\n"		/* &answer */
	"	call dlsym_answer\n"
	"	movq (%rsp), %rdx\n"
	"	addq $8, %rsp\n"
	".cfi_adjust_cfa_offset -8\n"
	"	popq %rsi\n"
	".cfi_adjust_cfa_offset -8\n"
	"	popq %rdi\n"
	".cfi_adjust_cfa_offset -8\n"
	"	testl %eax, %eax\n"
	"	jz 1f\n"
	"	movq %rdx, %rax\n"
	"	ret\n"
	"1:	jmpq *torpor_glibc_dlsym(%rip)\n" /* the caller's return address is on the stack */
	".cfi_endproc\n"
	".size dlsym, .-dlsym\n");
#elif defined(__aarch64__)
/* Tested under qemu-aarch64 when the cross tools are there (tests/unit/test_agent.py). */
__asm__(".text\n"
	".globl dlsym\n"
	".type dlsym, %function\n"
	".p2align 2\n"
	"dlsym:\n"
	".cfi_startproc\n"
	/* bti c: a landing pad for calls through a pointer (dlsym is mostly reached through the
	 * PLT's br x17); without it a BTI-enforcing system raises SIGILL at the first call. In
	 * the hint space: a no-op on cores without BTI, and assembles everywhere. */
	"	hint #34\n"			/* bti c */
	"	stp x29, x30, [sp, #-48]!\n"
	".cfi_def_cfa_offset 48\n"
	".cfi_offset 29, -48\n"
	".cfi_offset 30, -40\n"
	"	mov x29, sp\n"
	"	stp x0, x1, [sp, #16]\n"	/* handle, name */
	"	mov x2, x30\n"			/* caller */
	"	add x3, sp, #32\n"		/* &answer */
	"	bl dlsym_answer\n"
	"	mov w9, w0\n"
	"	ldr x10, [sp, #32]\n"
	"	ldp x0, x1, [sp, #16]\n"
	"	ldp x29, x30, [sp], #48\n"	/* x30: the caller's return address again */
	".cfi_def_cfa_offset 0\n"
	".cfi_restore 29\n"
	".cfi_restore 30\n"
	"	cbz w9, 1f\n"
	"	mov x0, x10\n"
	"	ret\n"
	"1:	adrp x16, torpor_glibc_dlsym\n"
	"	ldr x16, [x16, #:lo12:torpor_glibc_dlsym]\n"
	"	br x16\n"
	".cfi_endproc\n"
	".size dlsym, .-dlsym\n");
#else
#error "dlsym.c: no tail-jumping dlsym for this architecture (x86_64 and aarch64 only)"
#endif
