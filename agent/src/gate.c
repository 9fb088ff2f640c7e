/* The gate every wrapper passes: while it is closed, new driver calls wait (on a condition
 * variable), and the closer waits until the calls in flight have left.
 *
 * The open path takes no lock: a caller counts itself in flight, then looks at `closed`; the
 * closer sets `closed`, then looks at the count. Both sequentially consistent, so at least one
 * of them sees the other: either the caller sees the gate closed (and steps back out to wait),
 * or the closer sees it in flight (and waits for it to leave). The last caller to leave a
 * closing gate takes the lock before waking the closer, which checks the count under that
 * lock: no wakeup is lost.
 *
 * A thread-local depth keeps nested calls (a driver calling its own exports, a wrapper's
 * bookkeeping) and the agent's own thread out of the gate and out of the bookkeeping.
 */
#define LOG_PREFIX "gate: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

static struct {
	pthread_mutex_t lock;
	pthread_cond_t opened; /* the gate opened: waiting callers go on */
	pthread_cond_t idle;   /* the last call in flight left a closing gate */
	atomic_int closed;
	atomic_long in_flight;
	long waiting;          /* under lock */
} gate = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.opened = PTHREAD_COND_INITIALIZER,
	/* .idle is set to CLOCK_MONOTONIC by gate_init() before its first wait */
	.idle = PTHREAD_COND_INITIALIZER,
};

static __thread int depth; /* > 0: inside a wrapper, or the agent's own thread */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void gate_init(void)
{
	pthread_condattr_t attr;

	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_destroy(&gate.idle);
	pthread_cond_init(&gate.idle, &attr);
	pthread_condattr_destroy(&attr);
}

static void leave(void)
{
	if (atomic_fetch_sub(&gate.in_flight, 1) == 1 && atomic_load(&gate.closed)) {
		pthread_mutex_lock(&gate.lock);
		pthread_cond_broadcast(&gate.idle);
		pthread_mutex_unlock(&gate.lock);
	}
}

int gate_enter(void)
{
	if (depth++ > 0)
		return 0;
	agent_start();
	for (;;) {
		atomic_fetch_add(&gate.in_flight, 1);
		if (!atomic_load(&gate.closed))
			return 1;
		leave();
		pthread_mutex_lock(&gate.lock);
		gate.waiting++;
		while (atomic_load(&gate.closed))
			pthread_cond_wait(&gate.opened, &gate.lock);
		gate.waiting--;
		pthread_mutex_unlock(&gate.lock);
	}
}

void gate_exit(int gated)
{
	if (gated)
		leave();
	depth--;
}

void gate_agent_thread(void)
{
	depth = 1;
}

static void deadline_in(struct timespec *ts, long ms)
{
	clock_gettime(CLOCK_MONOTONIC, ts);
	ts->tv_sec += ms / 1000;
	ts->tv_nsec += (ms % 1000) * 1000000L;
	if (ts->tv_nsec >= 1000000000L) {
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
}

/* Synchronizes every context the program made (or retained), each made current on this thread
 * for the call. Returns 0 or -EIO. */
static int sync_contexts(void)
{
	CUcontext ctx[64], popped;
	int n = track_contexts(ctx, 64), ret = 0;
	CUresult rc;

	if (n > 64) {
		pr_warn("%d contexts: synchronizing the first 64 only", n);
		n = 64;
	}
	if (!real.cuCtxSynchronize) {
		pr_warn("the driver has no cuCtxSynchronize: contexts not synchronized");
		return n ? -EIO : 0;
	}
	for (int i = 0; i < n; i++) {
		if (real.cuCtxPushCurrent_v2 && real.cuCtxPopCurrent_v2) {
			rc = real.cuCtxPushCurrent_v2(ctx[i]);
			if (rc != CUDA_SUCCESS) {
				pr_warn("cuCtxPushCurrent(%p): CUresult %d", (void *)ctx[i], rc);
				ret = -EIO;
				continue;
			}
		}
		rc = real.cuCtxSynchronize();
		if (rc != CUDA_SUCCESS) {
			pr_warn("cuCtxSynchronize(%p): CUresult %d", (void *)ctx[i], rc);
			ret = -EIO;
		} else {
			pr_debug("context %p synchronized", (void *)ctx[i]);
		}
		if (real.cuCtxPushCurrent_v2 && real.cuCtxPopCurrent_v2)
			real.cuCtxPopCurrent_v2(&popped);
	}
	return ret;
}

/* Only the agent's thread calls this (a caller in flight would wait for itself). */
int gate_close(long timeout_ms)
{
	long long t0 = now_ms();
	struct timespec deadline;
	int ret = 0;

	pthread_once(&init_once, gate_init);
	deadline_in(&deadline, timeout_ms);
	pthread_mutex_lock(&gate.lock);
	atomic_store(&gate.closed, 1);
	while (atomic_load(&gate.in_flight) > 0) {
		if (pthread_cond_timedwait(&gate.idle, &gate.lock, &deadline) == ETIMEDOUT &&
		    atomic_load(&gate.in_flight) > 0) {
			ret = -ETIMEDOUT;
			break;
		}
	}
	pthread_mutex_unlock(&gate.lock);
	if (ret) {
		pr_warn("%ld calls still in flight after %ld ms: gate open again",
			atomic_load(&gate.in_flight), timeout_ms);
		gate_open();
		return ret;
	}
	/* No call in flight and none can start: whatever the program queued is on the GPU. */
	ret = sync_contexts();
	if (ret) {
		gate_open();
		return ret;
	}
	pr_info("closed in %lld ms", now_ms() - t0);
	return 0;
}

void gate_open(void)
{
	pthread_mutex_lock(&gate.lock);
	if (atomic_load(&gate.closed))
		pr_info("open (%ld calls were waiting)", gate.waiting);
	atomic_store(&gate.closed, 0);
	pthread_cond_broadcast(&gate.opened);
	pthread_mutex_unlock(&gate.lock);
}

void gate_status(struct gate_status *st)
{
	pthread_mutex_lock(&gate.lock);
	st->closed = atomic_load(&gate.closed);
	st->in_flight = atomic_load(&gate.in_flight);
	st->waiting = gate.waiting;
	pthread_mutex_unlock(&gate.lock);
}

/* In the child of fork() only the forking thread exists: nothing is in flight or waiting,
 * and a lock another thread held is not held any more. */
void gate_after_fork(void)
{
	pthread_mutexattr_t mattr;

	pthread_mutexattr_init(&mattr);
	pthread_mutex_init(&gate.lock, &mattr);
	pthread_mutexattr_destroy(&mattr);
	pthread_cond_init(&gate.opened, NULL);
	init_once = (pthread_once_t)PTHREAD_ONCE_INIT;
	pthread_cond_init(&gate.idle, NULL);
	atomic_store(&gate.closed, 0);
	atomic_store(&gate.in_flight, depth > 0 ? 1 : 0); /* fork() from inside a wrapper */
	gate.waiting = 0;
}
