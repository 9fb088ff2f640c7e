/* The control socket: $TORPOR_AGENT_DIR/agent-<pid>.sock (default dir /run/torpor/agents), a
 * Unix stream socket served by one thread of the agent's own. One command a line, one JSON
 * object a reply line:
 *
 *   status              {"pid","gate":"open"|"closed","in_flight","waiting","allocations",
 *                        "bytes","contexts",...,"holdable"} (agent/PROTOCOL.md)
 *   close [timeout_ms]  {"ok":true} once no call is in flight and every context is
 *                       synchronized; {"ok":false,"error":"timeout"} (gate open again) when calls
 *                       stay in flight past timeout_ms (default 10000)
 *   open                {"ok":true}
 *   anything else       {"ok":false,"error":"unknown command"}
 *
 * A gate closed by `close` and not opened within TORPOR_AGENT_PREPARE_TIMEOUT_S (default 600)
 * opens by itself: a prepare that its caller abandoned (killed mid-checkpoint) must not stop
 * the program for good.
 *
 * Started at the first driver call, not when the library is loaded: a program that never
 * calls the driver has no GPU state to move, and under the preload it must run exactly as
 * without it (no thread, no socket, no directory). That covers every shell, compiler and tool
 * a preloaded environment starts.
 *
 * Only root and the program's own user may connect (SO_PEERCRED at connect time); any other
 * peer is disconnected without a reply. The directory is made 0700 and the socket 0600 as a
 * first fence. Clients are served one command at a time; `close` holds the others while it
 * waits.
 */
#define LOG_PREFIX "control: "
#include "agent.h" /* first: _GNU_SOURCE */
#include "fdbag.h"

#include <ctype.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define DEFAULT_DIR "/run/torpor/agents"
#define DEFAULT_CLOSE_TIMEOUT_MS 10000
#define MAX_CLIENTS 16
#define LINE_MAX_LEN 256
/* fds a command may carry: 16 data files and prepare's fp pair and a stream's pair, or a
 * resume's 16 data files and HOLD_DIRECT held descriptors (more come in one bag: fdbag.h); a
 * message is received whole up to the kernel's own limit (SCM_MAX_FD, not exported to user
 * space), the rest closed */
#define MAX_FDS (16 + HOLD_DIRECT)
#define SCM_MAX_FD 253
#define REPLY_MAX 2560

struct client {
	int fd;
	size_t len;
	char buf[LINE_MAX_LEN];
	int fds[MAX_FDS]; /* received with the pending line (SCM_RIGHTS) */
	int nfds;
	int out_fds[HOLD_DIRECT]; /* sent with the reply (detach hold: or one bag), then closed */
	int nout;
};

/* Where the program's movable memory is: on the GPU (running), in the files given to prepare
 * and still held or in the agent's own memory (prepared), or in files the agent no longer
 * holds (detached: the CRIU dump is next; only a resume with the files brings the memory
 * back) or still in the agent's memory (detached after a prepare without files: only the
 * prepare deadline is off). */
enum state { RUNNING, PREPARED, DETACHED };
static const char *const STATE_NAMES[] = { "running", "prepared", "detached" };

static struct {
	pthread_mutex_t lock;     /* start */
	atomic_int started;       /* tried in this process (successfully or not) */
	int listen_fd;
	pid_t owner;              /* the process whose socket `path` is */
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	double prepare_timeout_s;
	long long last_emfile_log; /* accept4 EMFILE/ENFILE: logged at most every 10 s */
	struct client clients[MAX_CLIENTS];
	enum state state;
	int held[MAX_FDS], nheld;  /* the data files of the prepare, while prepared */
	int hold[HOLD_MAX], nhold; /* the descriptors holding the GPU memory (mover.c), while
				    * prepared: until detach gives them away or closes them */
	int bag[HOLD_MAX], nbag;   /* held descriptors a command brought in a bag (fdbag.h):
				    * closed after it, as its own fds, unless it keeps them */
	long long elapsed_ms, last_ms; /* since the prepare, counted in capped steps (gate.c) */
} ctl = { .lock = PTHREAD_MUTEX_INITIALIZER, .listen_fd = -1 };

/* mkdir -p: missing parents 0755, the directory itself 0700. */
static int make_dirs(const char *dir)
{
	char buf[PATH_MAX];
	size_t len = strlen(dir);

	if (len == 0 || len >= sizeof(buf))
		return -ENAMETOOLONG;
	memcpy(buf, dir, len + 1);
	/* "dir/" and "dir//": the last mkdir must be of dir itself (0700), not of "dir/" after
	 * the loop made dir 0755 */
	while (len > 1 && buf[len - 1] == '/')
		buf[--len] = 0;
	for (char *p = buf + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = 0;
		if (mkdir(buf, 0755) < 0 && errno != EEXIST)
			return -errno;
		*p = '/';
	}
	if (mkdir(buf, 0700) < 0 && errno != EEXIST)
		return -errno;
	return 0;
}

/* The directory must be the program's (or root's) and writable by no one else: anyone who can
 * write to it can replace the socket with their own and answer torpor in the program's name.
 * Resolved once to an absolute path (no trailing slash, no symlink left) and checked through
 * a descriptor opened with O_NOFOLLOW, so that what is checked is what the path names. */
static int check_dir(const char *dir, char *real, size_t size)
{
	char buf[PATH_MAX];
	struct stat st;
	int dfd, ret = 0;

	if (!realpath(dir, buf)) {
		ret = -errno;
		pr_perror("cannot resolve %s", dir);
		return ret;
	}
	if (strlen(buf) >= size)
		return -ENAMETOOLONG;
	strcpy(real, buf);
	dfd = open(real, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (dfd < 0 || fstat(dfd, &st) < 0) {
		ret = -errno;
		pr_perror("cannot open %s", real);
	} else if (st.st_uid != geteuid() && st.st_uid != 0) {
		pr_err("%s is owned by uid %u, neither root nor the program's: no control socket",
		       real, (unsigned)st.st_uid);
		ret = -EPERM;
	} else if (st.st_mode & (S_IWGRP | S_IWOTH)) {
		pr_err("%s is writable by group or others (mode %04o): no control socket", real,
		       (unsigned)(st.st_mode & 07777));
		ret = -EPERM;
	}
	if (dfd >= 0)
		close(dfd);
	return ret;
}

static int listen_at(const char *dir, char *path, size_t size)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	char real[PATH_MAX];
	int fd, ret;

	ret = make_dirs(dir);
	if (ret) {
		errno = -ret;
		pr_pwarn("cannot create %s", dir);
		return ret;
	}
	ret = check_dir(dir, real, sizeof(real));
	if (ret)
		return ret;
	dir = real;
	if ((size_t)snprintf(path, size, "%s/agent-%d.sock", dir, (int)getpid()) >= size ||
	    strlen(path) >= sizeof(addr.sun_path)) {
		pr_warn("socket path under %s too long", dir);
		return -ENAMETOOLONG;
	}
	memcpy(addr.sun_path, path, strlen(path) + 1);

	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		ret = -errno;
		pr_pwarn("socket");
		return ret;
	}
	/* 0600 from the start, with no chmod(path) afterwards (a path can be swapped for a
	 * symlink between bind and chmod): Linux's bind() gives the socket file the mode of the
	 * socket's inode less the umask, and fchmod() of an unbound socket sets that mode.
	 * (Changing the umask instead would race with the program's other threads.) */
	if (fchmod(fd, 0600) < 0)
		pr_pwarn("fchmod socket");
	/* A file left by a process of the same pid that died without cleaning up. */
	if (unlink(path) < 0 && errno != ENOENT)
		pr_pwarn("cannot remove %s", path);
	if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
		ret = -errno;
		pr_pwarn("bind %s", path);
		goto err_close;
	}
	if (listen(fd, MAX_CLIENTS) < 0) {
		ret = -errno;
		pr_pwarn("listen %s", path);
		goto err_unlink;
	}
	return fd;

err_unlink:
	unlink(path);
err_close:
	close(fd);
	return ret;
}

static void close_fds(int *fds, int *n)
{
	for (int i = 0; i < *n; i++)
		close(fds[i]);
	*n = 0;
}

static void drop(struct client *c)
{
	close(c->fd);
	c->fd = -1;
	c->len = 0;
	close_fds(c->fds, &c->nfds);
	close_fds(c->out_fds, &c->nout);
}

/* The uid the kernel shows for a uid this user namespace does not map. */
static uid_t overflow_uid(void)
{
	FILE *f = fopen("/proc/sys/kernel/overflowuid", "re");
	unsigned v = 65534;

	if (f) {
		if (fscanf(f, "%u", &v) != 1)
			v = 65534;
		fclose(f);
	}
	return (uid_t)v;
}

/* Root, the program's uid, and the host's root reaching a program in a user namespace (a
 * rootless or user-namespaced container): SO_PEERCRED shows that peer with the overflow uid
 * (host root is not mapped in there) and pid 0 (it lives outside the program's pid namespace).
 * That is safe to let in because the kernel already decided who may connect at all: the
 * socket is 0600, the program's, so only its own uid and root may; an unmapped uid other than
 * root would have been stopped by those permissions. */
static int peer_allowed(int fd)
{
	struct ucred cred;
	socklen_t len = sizeof(cred);

	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
		pr_pwarn("SO_PEERCRED");
		return 0;
	}
	if (cred.uid == 0 || cred.uid == getuid() || cred.uid == geteuid())
		return 1;
	if (cred.pid == 0 && cred.uid == overflow_uid()) {
		pr_debug("a peer from outside the program's user and pid namespaces (the host's "
			 "root): allowed by the socket's permissions");
		return 1;
	}
	pr_warn("refused pid %d: uid %u is neither root nor the program's", (int)cred.pid,
		(unsigned)cred.uid);
	return 0;
}

static void accept_one(void)
{
	/* Non-blocking: a reply that does not fit drops the client (reply()), it never blocks
	 * the one thread that serves everyone. */
	int fd = accept4(ctl.listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

	if (fd < 0) {
		if (errno == EMFILE || errno == ENFILE) {
			/* The connection stays queued and poll() says readable again at once: back
			 * off rather than spin, and say so once in a while only. */
			long long now = now_ms();

			if (!ctl.last_emfile_log || now - ctl.last_emfile_log >= 10000) {
				pr_pwarn("accept (backing off)");
				ctl.last_emfile_log = now;
			}
			poll(NULL, 0, 100);
		} else if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
			pr_pwarn("accept");
		}
		return;
	}
	if (!peer_allowed(fd)) {
		close(fd);
		return;
	}
	for (int i = 0; i < MAX_CLIENTS; i++)
		if (ctl.clients[i].fd < 0) {
			ctl.clients[i].fd = fd;
			ctl.clients[i].len = 0;
			return;
		}
	pr_warn("more than %d clients: one refused", MAX_CLIENTS);
	close(fd);
}

static ssize_t send_text(struct client *c, const char *text, size_t len)
{
	ssize_t n;

	do
		n = send(c->fd, text, len, MSG_DONTWAIT | MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	return n;
}

/* Detached after a deferred save, its held descriptors still the agent's (no `detach release`
 * yet, or given back by `hold N`): as prepared for an abort and the deadline. */
static int holds_deferred(void)
{
	return ctl.state == DETACHED && mover_deferred() && ctl.nhold > 0;
}

/* The reply with c->out_fds (SCM_RIGHTS, one sendmsg), which are closed after either way. */
static ssize_t send_with_fds(struct client *c, const char *text, size_t len)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * HOLD_DIRECT)];
		struct cmsghdr align;
	} u;
	struct iovec iov = { (void *)text, len };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			      .msg_controllen = CMSG_SPACE(sizeof(int) * c->nout) };
	struct cmsghdr *cm;
	ssize_t n;
	int err;

	memset(u.buf, 0, sizeof(u.buf));
	cm = CMSG_FIRSTHDR(&msg);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int) * c->nout);
	memcpy(CMSG_DATA(cm), c->out_fds, sizeof(int) * c->nout);
	do
		n = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	err = errno;
	if (n < 0)
		pr_pwarn("sending %d held descriptors", c->nout);
	close_fds(c->out_fds, &c->nout);
	errno = err;
	return n;
}


/* Never blocks: a client that does not read its replies (the socket buffer full) is dropped,
 * or it would stall the thread that serves everyone else. A reply carrying descriptors (detach
 * hold) that cannot be sent goes again without them, as a plain detach's: nothing is held
 * then (closed here), and a client still there learns so. */
static int reply(struct client *c, const char *text)
{
	size_t len = strlen(text);
	ssize_t n;

	if (c->nout && mover_deferred()) {
		/* duplicates (the agent keeps its own until `detach release`): not sent, closed,
		 * and the agent is prepared again (an abort takes the memory back) */
		n = send_with_fds(c, text, len);
		if (n < 0) {
			ctl.state = PREPARED;
			pr_warn("the held descriptors of a deferred save could not be sent: prepared "
				"again");
		}
	} else if (c->nout) {
		n = send_with_fds(c, text, len);
		if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
			text = "{\"ok\":true,\"held\":0}\n";
			len = strlen(text);
			n = send_text(c, text, len);
		}
	} else {
		n = send_text(c, text, len);
	}
	if (n == (ssize_t)len)
		return 0;
	pr_warn("a client does not read its replies: dropped");
	return -1;
}

static void status_reply(char *out, size_t size)
{
	struct gate_status g;
	struct track_status t;
	struct vmm_status v;
	int holdable;

	gate_status(&g);
	track_status(&t);
	vmm_status(&v);
	holdable = v.hold_asked && mover_gpu_checked() && v.whole > 0 && !v.unexportable;
	snprintf(out, size,
		 "{\"pid\":%d,\"state\":\"%s\",\"gate\":\"%s\",\"in_flight\":%ld,"
		 "\"waiting\":%ld,\"allocations\":%ld,\"bytes\":%llu,"
		 "\"movable_allocations\":%ld,\"movable_bytes\":%llu,\"moved_allocations\":%ld,"
		 "\"contexts\":%d,\"in_memory\":%s,\"host_bytes\":%llu,\"holdable\":%s,"
		 "\"holdable_bag\":%s,\"hold_max\":%d}\n",
		 (int)getpid(), STATE_NAMES[ctl.state], g.closed ? "closed" : "open", g.in_flight,
		 g.waiting, t.allocations, t.bytes, v.movable, v.movable_bytes, v.dropped,
		 t.contexts, mover_in_memory() ? "true" : "false", mover_host_bytes(),
		 /* what a leave-running prepare needs to hold (mover.c hold_export): parts checked
		  * by GPU fingerprints, every allocation it moves exportable, at most HOLD_DIRECT
		  * (a torpor before bags: it starts a copier only for those), or HOLD_MAX for a
		  * prepare that says `bag` */
		 holdable && v.whole <= HOLD_DIRECT ? "true" : "false",
		 holdable && v.whole <= HOLD_MAX ? "true" : "false", HOLD_MAX);
}

static int parse_timeout(const char *arg, long *timeout_ms)
{
	char *end;

	*timeout_ms = DEFAULT_CLOSE_TIMEOUT_MS;
	if (!*arg)
		return 0;
	*timeout_ms = strtol(arg, &end, 10);
	return end == arg || *end || *timeout_ms < 0 ? -1 : 0;
}

/* {"ok":false,"error":...} with more (",\"key\":value" pairs, or "") after the error */
static void error_reply_with(char *out, size_t size, const char *error, const char *more)
{
	char clean[300];
	size_t j = 0;

	/* one JSON string: no quotes, backslashes or control characters from error texts */
	for (size_t i = 0; error[i] && j < sizeof(clean) - 1; i++)
		clean[j++] = (error[i] == '"' || error[i] == '\\' || (unsigned char)error[i] < 0x20)
				     ? ' ' : error[i];
	clean[j] = 0;
	snprintf(out, size, "{\"ok\":false,\"error\":\"%s\"%s}\n", clean, more);
}

static void error_reply(char *out, size_t size, const char *error)
{
	error_reply_with(out, size, error, "");
}

/* Does arg (its first *alen characters) end in the word w? If so, *alen drops it and the
 * space before it. */
static int word_at_end(const char *arg, size_t *alen, const char *w)
{
	size_t n = strlen(w);

	if (*alen < n || strncmp(arg + *alen - n, w, n) || (*alen > n && arg[*alen - n - 1] != ' '))
		return 0;
	*alen = *alen > n ? *alen - n - 1 : 0;
	return 1;
}

static void prepare_reply(struct client *c, const char *arg, char *out, size_t size)
{
	struct track_status before, after;
	struct vmm_status vbefore, vafter;
	unsigned long long released;
	struct move_result r;
	long timeout_ms;
	int ret, n, ndata = c->nfds, known_fd = -1, index_fd = -1, ring_fd = -1, sock_fd = -1;
	int plan_fd = -1;
	unsigned long long host_budget = 0;
	size_t used, alen = strlen(arg);
	char targ[32];

	if (ctl.state != RUNNING) {
		error_reply(out, size, "already prepared: resume or abort first");
		return;
	}
	/* "prepare [timeout_ms] [host=N] [fp [stream] | defer] [bag]": with fp, the last two fds
	 * are the known fingerprints and the index to write; with stream, two more after them:
	 * the image store's ring and socket; with defer, the last fd is the plan file; bag: the
	 * client takes more than HOLD_DIRECT held descriptors in a bag (PROTOCOL.md) */
	mover_hold_max(word_at_end(arg, &alen, "bag") ? HOLD_MAX : HOLD_DIRECT);
	if (word_at_end(arg, &alen, "defer")) {
		struct stat st;

		if (c->nfds < 2 || fstat(c->fds[c->nfds - 1], &st) < 0 || !S_ISREG(st.st_mode)) {
			error_reply(out, size, "prepare ... defer takes the data files, then the plan "
				    "file (a regular file)");
			return;
		}
		ndata = c->nfds - 1;
		plan_fd = c->fds[ndata];
	} else if (word_at_end(arg, &alen, "stream")) {
		if (!word_at_end(arg, &alen, "fp") || c->nfds < 5) {
			error_reply(out, size, "prepare ... fp stream takes the data files, the known "
				    "fingerprints, the index file, the ring and the socket");
			return;
		}
		ndata = c->nfds - 4;
		ring_fd = c->fds[ndata + 2];
		sock_fd = c->fds[ndata + 3];
	} else if (word_at_end(arg, &alen, "fp")) {
		if (c->nfds < 3) {
			error_reply(out, size, "prepare ... fp takes the data files, then the known "
				    "fingerprints and the index file");
			return;
		}
		ndata = c->nfds - 2;
	}
	if (ndata != c->nfds && plan_fd < 0) {
		known_fd = c->fds[ndata];
		index_fd = c->fds[ndata + 1];
	}
	/* "host=N" (before fp): the host memory this save may take (PROTOCOL.md) */
	{
		size_t w = alen;
		char *end;

		while (w && arg[w - 1] != ' ')
			w--;
		if (alen - w >= 5 && !strncmp(arg + w, "host=", 5)) {
			errno = 0;
			host_budget = strtoull(arg + w + 5, &end, 10);
			if (errno || end != arg + alen || !host_budget || arg[w + 5] == '-') {
				error_reply(out, size, "bad host=: a number of bytes above 0");
				return;
			}
			alen = w ? w - 1 : 0;
		}
	}
	snprintf(targ, sizeof(targ), "%.*s", (int)(alen < sizeof(targ) - 1 ? alen : sizeof(targ) - 1),
		 arg);
	if (alen >= sizeof(targ) || parse_timeout(targ, &timeout_ms)) {
		error_reply(out, size, "bad timeout");
		return;
	}
	track_status(&before);
	vmm_status(&vbefore);
	caches_release(timeout_ms < 5000 ? timeout_ms : 5000);
	track_status(&after);
	vmm_status(&vafter);
	/* what the allocators gave back: cuMemFree'd allocations, and the program's own VMM
	 * handles released (PyTorch's expandable segments unmap and release) */
	released = (before.bytes > after.bytes ? before.bytes - after.bytes : 0ULL) +
		   (vbefore.program_bytes > vafter.program_bytes
			    ? vbefore.program_bytes - vafter.program_bytes : 0ULL);
	ret = gate_close(timeout_ms, (long long)(ctl.prepare_timeout_s * 1000));
	if (ret) {
		error_reply(out, size, ret == -ETIMEDOUT ? "timeout" : "synchronize failed");
		return;
	}
	if (gate_hold()) {
		error_reply(out, size, "timeout");
		return;
	}
	mover_stream_timeout((long long)(ctl.prepare_timeout_s * 1000));
	ret = mover_save(c->fds, ndata, known_fd, index_fd, ring_fd, sock_fd, plan_fd, host_budget,
			 &r);
	if (known_fd >= 0 || plan_fd >= 0) { /* torpor's, read and written: not kept */
		for (int k = ndata; k < c->nfds; k++)
			close(c->fds[k]);
		c->nfds = ndata;
	}
	if (ret) {
		struct move_result back;

		/* nothing released, or (releasing failed half-way) reloaded at once from the files,
		 * which are complete but for skipped parts (their fingerprints then fail the reload:
		 * torpor fills them from the store and resumes). A streamed save's files are holes:
		 * its data is in the image store, and only torpor's `resume stream` brings it back */
		if (mover_pending() &&
		    (r.streamed || mover_load(c->fds, c->nfds, -1, -1, NULL, 0, 0, &back))) {
			if (r.streamed)
				pr_err("%s; the data is in the image store: the gate stays closed until "
				       "a resume streams it back", r.error);
			else
				pr_err("%s; reloading failed too: %s; the gate stays closed", r.error,
				       back.error);
			ctl.state = PREPARED;
			memcpy(ctl.held, c->fds, sizeof(int) * c->nfds);
			ctl.nheld = c->nfds;
			c->nfds = 0;
			error_reply(out, size, r.error);
			return;
		}
		gate_open();
		error_reply(out, size, r.error);
		return;
	}
	memcpy(ctl.held, c->fds, sizeof(int) * c->nfds);
	ctl.nheld = c->nfds;
	c->nfds = 0;
	memcpy(ctl.hold, r.hold_fds, sizeof(int) * r.held);
	ctl.nhold = r.held;
	ctl.state = PREPARED;
	ctl.elapsed_ms = 0;
	ctl.last_ms = now_ms();
	n = snprintf(out, size,
		     "{\"ok\":true,\"bytes\":%llu,\"chunks\":%ld,\"allocations\":%ld,"
		     "\"cache_released\":%llu,\"seconds\":%.6f,\"in_memory\":%s,"
		     "\"host_alloc_seconds\":%.6f,\"phases\":{\"staging\":%.6f,\"copy\":%.6f,"
		     "\"release\":%.6f},\"fingerprints\":{\"parts\":%ld,\"skipped\":%ld,"
		     "\"skipped_bytes\":%llu,\"seconds\":%.6f,\"error\":\"%s\"},\"zero\":{\"parts\":%ld,"
		     "\"bytes\":%llu,\"error\":\"%s\"},\"streamed\":%s,\"held\":%d,"
		     "\"hold_seconds\":%.6f,\"hold_error\":\"%s\",\"deferred\":%s,"
		     "\"defer_error\":\"%s\",\"files\":[",
		     r.bytes, r.chunks, r.allocations, released, r.seconds,
		     r.in_memory ? "true" : "false", r.host_alloc_seconds, r.staging_seconds,
		     r.copy_seconds, r.vmm_seconds, r.fp_parts, r.fp_skipped, r.fp_skipped_bytes,
		     r.fp_seconds, r.fp_error, r.zero_parts, r.zero_bytes, r.zero_error,
		     r.streamed ? "true" : "false", r.held, r.hold_seconds, r.hold_error,
		     r.deferred ? "true" : "false", r.defer_error);
	used = n > 0 && (size_t)n < size ? (size_t)n : size - 1;
	for (int k = 0; k < r.nfiles && used < size; k++) {
		n = snprintf(out + used, size - used, "%s%llu", k ? "," : "", r.file_size[k]);
		if (n > 0)
			used += n;
	}
	if (used < size)
		snprintf(out + used, size - used, "]}\n");
}

/* Reloads from fds (the client's, else the held ones), or from the image store's stream
 * (ring_fd, sock_fd), taking the held memory back first when hold (the client's, else the
 * agent's own) names it; the gate opens on success. */
static int do_resume(int *fds, int nfds, int ring_fd, int sock_fd, const int *hold, int nhold,
		     int drained, char *out, size_t size)
{
	struct move_result r;
	int ret;

	mover_stream_timeout((long long)(ctl.prepare_timeout_s * 1000));
	ret = mover_load(fds, nfds, ring_fd, sock_fd, hold, nhold, drained, &r);
	/* the agent's own descriptors once they are of no more use: the memory is the
	 * program's again, or it was not taken back (a later try copies) and they would only
	 * keep the old memory on the GPU; after a deferred save they are all there is until
	 * the copier has run: kept for the next try */
	if (!ret || (nhold && !r.held_back && !mover_deferred()))
		close_fds(ctl.hold, &ctl.nhold);
	if (ret) {
		if (out)
			error_reply_with(out, size, r.error, r.damaged ? ",\"damaged\":true" : "");
		else
			pr_err("resume: %s", r.error);
		return -1;
	}
	close_fds(ctl.held, &ctl.nheld);
	ctl.state = RUNNING;
	gate_open();
	if (out)
		snprintf(out, size, "{\"ok\":true,\"bytes\":%llu,\"chunks\":%ld,\"seconds\":%.6f,"
			 "\"zero_bytes\":%llu,\"streamed\":%s,\"held\":%s,\"phases\":{"
			 "\"import\":%.6f,\"recreate\":%.6f,\"staging\":%.6f,\"copy\":%.6f}}\n",
			 r.bytes, r.chunks, r.seconds, r.zero_bytes, r.streamed ? "true" : "false",
			 r.held_back ? "true" : "false", r.import_seconds, r.vmm_seconds,
			 r.staging_seconds, r.copy_seconds);
	return 0;
}

/* The n held descriptors a command carries after its data files: its last n fds, or, past
 * HOLD_DIRECT, the one bag it carries last, unpacked into ctl.bag (closed after the command as
 * its fds are, unless it keeps them). *files: how many of its fds come first. 0, or -1 with
 * the error reply written (usage: what the command takes). */
static int held_given(struct client *c, int n, const char *usage, const int **hold, int *files,
		      char *out, size_t size)
{
	char why[200];

	if (n <= HOLD_DIRECT) {
		if (n > c->nfds) {
			error_reply(out, size, usage);
			return -1;
		}
		*hold = c->fds + c->nfds - n;
		*files = c->nfds - n;
		return 0;
	}
	if (c->nfds < 1) {
		error_reply(out, size, usage);
		return -1;
	}
	if (fdbag_unpack(c->fds[c->nfds - 1], ctl.bag, n, why, sizeof(why))) {
		error_reply(out, size, why);
		return -1;
	}
	ctl.nbag = n;
	*hold = ctl.bag;
	*files = c->nfds - 1;
	return 0;
}

/* "resume" (the client's files, or the kept ones), "resume held=N" (the client's files, then
 * the N descriptors detach hold gave), "resume stream" (the ring and the socket: from the
 * image store), "abort" (the kept ones). Without held=N, the agent's own held descriptors
 * (still there while prepared) take the memory back. */
static void resume_reply(struct client *c, int abort, int streamed, int nheld, int drained,
			 char *out, size_t size)
{
	if (ctl.state == RUNNING) {
		error_reply(out, size, "not prepared");
		return;
	}
	if (streamed) {
		if (c->nfds != 2) {
			error_reply(out, size, "resume stream takes the ring and the socket");
			return;
		}
		do_resume(NULL, 0, c->fds[0], c->fds[1], NULL, 0, drained, out, size);
		return;
	}
	if (nheld) { /* the client's fds are closed after */
		const int *hold;
		int files;

		if (!held_given(c, nheld, "resume held=N takes the data files, then N descriptors "
				"(past 200, one bag of them)", &hold, &files, out, size))
			do_resume(c->fds, files, -1, -1, hold, nheld, drained, out, size);
		return;
	}
	if (abort || !c->nfds) {
		if (ctl.state == DETACHED && !mover_in_memory() && !holds_deferred()) {
			error_reply(out, size, "detached: resume with the data files");
			return;
		}
		do_resume(ctl.held, ctl.nheld, -1, -1, ctl.hold, ctl.nhold, drained, out, size);
		return;
	}
	do_resume(c->fds, c->nfds, -1, -1, ctl.hold, ctl.nhold, drained, out, size);
}

/* detach hold of more than HOLD_DIRECT: the held descriptors go in one bag (fdbag.h), the one
 * descriptor the reply carries, which says "bag":true. A deferred save's bag holds duplicates
 * (the agent keeps its own until `detach release`: a bag that cannot be made leaves it
 * prepared); any other's holds the agent's own, given away (a bag that cannot be made: they
 * are closed, nothing is held, and the reply says held 0, as one that cannot be sent). */
static void detach_bag(struct client *c, char *out, size_t size)
{
	int n = ctl.nhold, bag = fdbag_pack(ctl.hold, ctl.nhold), err = errno;
	int deferred = mover_deferred();

	if (bag < 0 && deferred) {
		char why[160];

		ctl.state = PREPARED;
		snprintf(why, sizeof(why), "a bag of %d held descriptors: %s: still prepared", n,
			 strerror(err));
		error_reply(out, size, why);
		return;
	}
	if (!deferred)
		close_fds(ctl.hold, &ctl.nhold); /* given away: in the bag, or nothing held */
	if (bag < 0) {
		pr_warn("a bag of %d held descriptors: %s: nothing held", n, strerror(err));
		snprintf(out, size, "{\"ok\":true,\"held\":0}\n");
		return;
	}
	c->out_fds[0] = bag;
	c->nout = 1;
	snprintf(out, size, "{\"ok\":true,\"held\":%d%s,\"bag\":true}\n", n,
		 deferred ? ",\"release\":true" : "");
}

/* "detach" closes everything the agent kept; "detach hold" gives the held descriptors to the
 * client with the reply (closed here once sent: the CRIU dump must not find them). */
static void detach_reply(struct client *c, int hold, char *out, size_t size)
{
	if (ctl.state != PREPARED) {
		error_reply(out, size, "not prepared");
		return;
	}
	close_fds(ctl.held, &ctl.nheld);
	ctl.state = DETACHED;
	if (!hold) {
		close_fds(ctl.hold, &ctl.nhold);
		snprintf(out, size, "{\"ok\":true}\n");
		return;
	}
	if (ctl.nhold > HOLD_DIRECT) {
		detach_bag(c, out, size);
		return;
	}
	if (mover_deferred()) {
		/* a deferred save: duplicates go, the agent keeps its own until `detach release`
		 * (torpor's copier has them by then): the memory is never held by torpor alone,
		 * whose death before then leaves it here for the next torpor's resume */
		for (c->nout = 0; c->nout < ctl.nhold; c->nout++) {
			c->out_fds[c->nout] = fcntl(ctl.hold[c->nout], F_DUPFD_CLOEXEC, 3);
			if (c->out_fds[c->nout] < 0) {
				close_fds(c->out_fds, &c->nout);
				ctl.state = PREPARED;
				error_reply(out, size, "duplicating the held descriptors failed: still "
					    "prepared");
				return;
			}
		}
		snprintf(out, size, "{\"ok\":true,\"held\":%d,\"release\":true}\n", c->nout);
		return;
	}
	memcpy(c->out_fds, ctl.hold, sizeof(int) * ctl.nhold);
	c->nout = ctl.nhold;
	ctl.nhold = 0;
	snprintf(out, size, "{\"ok\":true,\"held\":%d}\n", c->nout);
}

/* "hold N" (N descriptors): a deferred save's held descriptors given back to the agent by a
 * torpor that cannot keep them (its rollback failed, and the files lack the data): the agent
 * checks each is the file it exported and keeps them, so that the next try (a recovery's
 * resume) takes the memory back from here, and the deadline too. */
static void hold_reply(struct client *c, int n, char *out, size_t size)
{
	char why[160];
	const int *hold;
	int files;

	if (ctl.state == RUNNING || !mover_deferred() || ctl.nhold) {
		error_reply(out, size, "nothing to hold (a deferred save whose descriptors the agent "
			    "gave away)");
		return;
	}
	if (c->nfds != (n > HOLD_DIRECT ? 1 : n)) {
		error_reply(out, size, "hold N takes N descriptors (past 200, one bag of them)");
		return;
	}
	if (held_given(c, n, "hold N takes N descriptors", &hold, &files, out, size))
		return;
	if (hold_matches(hold, n, why, sizeof(why))) {
		error_reply(out, size, why);
		return;
	}
	memcpy(ctl.hold, hold, sizeof(int) * n);
	ctl.nhold = n;
	if (hold == ctl.bag) /* kept */
		ctl.nbag = 0;
	else
		c->nfds = 0;
	ctl.elapsed_ms = 0;
	ctl.last_ms = now_ms();
	snprintf(out, size, "{\"ok\":true,\"held\":%d}\n", ctl.nhold);
}

/* "detach release": after a deferred save's `detach hold`, once torpor's copier holds the
 * memory too, the agent lets its own descriptors go (none may be in the CRIU dump). */
static void release_reply(char *out, size_t size)
{
	if (ctl.state != DETACHED || !mover_deferred()) {
		error_reply(out, size, "nothing to release (detach hold of a deferred save first)");
		return;
	}
	close_fds(ctl.hold, &ctl.nhold);
	snprintf(out, size, "{\"ok\":true}\n");
}

/* "N" (0 < N <= HOLD_MAX; past HOLD_DIRECT the descriptors come in a bag): N, or -1. */
static int parse_count(const char *arg)
{
	char *end;
	long n;

	if (!isdigit((unsigned char)arg[0]))
		return -1;
	n = strtol(arg, &end, 10);
	return *end || n < 1 || n > HOLD_MAX ? -1 : (int)n;
}

/* "held=N" (0 < N <= HOLD_MAX): N, or -1. */
static int parse_held(const char *arg)
{
	char *end;
	long n;

	if (strncmp(arg, "held=", 5) || !isdigit((unsigned char)arg[5]))
		return -1;
	n = strtol(arg + 5, &end, 10);
	if (!strcmp(end, " drained")) /* torpor's copier filled the files (a deferred copy) */
		end += strlen(end);
	return *end || n < 1 || n > HOLD_MAX ? -1 : (int)n;
}

/* The prepare deadline: a prepared program whose caller went away resumes by itself. */
static long prepared_tick(void)
{
	long long now = now_ms(), step, limit = (long long)(ctl.prepare_timeout_s * 1000);

	if (ctl.state != PREPARED && !holds_deferred())
		return -1;
	step = now - ctl.last_ms;
	ctl.elapsed_ms += step < 0 ? 0 : step > 1000 ? 1000 : step;
	ctl.last_ms = now;
	if (ctl.elapsed_ms < limit)
		return limit - ctl.elapsed_ms > 1000 ? 1000 : limit - ctl.elapsed_ms;
	pr_warn("prepared %lld ms ago and neither detached nor aborted: resuming", ctl.elapsed_ms);
	if (do_resume(ctl.held, ctl.nheld, -1, -1, ctl.hold, ctl.nhold, 0, NULL, 0)) {
		ctl.elapsed_ms = 0; /* try again after another period */
		return 1000;
	}
	return -1;
}

static void close_reply(const char *arg, char *out, size_t size)
{
	long timeout_ms;
	int ret;

	if (ctl.state != RUNNING) {
		error_reply(out, size, "prepared: resume or abort");
		return;
	}
	if (parse_timeout(arg, &timeout_ms)) {
		snprintf(out, size, "{\"ok\":false,\"error\":\"bad timeout\"}\n");
		return;
	}
	ret = gate_close(timeout_ms, (long long)(ctl.prepare_timeout_s * 1000));
	if (ret == -ETIMEDOUT) {
		snprintf(out, size, "{\"ok\":false,\"error\":\"timeout\"}\n");
		return;
	}
	if (ret) {
		snprintf(out, size, "{\"ok\":false,\"error\":\"synchronize failed\"}\n");
		return;
	}
	snprintf(out, size, "{\"ok\":true}\n");
}

static void handle_line(struct client *c, char *line, char *out, size_t size)
{
	size_t len = strlen(line);
	char *arg;

	while (len && (line[len - 1] == '\r' || line[len - 1] == ' ' || line[len - 1] == '\t'))
		line[--len] = 0;
	arg = line + strcspn(line, " \t");
	if (*arg)
		*arg++ = 0;
	arg += strspn(arg, " \t");
	pr_debug("command %s%s%s", line, *arg ? " " : "", arg);

	if (!strcmp(line, "status") && !*arg) {
		status_reply(out, size);
	} else if (!strcmp(line, "close")) {
		close_reply(arg, out, size);
	} else if (!strcmp(line, "open") && !*arg) {
		if (ctl.state != RUNNING) {
			error_reply(out, size, "GPU memory released: resume or abort");
		} else {
			gate_open();
			snprintf(out, size, "{\"ok\":true}\n");
		}
	} else if (!strcmp(line, "prepare")) {
		prepare_reply(c, arg, out, size);
	} else if (!strcmp(line, "detach") && (!*arg || !strcmp(arg, "hold"))) {
		detach_reply(c, *arg != 0, out, size);
	} else if (!strcmp(line, "detach") && !strcmp(arg, "release")) {
		release_reply(out, size);
	} else if (!strcmp(line, "hold") && parse_count(arg) > 0) {
		hold_reply(c, parse_count(arg), out, size);
	} else if (!strcmp(line, "resume") && (!*arg || !strcmp(arg, "stream"))) {
		resume_reply(c, 0, *arg != 0, 0, 0, out, size);
	} else if (!strcmp(line, "resume") && !strcmp(arg, "drained")) {
		resume_reply(c, 0, 0, 0, 1, out, size);
	} else if (!strcmp(line, "resume") && parse_held(arg) > 0) {
		resume_reply(c, 0, 0, parse_held(arg), !!strstr(arg, " drained"), out, size);
	} else if (!strcmp(line, "abort") && !*arg) {
		resume_reply(c, 1, 0, 0, 0, out, size);
	} else {
		snprintf(out, size, "{\"ok\":false,\"error\":\"unknown command\"}\n");
	}
}

/* Receives what the client sent, with any file descriptors (SCM_RIGHTS): they belong to the
 * line being received and are closed after its command unless the command keeps them. */
static ssize_t receive(struct client *c)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * SCM_MAX_FD)];
		struct cmsghdr align;
	} u;
	struct iovec iov = { c->buf + c->len, sizeof(c->buf) - 1 - c->len };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			      .msg_controllen = sizeof(u.buf) };
	ssize_t n = recvmsg(c->fd, &msg, MSG_CMSG_CLOEXEC);

	if (n < 0)
		return n;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
		int *fds = (int *)CMSG_DATA(cm);
		size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);

		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		for (size_t i = 0; i < k; i++) {
			if (c->nfds < MAX_FDS)
				c->fds[c->nfds++] = fds[i];
			else
				close(fds[i]);
		}
	}
	if (msg.msg_flags & MSG_CTRUNC)
		pr_warn("a client sent more than %d descriptors: the rest were dropped", MAX_FDS);
	return n;
}

static void serve(struct client *c)
{
	char out[REPLY_MAX], *nl;
	ssize_t n;

	n = receive(c);
	if (n < 0 && (errno == EINTR || errno == EAGAIN))
		return;
	if (n <= 0) {
		drop(c);
		return;
	}
	c->len += n;
	c->buf[c->len] = 0;
	while ((nl = memchr(c->buf, '\n', c->len))) {
		size_t used = nl - c->buf + 1;

		*nl = 0;
		handle_line(c, c->buf, out, sizeof(out));
		close_fds(c->fds, &c->nfds); /* those the command did not keep */
		close_fds(ctl.bag, &ctl.nbag);
		memmove(c->buf, c->buf + used, c->len - used);
		c->len -= used;
		c->buf[c->len] = 0;
		if (reply(c, out) < 0) {
			drop(c);
			return;
		}
	}
	if (c->len == sizeof(c->buf) - 1) {
		reply(c, "{\"ok\":false,\"error\":\"line too long\"}\n");
		drop(c);
	}
}

static void *control_main(void *arg)
{
	struct pollfd pfd[1 + MAX_CLIENTS];
	struct client *who[1 + MAX_CLIENTS];

	(void)arg;
	gate_agent_thread();
	for (;;) {
		int n = 0, timeout;

		pfd[n].fd = ctl.listen_fd; /* -1 once given up: poll() skips it */
		pfd[n++].events = POLLIN;
		for (int i = 0; i < MAX_CLIENTS; i++)
			if (ctl.clients[i].fd >= 0) {
				who[n] = &ctl.clients[i];
				pfd[n].fd = ctl.clients[i].fd;
				pfd[n++].events = POLLIN;
			}
		timeout = (int)gate_tick(); /* the prepare deadline: -1, or at most 1000 ms */
		if (ctl.state == PREPARED || holds_deferred()) { /* prepared_tick's own test */
			long left = prepared_tick();

			if (left >= 0 && (timeout < 0 || left < timeout))
				timeout = (int)left;
		}
		if (ctl.listen_fd < 0 && n == 1) {
			pr_warn("no socket and no client left: control thread ends");
			return NULL;
		}
		if (poll(pfd, n, timeout) < 0) {
			if (errno != EINTR) {
				pr_perror("poll: control socket given up");
				return NULL;
			}
			continue;
		}
		gate_tick();
		prepared_tick();
		/* POLLNVAL: the program closed our descriptor (a close-all-fds loop). Its number may
		 * be the program's own file by now: forget it, never close it. */
		for (int i = 1; i < n; i++) {
			if (pfd[i].revents & POLLNVAL) {
				pr_warn("a client's descriptor was closed under us: forgotten");
				who[i]->fd = -1;
				who[i]->len = 0;
			} else if (pfd[i].revents) {
				serve(who[i]);
			}
		}
		if (pfd[0].revents & POLLNVAL) {
			pr_err("the control socket's descriptor was closed under us: no longer "
			       "accepting");
			ctl.listen_fd = -1;
		} else if (pfd[0].revents & POLLIN) {
			accept_one();
		}
	}
	return NULL;
}

static int start_locked(void)
{
	const char *dir = getenv("TORPOR_AGENT_DIR");
	sigset_t all, old;
	pthread_attr_t attr;
	pthread_t thread;
	int fd, ret;

	if (!dir || !*dir)
		dir = DEFAULT_DIR;
	ctl.prepare_timeout_s = env_seconds("TORPOR_AGENT_PREPARE_TIMEOUT_S", 600);
	mover_tune_read();
	for (int i = 0; i < MAX_CLIENTS; i++)
		ctl.clients[i].fd = -1;
	fd = listen_at(dir, ctl.path, sizeof(ctl.path));
	if (fd < 0)
		return fd;
	ctl.listen_fd = fd;
	ctl.owner = getpid();

	/* The program's signals are for the program's threads. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	ret = -pthread_create(&thread, &attr, control_main, NULL);
	pthread_attr_destroy(&attr);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (ret) {
		errno = -ret;
		pr_perror("cannot start the control thread");
		goto err;
	}
	pthread_setname_np(thread, "torpor-agent");
	pr_info("control socket %s", ctl.path);
	return 0;

err:
	unlink(ctl.path);
	close(fd);
	ctl.listen_fd = -1;
	ctl.owner = 0;
	return ret;
}

void control_start(void)
{
	if (atomic_load_explicit(&ctl.started, memory_order_acquire))
		return;
	pthread_mutex_lock(&ctl.lock);
	if (!atomic_load_explicit(&ctl.started, memory_order_relaxed)) {
		if (start_locked())
			pr_warn("no control socket: this program cannot be checkpointed through "
				"the agent");
		atomic_store_explicit(&ctl.started, 1, memory_order_release);
	}
	pthread_mutex_unlock(&ctl.lock);
}

/* The child of a fork has no control thread; its own socket comes with its first driver call.
 * The parent's socket file stays the parent's. */
void control_after_fork(void)
{
	pthread_mutex_init(&ctl.lock, NULL);
	if (ctl.listen_fd >= 0)
		close(ctl.listen_fd);
	for (int i = 0; i < MAX_CLIENTS; i++) {
		struct client *c = &ctl.clients[i];

		if (c->fd >= 0) {
			close(c->fd);
			c->fd = -1;
		}
		/* a fork while a command was in flight: what it received (a resume's held memory)
		 * or was about to send (detach hold) would keep GPU memory alive in the child */
		close_fds(c->fds, &c->nfds);
		close_fds(c->out_fds, &c->nout);
		c->len = 0;
	}
	ctl.listen_fd = -1;
	ctl.owner = 0;
	ctl.path[0] = 0;
	close_fds(ctl.held, &ctl.nheld); /* the child's copies */
	close_fds(ctl.hold, &ctl.nhold);
	close_fds(ctl.bag, &ctl.nbag);
	ctl.state = RUNNING;
	atomic_store(&ctl.started, 0);
}

__attribute__((destructor)) static void control_exit(void)
{
	if (ctl.owner && ctl.owner == getpid() && ctl.path[0])
		unlink(ctl.path);
}
