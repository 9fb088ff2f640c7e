/* Allocator caches: memory the program freed but its allocator keeps reserved on the GPU.
 *
 * PyTorch's caching allocator keeps freed blocks (often as much as the program uses); CuPy's
 * memory pool does the same. The driver cannot tell them from live data, so without help the
 * mover would copy them out and back. Their own release calls give that memory back to the
 * driver (cudaFree, through the agent's hooks, so it stops being tracked): the agent runs them
 * through the program's Python interpreter, the one allocator-independent door these
 * allocators have in common (their C++ entry points are inline functions, not symbols).
 *
 * Only when the program already has Python running and the module imported (nothing is
 * imported), in a thread of its own that takes the GIL like any other thread (the program
 * runs on meanwhile), and with a time limit: a program that holds the GIL for long just keeps
 * its caches. The code runs in a fresh namespace (nothing is added to __main__) and swallows
 * its own exceptions. TORPOR_AGENT_RELEASE_CACHES=0 turns this off.
 */
#define LOG_PREFIX "caches: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>

static const char CODE[] =
	"exec(\"try:\\n"
	" import sys\\n"
	" t = sys.modules.get('torch')\\n"
	" if t is not None and t.cuda.is_initialized():\\n"
	"  t.cuda.synchronize()\\n"
	"  t.cuda.empty_cache()\\n"
	" c = sys.modules.get('cupy')\\n"
	" if c is not None:\\n"
	"  c.get_default_memory_pool().free_all_blocks()\\n"
	"except Exception:\\n"
	" pass\\n\", {})\n";

static struct {
	int (*is_initialized)(void);
	int (*is_finalizing)(void);
	int (*ensure)(void);
	void (*release)(int);
	int (*run)(const char *);
} py;

static struct {
	pthread_mutex_t lock;
	pthread_cond_t done_cv;
	int running, done;
} job = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0 };

static int find_python(void)
{
	py.is_initialized = real_dlsym(RTLD_DEFAULT, "Py_IsInitialized");
	py.is_finalizing = real_dlsym(RTLD_DEFAULT, "Py_IsFinalizing");
	if (!py.is_finalizing)
		py.is_finalizing = real_dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
	py.ensure = real_dlsym(RTLD_DEFAULT, "PyGILState_Ensure");
	py.release = real_dlsym(RTLD_DEFAULT, "PyGILState_Release");
	py.run = real_dlsym(RTLD_DEFAULT, "PyRun_SimpleString");
	return py.is_initialized && py.ensure && py.release && py.run && py.is_initialized() &&
	       !(py.is_finalizing && py.is_finalizing());
}

static void *run_main(void *arg)
{
	int state;

	(void)arg;
	state = py.ensure();
	if (py.run(CODE) != 0)
		pr_warn("the release code failed");
	py.release(state);
	pthread_mutex_lock(&job.lock);
	job.done = 1;
	job.running = 0;
	pthread_cond_broadcast(&job.done_cv);
	pthread_mutex_unlock(&job.lock);
	return NULL;
}

int caches_release(long timeout_ms)
{
	const char *off = getenv("TORPOR_AGENT_RELEASE_CACHES");
	pthread_attr_t attr;
	pthread_t thread;
	sigset_t all, old;
	struct timespec ts;
	int ret = 0;

	if ((off && !strcmp(off, "0")) || !find_python())
		return -1;
	pthread_mutex_lock(&job.lock);
	if (job.running) { /* the last one never got the GIL: do not pile up */
		pthread_mutex_unlock(&job.lock);
		pr_warn("the previous cache release still waits for the GIL");
		return -1;
	}
	job.running = 1;
	job.done = 0;
	pthread_mutex_unlock(&job.lock);

	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	ret = pthread_create(&thread, &attr, run_main, NULL);
	pthread_attr_destroy(&attr);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (ret) {
		pthread_mutex_lock(&job.lock);
		job.running = 0;
		pthread_mutex_unlock(&job.lock);
		return -1;
	}
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += timeout_ms / 1000;
	ts.tv_nsec += (timeout_ms % 1000) * 1000000L;
	if (ts.tv_nsec >= 1000000000L) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000L;
	}
	pthread_mutex_lock(&job.lock);
	while (!job.done && ret == 0)
		ret = pthread_cond_timedwait(&job.done_cv, &job.lock, &ts);
	pthread_mutex_unlock(&job.lock);
	if (!job.done) {
		pr_warn("no answer within %ld ms: the caches stay", timeout_ms);
		return -1;
	}
	return 0;
}
