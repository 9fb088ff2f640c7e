/* The stream: the image store's ring (agent/PROTOCOL.md, "Streaming").
 *
 * A save into the store, or a load out of it, goes through a ring of FILE_ALIGN slots in
 * memory torpor shares (a memfd) and one SOCK_SEQPACKET socket. Saving, a worker takes a free
 * slot (torpor sends its number), copies a part into it from its staging buffer and sends a
 * record; torpor stores the part as a chunk and sends the slot back. Loading, torpor fills
 * slots from the store and sends their records; a worker copies the part into its staging
 * buffer, sends the slot back and copies the part to the GPU. Nothing but the ring holds the
 * data on the host, so the data files stay holes. The socket, not a pipe: a torpor that went
 * away is EOF or EPIPE (MSG_NOSIGNAL), never a SIGPIPE in the program.
 *
 * The mover's workers (mover_workers.c) call part_stream and load_stream_main; the plan they
 * move is mover.c's (mover.h).
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <poll.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mover.h"

struct stream_rec {
	uint32_t slot, file;
	uint64_t offset, length, store_len;
};

#define STREAM_END 0xFFFFFFFFu /* a record: no more parts (save); a slot number: commit */
#define STREAM_ZERO 0xFFFFFFFEu /* a record's slot in a load: the part is zeros, no slot holds it */
#define STREAM_MAX_SLOTS 4096

static struct {
	int sock;              /* -1: no stream */
	unsigned char *ring;
	size_t nslots;
	long long timeout_ms;  /* waiting for torpor */
} stream = { -1, NULL, 0, 600000 };

int stream_open(int ring_fd, int sock_fd, char *err, size_t errsize)
{
	struct stat st;
	int type = 0;
	socklen_t len = sizeof(type);
	void *p;

	if (fstat(ring_fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
	    st.st_size % FILE_ALIGN || st.st_size / FILE_ALIGN > STREAM_MAX_SLOTS) {
		snprintf(err, errsize, "the stream's ring is not a file of 1 to %d slots of %lu "
			 "bytes", STREAM_MAX_SLOTS, FILE_ALIGN);
		return -1;
	}
	if (getsockopt(sock_fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0 || type != SOCK_SEQPACKET) {
		snprintf(err, errsize, "the stream's socket is not a SOCK_SEQPACKET socket");
		return -1;
	}
	p = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
	if (p == MAP_FAILED) {
		snprintf(err, errsize, "mapping the stream's ring: %s", strerror(errno));
		return -1;
	}
	madvise(p, st.st_size, MADV_DONTFORK);
	stream.ring = p;
	stream.nslots = st.st_size / FILE_ALIGN;
	stream.sock = sock_fd;
	return 0;
}

void stream_close(void)
{
	if (stream.ring)
		munmap(stream.ring, stream.nslots * FILE_ALIGN);
	stream.ring = NULL;
	stream.nslots = 0;
	stream.sock = -1; /* the fd is the command's: control.c closes it */
}

int stream_active(void)
{
	return stream.sock >= 0;
}

void mover_stream_timeout(long long ms)
{
	stream.timeout_ms = ms > 0 ? ms : 1;
}
/* One message from torpor into buf (exactly size bytes): 1, 0 at EOF (torpor is done, or
 * gone), -1 with err, -2 when a mover thread failed (it says why). Several threads may wait
 * on the socket: whoever reads a message has it, the others wait on. Gives up after the
 * timeout. */
static int stream_recv(void *buf, size_t size, char *err, size_t errsize)
{
	long long deadline = now_ms() + stream.timeout_ms;

	for (;;) {
		struct pollfd pfd = { stream.sock, POLLIN, 0 };
		ssize_t n;

		if (failed)
			return -2; /* that thread says why */
		if (now_ms() > deadline) {
			snprintf(err, errsize, "torpor's image store sent nothing for %lld s",
				 stream.timeout_ms / 1000);
			return -1;
		}
		if (poll(&pfd, 1, 200) < 0 && errno != EINTR) {
			snprintf(err, errsize, "waiting for the image store: %s", strerror(errno));
			return -1;
		}
		n = recv(stream.sock, buf, size, MSG_DONTWAIT | MSG_TRUNC);
		if (n == (ssize_t)size)
			return 1;
		if (n == 0)
			return 0;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
			continue;
		snprintf(err, errsize, "the image store's stream: %s",
			 n < 0 ? strerror(errno) : "a message of the wrong size");
		return -1;
	}
}

static int stream_send(const void *buf, size_t size, char *err, size_t errsize)
{
	for (;;) {
		ssize_t n = send(stream.sock, buf, size, MSG_NOSIGNAL);

		if (n == (ssize_t)size)
			return 0;
		if (n < 0 && errno == EINTR)
			continue;
		snprintf(err, errsize, "the image store's stream: %s",
			 n < 0 ? (errno == EPIPE || errno == ECONNRESET ? "torpor went away"
								   : strerror(errno))
			       : "short send");
		return -1;
	}
}

/* The chunk and part a streamed record names, or NULL: chunks of file f are f, f + nfiles,
 * ... at rising offsets. */
static struct chunk *chunk_of(const struct stream_rec *rec, int *q)
{
	size_t lo = 0, hi;

	if (rec->file >= (uint32_t)plan.nfiles || rec->offset % FILE_ALIGN)
		return NULL;
	hi = (plan.nchunks + plan.nfiles - 1 - rec->file) / plan.nfiles; /* the file's chunks */
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		struct chunk *c = &plan.chunks[rec->file + mid * plan.nfiles];

		if (rec->offset < c->file_off) {
			hi = mid;
		} else if (rec->offset >= c->file_off + c->len) {
			lo = mid + 1;
		} else {
			/* the store chunk whole (the part, then its hole), or the part alone */
			*q = (int)((rec->offset - c->file_off) / FILE_ALIGN);
			return rec->length >= part_len(c, *q) && rec->length <= rec->store_len &&
				       rec->store_len == part_store_len(c, *q) ? c : NULL;
		}
	}
	return NULL;
}

/* One part of chunk c from buf into a slot of the stream's ring, summed on the way, and its
 * record to torpor (a save into the image store). */
int part_stream(struct worker *w, const struct chunk *c, const unsigned char *buf, int q,
		       uint64_t *sum)
{
	size_t first = (size_t)q * FILE_ALIGN, last = first + part_len(c, q);
	struct stream_rec rec = { 0, (uint32_t)c->file, c->file_off + first, last - first,
				  part_store_len(c, q) };
	unsigned char *slot;
	uint32_t free_slot;
	struct sum s;
	char err[160];
	int rc = stream_recv(&free_slot, sizeof(free_slot), err, sizeof(err));

	if (rc == -2)
		return -1;
	if (rc <= 0 || free_slot >= stream.nslots) {
		fail(w, "%s", rc < 0 ? err : rc == 0 ? "the image store stopped taking GPU data"
						       : "the image store sent a bad slot");
		return -1;
	}
	rec.slot = free_slot;
	slot = stream.ring + (size_t)free_slot * FILE_ALIGN;
	sum_init(&s);
	for (size_t block = first; block < last; block += SUB) {
		size_t n = last - block < SUB ? last - block : SUB;

		sum_add(&s, buf + block, n);
		memcpy(slot + (block - first), buf + block, n); /* the block is still in cache */
	}
	*sum = sum_end(&s);
	if (stream_send(&rec, sizeof(rec), err, sizeof(err))) {
		fail(w, "%s", err);
		return -1;
	}
	return 0;
}

/* A streamed load: parts come from torpor in any order, each into the half of the staging
 * buffer the GPU is done with, checked, its slot sent back, then its segments copied to the
 * GPU. A part the store holds as zeros comes as a record alone (slot STREAM_ZERO): nothing
 * to do for a zero part (zeros_fill made it, and torpor need not send it at all), zeros
 * through the staging buffer for any other. Ends at EOF (torpor sent every part). */
void *load_stream_main(struct worker *w)
{
	CUstream used[2] = { NULL, NULL }, s[MAX_BUFFERS];
	int cur = 0;
	char err[160];

	for (;;) {
		struct stream_rec rec;
		struct chunk *c;
		struct part *pt;
		unsigned char *slot, *at;
		struct sum sum;
		size_t len;
		int q = 0, rc = stream_recv(&rec, sizeof(rec), err, sizeof(err));

		if (rc <= 0) {
			if (rc == -1)
				fail(w, "%s", err);
			break;
		}
		c = rec.slot < stream.nslots || rec.slot == STREAM_ZERO ? chunk_of(&rec, &q) : NULL;
		if (!c) {
			fail(w, "the image store sent a part that is not this program's (file %u, "
			     "offset %llu, %llu bytes, slot %u)", rec.file,
			     (unsigned long long)rec.offset, (unsigned long long)rec.length, rec.slot);
			break;
		}
		pt = &c->part[q];
		if (__atomic_exchange_n(&pt->received, 1, __ATOMIC_RELAXED)) {
			fail(w, "the image store sent the part at file %u offset %llu twice", rec.file,
			     (unsigned long long)rec.offset);
			break;
		}
		if (pt->zero) { /* zeros_fill made it: only its record is due */
			if (rec.slot != STREAM_ZERO) {
				fail(w, "the image store sent data for the part at file %u offset %llu, "
				     "which was saved as zeros", rec.file, (unsigned long long)rec.offset);
				break;
			}
			continue;
		}
		if (use_device(w, c->dev, s) || (used[cur] && wait_stream(w, used[cur])))
			break;
		slot = rec.slot == STREAM_ZERO ? NULL : stream.ring + (size_t)rec.slot * FILE_ALIGN;
		at = w->buf[cur] + (size_t)q * FILE_ALIGN; /* the part where it is in its chunk */
		len = part_len(c, q);
		sum_init(&sum);
		for (size_t block = 0; block < len; block += SUB) {
			size_t n = len - block < SUB ? len - block : SUB;

			/* zeros the store holds as nothing, for a part the GPU did not find zero
			 * (its save could not look): checked against its sum like any other */
			slot ? memcpy(at + block, slot + block, n) : memset(at + block, 0, n);
			sum_add(&sum, at + block, n);
		}
		if (slot && stream_send(&rec.slot, sizeof(rec.slot), err, sizeof(err))) {
			fail(w, "%s", err);
			break;
		}
		/* skipped parts have no sum: their fingerprints are checked after the load */
		if (!pt->skip && part_summed(pt) && sum_end(&sum) != pt->sum) {
			fail(w, "the part at file %u offset %llu (%zu bytes) from the image store does "
			     "not match its checksum", rec.file, (unsigned long long)rec.offset, len);
			break;
		}
		for (size_t k = 0; k < pt->nseg; k++) {
			const struct seg *g = &plan.segs[pt->seg + k];

			if (copy_range(w, w->buf[cur] + g->at, g->ptr, g->len, s[cur], 0))
				return NULL;
		}
		used[cur] = s[cur];
		w->bytes += len;
		cur ^= 1;
	}
	return NULL;
}

/* The end of a streamed save: torpor is told every part is out, and answers once it has
 * made them durable in the store (it sends STREAM_END; the slots it frees meanwhile are
 * ignored). Until then nothing may be released. */
int stream_commit(struct move_result *r)
{
	struct stream_rec end = { STREAM_END, 0, 0, 0, 0 };
	char err[160] = "a mover thread failed";

	if (stream_send(&end, sizeof(end), err, sizeof(err))) {
		snprintf(r->error, sizeof(r->error), "%s", err);
		return -1;
	}
	for (;;) {
		uint32_t v;
		int rc = stream_recv(&v, sizeof(v), err, sizeof(err));

		if (rc == 1 && v == STREAM_END)
			return 0;
		if (rc == 1 && v < stream.nslots)
			continue;
		snprintf(r->error, sizeof(r->error), "the image store did not take the GPU data: %s",
			 rc == 1 ? "a bad answer" : rc == 0 ? "torpor closed the stream" : err);
		return -1;
	}
}

/* Every part of every chunk came (a streamed load)? 0, or -1 with r->error. */
int stream_complete(struct move_result *r)
{
	size_t missing = 0;

	for (size_t j = 0; j < plan.nchunks; j++)
		for (int q = 0; q < PARTS; q++)
			missing += part_len(&plan.chunks[j], q) && !plan.chunks[j].part[q].received &&
				   !plan.chunks[j].part[q].zero;
	if (missing)
		snprintf(r->error, sizeof(r->error), "the image store's stream ended %zu part(s) "
			 "short", missing);
	return missing ? -1 : 0;
}
