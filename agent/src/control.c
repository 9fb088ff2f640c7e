/* The control socket: $TORPOR_AGENT_DIR/agent-<pid>.sock (default dir /run/torpor/agents), a
 * Unix stream socket served by one thread of the agent's own. One command a line, one JSON
 * object a reply line:
 *
 *   status              {"pid","gate":"open"|"closed","in_flight","waiting","allocations",
 *                        "bytes","contexts"}
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

struct client {
	int fd;
	size_t len;
	char buf[LINE_MAX_LEN];
};

static struct {
	pthread_mutex_t lock;     /* start */
	atomic_int started;       /* tried in this process (successfully or not) */
	int listen_fd;
	pid_t owner;              /* the process whose socket `path` is */
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	double prepare_timeout_s;
	long long deadline_ms;    /* control thread only: when a prepare's gate opens; 0: none */
	struct client clients[MAX_CLIENTS];
} ctl = { .lock = PTHREAD_MUTEX_INITIALIZER, .listen_fd = -1 };

/* mkdir -p: missing parents 0755, the directory itself 0700. */
static int make_dirs(const char *dir)
{
	char buf[PATH_MAX];
	size_t len = strlen(dir);

	if (len == 0 || len >= sizeof(buf))
		return -ENAMETOOLONG;
	memcpy(buf, dir, len + 1);
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

static int listen_at(const char *dir, char *path, size_t size)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	int fd, ret;

	ret = make_dirs(dir);
	if (ret) {
		errno = -ret;
		pr_pwarn("cannot create %s", dir);
		return ret;
	}
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
	/* A file left by a process of the same pid that died without cleaning up. */
	if (unlink(path) < 0 && errno != ENOENT)
		pr_pwarn("cannot remove %s", path);
	if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
		ret = -errno;
		pr_pwarn("bind %s", path);
		goto err_close;
	}
	/* bind() made it under the umask; the 0700 directory keeps others out meanwhile. */
	if (chmod(path, 0600) < 0) {
		ret = -errno;
		pr_pwarn("chmod %s", path);
		goto err_unlink;
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

static void drop(struct client *c)
{
	close(c->fd);
	c->fd = -1;
	c->len = 0;
}

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
	pr_warn("refused pid %d: uid %u is neither root nor the program's", (int)cred.pid,
		(unsigned)cred.uid);
	return 0;
}

static void accept_one(void)
{
	int fd = accept4(ctl.listen_fd, NULL, NULL, SOCK_CLOEXEC);

	if (fd < 0) {
		if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)
			pr_pwarn("accept");
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

static int reply(struct client *c, const char *text)
{
	size_t len = strlen(text), off = 0;

	while (off < len) {
		ssize_t n = send(c->fd, text + off, len - off, MSG_NOSIGNAL);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		off += n;
	}
	return 0;
}

static void status_reply(char *out, size_t size)
{
	struct gate_status g;
	struct track_status t;

	gate_status(&g);
	track_status(&t);
	snprintf(out, size,
		 "{\"pid\":%d,\"gate\":\"%s\",\"in_flight\":%ld,\"waiting\":%ld,"
		 "\"allocations\":%ld,\"bytes\":%llu,\"contexts\":%d}\n",
		 (int)getpid(), g.closed ? "closed" : "open", g.in_flight, g.waiting,
		 t.allocations, t.bytes, t.contexts);
}

static void close_reply(const char *arg, char *out, size_t size)
{
	long timeout_ms = DEFAULT_CLOSE_TIMEOUT_MS;
	char *end;
	int ret;

	if (*arg) {
		timeout_ms = strtol(arg, &end, 10);
		if (end == arg || *end || timeout_ms < 0) {
			snprintf(out, size, "{\"ok\":false,\"error\":\"bad timeout\"}\n");
			return;
		}
	}
	ret = gate_close(timeout_ms);
	if (ret)
		ctl.deadline_ms = 0; /* the gate is open again */
	if (ret == -ETIMEDOUT) {
		snprintf(out, size, "{\"ok\":false,\"error\":\"timeout\"}\n");
		return;
	}
	if (ret) {
		snprintf(out, size, "{\"ok\":false,\"error\":\"synchronize failed\"}\n");
		return;
	}
	ctl.deadline_ms = now_ms() + (long long)(ctl.prepare_timeout_s * 1000);
	snprintf(out, size, "{\"ok\":true}\n");
}

static void handle_line(char *line, char *out, size_t size)
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
		ctl.deadline_ms = 0;
		gate_open();
		snprintf(out, size, "{\"ok\":true}\n");
	} else {
		snprintf(out, size, "{\"ok\":false,\"error\":\"unknown command\"}\n");
	}
}

static void serve(struct client *c)
{
	char out[512], *nl;
	ssize_t n;

	n = recv(c->fd, c->buf + c->len, sizeof(c->buf) - 1 - c->len, 0);
	if (n < 0 && errno == EINTR)
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
		handle_line(c->buf, out, sizeof(out));
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
		int n = 0, timeout = -1;

		pfd[n].fd = ctl.listen_fd;
		pfd[n++].events = POLLIN;
		for (int i = 0; i < MAX_CLIENTS; i++)
			if (ctl.clients[i].fd >= 0) {
				who[n] = &ctl.clients[i];
				pfd[n].fd = ctl.clients[i].fd;
				pfd[n++].events = POLLIN;
			}
		if (ctl.deadline_ms) {
			long long left = ctl.deadline_ms - now_ms();

			timeout = left < 0 ? 0 : left > 3600000 ? 3600000 : (int)left;
		}
		if (poll(pfd, n, timeout) < 0) {
			if (errno != EINTR) {
				pr_perror("poll: control socket given up");
				return NULL;
			}
			continue;
		}
		if (ctl.deadline_ms && now_ms() >= ctl.deadline_ms) {
			ctl.deadline_ms = 0;
			pr_warn("gate closed for %g s without an open: reopening",
				ctl.prepare_timeout_s);
			gate_open();
		}
		for (int i = 1; i < n; i++)
			if (pfd[i].revents)
				serve(who[i]);
		if (pfd[0].revents & POLLIN)
			accept_one();
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
	for (int i = 0; i < MAX_CLIENTS; i++)
		if (ctl.clients[i].fd >= 0) {
			close(ctl.clients[i].fd);
			ctl.clients[i].fd = -1;
		}
	ctl.listen_fd = -1;
	ctl.owner = 0;
	ctl.path[0] = 0;
	ctl.deadline_ms = 0;
	atomic_store(&ctl.started, 0);
}

__attribute__((destructor)) static void control_exit(void)
{
	if (ctl.owner && ctl.owner == getpid() && ctl.path[0])
		unlink(ctl.path);
}
