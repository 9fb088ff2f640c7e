/* Bookkeeping of what the program holds on the GPU: live allocations (a hash table by device
 * address) and the contexts the gate synchronizes. One mutex; never held across a driver call.
 */
#define LOG_PREFIX "track: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <pthread.h>
#include <stdlib.h>

#define NBUCKETS 4096 /* a power of two */
#define MAX_CONTEXTS 64

static struct {
	pthread_mutex_t lock;
	struct alloc *bucket[NBUCKETS];
	long count;
	unsigned long long bytes;
	CUcontext ctx[MAX_CONTEXTS];
	CUdevice ctx_dev[MAX_CONTEXTS];
	int nctx;
} tr = { .lock = PTHREAD_MUTEX_INITIALIZER };

static struct alloc **slot(CUdeviceptr ptr)
{
	unsigned long long h = (ptr >> 9) * 0x9e3779b97f4a7c15ULL;

	return &tr.bucket[(h >> 32) & (NBUCKETS - 1)];
}

/* Under tr.lock: unlinks and returns the entry of ptr, or NULL. */
static struct alloc *unlink_locked(CUdeviceptr ptr)
{
	struct alloc **pp, *a;

	for (pp = slot(ptr); (a = *pp); pp = &a->next)
		if (a->ptr == ptr) {
			*pp = a->next;
			tr.count--;
			tr.bytes -= a->size;
			return a;
		}
	return NULL;
}

/* Adds a (owned by the table from now on). An entry already at that address is stale (the
 * driver reused an address whose free we did not see, e.g. through cuCtxDestroy): replaced. */
static void put(struct alloc *a)
{
	struct alloc *stale;

	pthread_mutex_lock(&tr.lock);
	stale = unlink_locked(a->ptr);
	a->next = *slot(a->ptr);
	*slot(a->ptr) = a;
	tr.count++;
	tr.bytes += a->size;
	pthread_mutex_unlock(&tr.lock);
	if (stale) {
		pr_debug("0x%llx: stale entry of %zu bytes replaced", stale->ptr, stale->size);
		free(stale);
	}
}

static void add(CUdeviceptr ptr, size_t size, enum alloc_kind kind, size_t pitch, size_t width,
		size_t height, unsigned int elem)
{
	struct alloc *a = calloc(1, sizeof(*a));

	if (!a) {
		pr_err("out of memory: allocation 0x%llx (%zu bytes) not tracked", ptr, size);
		return;
	}
	a->ptr = ptr;
	a->size = size;
	a->kind = kind;
	a->pitch = pitch;
	a->width = width;
	a->height = height;
	a->elem = elem;
	put(a);
	pr_debug("+0x%llx %zu bytes", ptr, size);
}

void track_add_vmm(CUdeviceptr ptr, size_t size)
{
	add(ptr, size, ALLOC_VMM, 0, 0, 0, 0);
}

CUcontext track_context_of(CUdevice dev)
{
	CUcontext ctx = NULL;

	pthread_mutex_lock(&tr.lock);
	for (int i = 0; i < tr.nctx && !ctx; i++)
		if (tr.ctx_dev[i] == dev)
			ctx = tr.ctx[i];
	pthread_mutex_unlock(&tr.lock);
	return ctx;
}

/* Large allocations come from the VMM API (vmm.c), so that their memory can be released and
 * re-created at the same address. */
void mem_alloc_pre(struct track *t, CUdeviceptr *dptr, size_t bytesize)
{
	if (vmm_alloc(dptr, bytesize, &t->rc))
		t->handled = 1;
}

void mem_alloc_post(struct track *t, CUresult rc, CUdeviceptr *dptr, size_t bytesize)
{
	(void)t;
	if (rc == CUDA_SUCCESS && dptr)
		add(*dptr, bytesize, ALLOC_LINEAR, 0, 0, 0, 0);
}

void mem_alloc_pitch_post(struct track *t, CUresult rc, CUdeviceptr *dptr, size_t *pPitch,
			  size_t width, size_t height, unsigned int elem)
{
	(void)t;
	if (rc == CUDA_SUCCESS && dptr && pPitch)
		add(*dptr, *pPitch * height, ALLOC_PITCH, *pPitch, width, height, elem);
}

/* The entry leaves the table *before* the real free: once the driver has freed the address,
 * another thread's cuMemAlloc may get it back and add it, and removing after the free could
 * remove that new entry. A failed free puts the entry back. */
void mem_free_pre(struct track *t, CUdeviceptr dptr)
{
	pthread_mutex_lock(&tr.lock);
	t->taken = dptr ? unlink_locked(dptr) : NULL;
	pthread_mutex_unlock(&tr.lock);
	if (t->taken && t->taken->kind == ALLOC_VMM) {
		if (!vmm_free(dptr, &t->rc))
			t->rc = CUDA_ERROR_INVALID_VALUE; /* cannot happen: ours, or not in the table */
		t->handled = 1;
		if (t->rc == CUDA_SUCCESS)
			free(t->taken);
		else
			put(t->taken);
		t->taken = NULL;
	}
}

void mem_free_post(struct track *t, CUresult rc, CUdeviceptr dptr)
{
	if (!t->taken)
		return;
	if (rc != CUDA_SUCCESS) {
		put(t->taken);
		return;
	}
	pr_debug("-0x%llx %zu bytes", dptr, t->taken->size);
	free(t->taken);
}

static void ctx_add(CUcontext ctx, CUdevice dev)
{
	int i;

	pthread_mutex_lock(&tr.lock);
	for (i = 0; i < tr.nctx && tr.ctx[i] != ctx; i++)
		;
	if (i == tr.nctx && tr.nctx < MAX_CONTEXTS) {
		tr.ctx_dev[tr.nctx] = dev;
		tr.ctx[tr.nctx++] = ctx;
	}
	else if (i == tr.nctx)
		pr_warn("more than %d contexts: %p is not synchronized by the gate", MAX_CONTEXTS,
			(void *)ctx);
	pthread_mutex_unlock(&tr.lock);
}

void ctx_create_post(struct track *t, CUresult rc, CUcontext *pctx, unsigned int flags,
		     CUdevice dev)
{
	(void)t;
	(void)flags;
	(void)dev;
	if (rc == CUDA_SUCCESS && pctx && *pctx)
		ctx_add(*pctx, dev);
}

void ctx_retain_post(struct track *t, CUresult rc, CUcontext *pctx, CUdevice dev)
{
	(void)t;
	if (rc == CUDA_SUCCESS && pctx && *pctx)
		ctx_add(*pctx, dev);
}

void track_forget_context(CUcontext ctx)
{
	pthread_mutex_lock(&tr.lock);
	for (int i = 0; i < tr.nctx; i++)
		if (tr.ctx[i] == ctx) {
			tr.ctx_dev[i] = tr.ctx_dev[tr.nctx - 1];
			tr.ctx[i] = tr.ctx[--tr.nctx];
			break;
		}
	pthread_mutex_unlock(&tr.lock);
}

void ctx_destroy_post(struct track *t, CUresult rc, CUcontext ctx)
{
	(void)t;
	if (rc == CUDA_SUCCESS)
		track_forget_context(ctx);
}

void proc_address_post(struct track *t, CUresult rc, const char *symbol, void **pfn,
		       int cudaVersion, cuuint64_t flags)
{
	void *was;

	(void)t;
	if (rc != CUDA_SUCCESS || !pfn || !*pfn)
		return;
	was = *pfn;
	*pfn = hook_map_proc(was);
	pr_debug("cuGetProcAddress(%s, %d, %llu): %p%s", symbol ? symbol : "(null)", cudaVersion,
		 (unsigned long long)flags, *pfn, *pfn != was ? " (wrapper)" : "");
}

void proc_address_v2_post(struct track *t, CUresult rc, const char *symbol, void **pfn,
			  int cudaVersion, cuuint64_t flags,
			  CUdriverProcAddressQueryResult *symbolStatus)
{
	(void)symbolStatus;
	proc_address_post(t, rc, symbol, pfn, cudaVersion, flags);
}

void track_status(struct track_status *st)
{
	pthread_mutex_lock(&tr.lock);
	st->allocations = tr.count;
	st->bytes = tr.bytes;
	st->contexts = tr.nctx;
	pthread_mutex_unlock(&tr.lock);
}

int track_contexts(CUcontext *out, int max)
{
	int n;

	pthread_mutex_lock(&tr.lock);
	n = tr.nctx;
	for (int i = 0; i < n && i < max; i++)
		out[i] = tr.ctx[i];
	pthread_mutex_unlock(&tr.lock);
	return n;
}

/* A CUDA context does not survive fork(): the child starts with an empty table. The entries
 * are leaked (another thread may have been walking them). */
void track_after_fork(void)
{
	pthread_mutex_init(&tr.lock, NULL);
	memset(tr.bucket, 0, sizeof(tr.bucket));
	tr.count = 0;
	tr.bytes = 0;
	tr.nctx = 0;
}
