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
 * The prepare deadline (gate_close's reopen_ms) is kept here and enforced by everyone who
 * waits on the gate: a waiting call wakes at least once a second and reopens the gate itself
 * once the deadline has passed, and so does the control thread (gate_tick) between commands.
 * It must not depend on the control thread alone: that thread can be stuck (in the
 * cuCtxSynchronize of a context whose work never finishes), and then nothing else would ever
 * reopen the gate and the program would stay frozen.
 *
 * Time towards the deadline is counted in steps of at most STEP_MAX_MS (elapsed += min(now -
 * last, STEP_MAX_MS)): CLOCK_MONOTONIC jumps across a CRIU restore (another host, a reboot),
 * and a capped step makes such a jump count as one second instead of firing the deadline at
 * once or putting it off by the difference in uptime. The price: time passes only while
 * somebody looks (the control thread, once a second, or a waiting call).
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
	/* The prepare deadline, under lock: armed while reopen_ms > 0 (see above). */
	long long reopen_ms, elapsed_ms, last_ms;
	unsigned long generation; /* under lock: +1 at every open */
} gate = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.opened = PTHREAD_COND_INITIALIZER,
	/* .idle is set to CLOCK_MONOTONIC by gate_init() before its first wait */
	.idle = PTHREAD_COND_INITIALIZER,
};

#define STEP_MAX_MS 1000

static __thread int depth; /* > 0: inside a wrapper, or the agent's own thread */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void gate_init(void)
{
	pthread_condattr_t attr;

	/* No thread waits on either yet: only a closed gate is waited on, and this runs before
	 * the first close (of this process: gate_after_fork resets init_once). */
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_destroy(&gate.idle);
	pthread_cond_init(&gate.idle, &attr);
	pthread_cond_destroy(&gate.opened);
	pthread_cond_init(&gate.opened, &attr);
	pthread_condattr_destroy(&attr);
}

static void open_locked(void)
{
	atomic_store(&gate.closed, 0);
	gate.reopen_ms = 0;
	gate.generation++;
	pthread_cond_broadcast(&gate.opened);
}

/* Under lock: counts the time since the last look (one capped step, see above) and reopens
 * the gate when the prepare deadline has passed. */
static void deadline_check_locked(void)
{
	long long now = now_ms(), step = now - gate.last_ms;

	if (!atomic_load(&gate.closed) || gate.reopen_ms <= 0)
		return;
	gate.elapsed_ms += step < 0 ? 0 : step > STEP_MAX_MS ? STEP_MAX_MS : step;
	gate.last_ms = now;
	if (gate.elapsed_ms < gate.reopen_ms)
		return;
	pr_warn("gate closed for %lld ms without an open: reopening (%ld calls were waiting)",
		gate.elapsed_ms, gate.waiting);
	open_locked();
}

/* ms from now on CLOCK_MONOTONIC */
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
		/* pthread_cond_(timed)wait is a cancellation point: a thread cancelled there
		 * would unwind with gate.lock held (no cleanup handler can run the program's
		 * unwinding safely here) and every later driver call would block for good.
		 * Not cancellable while waiting; a pending cancel acts at its next point. */
		int cancel_state;

		pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel_state);
		pthread_mutex_lock(&gate.lock);
		gate.waiting++;
		while (atomic_load(&gate.closed)) {
			struct timespec ts;
			long wait = STEP_MAX_MS;

			if (gate.reopen_ms > 0 && gate.reopen_ms - gate.elapsed_ms < wait)
				wait = gate.reopen_ms - gate.elapsed_ms + 1;
			deadline_in(&ts, wait < 1 ? 1 : wait);
			pthread_cond_timedwait(&gate.opened, &gate.lock, &ts);
			deadline_check_locked();
		}
		gate.waiting--;
		pthread_mutex_unlock(&gate.lock);
		pthread_setcancelstate(cancel_state, NULL);
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
			if (rc == CUDA_ERROR_CONTEXT_IS_DESTROYED || rc == CUDA_ERROR_INVALID_CONTEXT) {
				/* released or reset past our hooks (cudaDeviceReset, a primary
				 * context's last release): nothing left to synchronize */
				pr_info("context %p is gone (CUresult %d): forgotten", (void *)ctx[i],
					rc);
				track_forget_context(ctx[i]);
				continue;
			}
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
int gate_close(long timeout_ms, long long reopen_ms)
{
	long long t0 = now_ms();
	struct timespec deadline;
	unsigned long generation;
	int ret = 0;

	pthread_once(&init_once, gate_init);
	deadline_in(&deadline, timeout_ms);
	pthread_mutex_lock(&gate.lock);
	atomic_store(&gate.closed, 1);
	/* Armed now, not once closed: the waiters enforce it even while this thread is stuck
	 * below (a second close re-arms it). */
	gate.reopen_ms = reopen_ms;
	gate.elapsed_ms = 0;
	gate.last_ms = t0;
	generation = gate.generation;
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
	pthread_mutex_lock(&gate.lock);
	if (gate.generation != generation)
		ret = -ETIMEDOUT; /* the deadline reopened it while we synchronized */
	pthread_mutex_unlock(&gate.lock);
	if (ret) {
		pr_warn("the gate was reopened by the prepare deadline during the close");
		return ret;
	}
	pr_info("closed in %lld ms", now_ms() - t0);
	return 0;
}

int gate_hold(void)
{
	int ret = 0;

	pthread_mutex_lock(&gate.lock);
	if (atomic_load(&gate.closed))
		gate.reopen_ms = 0;
	else
		ret = -ETIMEDOUT;
	pthread_mutex_unlock(&gate.lock);
	return ret;
}

void gate_open(void)
{
	pthread_mutex_lock(&gate.lock);
	if (atomic_load(&gate.closed))
		pr_info("open (%ld calls were waiting)", gate.waiting);
	open_locked();
	pthread_mutex_unlock(&gate.lock);
}

long gate_tick(void)
{
	long left = -1;

	pthread_mutex_lock(&gate.lock);
	deadline_check_locked();
	if (atomic_load(&gate.closed) && gate.reopen_ms > 0) {
		left = gate.reopen_ms - gate.elapsed_ms;
		left = left > STEP_MAX_MS ? STEP_MAX_MS : left < 1 ? 1 : left;
	}
	pthread_mutex_unlock(&gate.lock);
	return left;
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
	gate.reopen_ms = 0;
}
