// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * torpor_criu_plugin.so: GPU-aware checkpoints under any engine that runs CRIU (stock runc,
 * crun, containerd, CRI-O, podman), without torpor-runtime. CRIU loads it from its plugin
 * directory (--libdir, $CRIU_LIBS_DIR or /usr/lib/criu) and the device phases go to torpord
 * through torpor's helper (`torpor-criu-helper`, shim/torpor/criu_plugin.py):
 *
 *   dump     PAUSE_DEVICES (first call: the root, before CRIU stops anything)
 *              -> helper lock: torpord LockAndCheckpoint of the tree; the GPU manifest
 *                 (torpor-criu.json) and the agents' data go into the images directory, so
 *                 the engine's archive carries them. Having locked, the helper stays, holding
 *                 the operation (its owner in torpord), a pipe from this plugin on its fd 3.
 *            fini -> "ok" or "failed" down that pipe. The helper waits for this CRIU to exit
 *              (the tasks killed, or let go: --leave-running, a failed dump), then torpord's
 *              Finish (dead ones closed, live ones RUNNING again) or Rollback. Should CRIU or
 *              the helper die, EOF means failed, and torpord rolls back an operation whose
 *              owner died as soon as no ptrace holds the processes.
 *            The dump lists the plugin in CRIU's inventory (CRIU refuses its restore without it).
 *   restore  init: ours (inventory, torpor-criu.json) -> helper check (manifest readable, a
 *              GPU fits by torpor's placement rules, torpord answers, the dump's operation
 *              ended); a failure fails the restore before anything starts
 *            RESUME_DEVICES_LATE: collect the restored host PIDs (the tasks are still stopped)
 *            fini (after CRIU let them go) -> helper restore: RestoreAndUnlock of those PIDs;
 *              should it fail the restored tree is killed: a program left CHECKPOINTED would
 *              hang in its first CUDA call forever.
 *
 * Why a helper and not gRPC from C: the lock needs torpord's typed API, its error trailers,
 * the agents' data directory and an atomic 0600 manifest; the helper is torpor's own Python
 * client (one process per phase, only for trees that map libcuda), so the plugin stays a few
 * hundred lines with no gRPC/protobuf in CRIU's address space.
 *
 * Left alone: runs torpor itself makes (the `torpor` CLI's CRIU, torpor-runtime's runc) carry
 * TORPOR_CRIU_PLUGIN=off in CRIU's environment; the helper also skips trees torpord already
 * holds or whose CUDA processes are not RUNNING (never locked twice); trees that map no
 * libcuda never reach the helper; pre-dump is ignored.
 *
 * Hooks answer -ENOTSUP for what is not ours (CRIU then asks the next plugin), 0 for a tree
 * we locked, a negative errno to fail the dump. Only the dump's PAUSE_DEVICES and the
 * restore's init can fail CRIU; both run before the program is touched.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "criu-plugin.h"

#ifndef TORPOR_HELPER
#define TORPOR_HELPER "/usr/local/bin/torpor-criu-helper"
#endif
#define MANIFEST "torpor-criu.json" /* shim/torpor/criu_plugin.py: MANIFEST */
#define RESULT	 "torpor-criu-result: "
#define OUT_MAX	 8192

/* CRIU's logger (criu/include/log.h); the criu binary exports it to its plugins */
extern void print_on_level(unsigned int loglevel, const char *format, ...)
	__attribute__((__format__(__printf__, 2, 3)));
#define LOG_ERROR 1
#define LOG_WARN  2
#define LOG_INFO  3
#define LOG_DEBUG 4
/*
 * CRIU >= 4.1's record of the plugins a dump used (criu/image.c, exported like the logger but
 * not in criu-plugin.h; weak: NULL on a CRIU without them). A dump that locked adds us: CRIU
 * then refuses to restore it where this plugin is missing, and disables the other plugins
 * that did not act (CRIU's cuda_plugin) at its restore; the restore must take us off the list.
 */
extern int add_inventory_plugin(const char *name) __attribute__((weak));
extern bool check_and_remove_inventory_plugin(const char *name, size_t n) __attribute__((weak));

#define pr_err(fmt, ...)  print_on_level(LOG_ERROR, "torpor_plugin: " fmt, ##__VA_ARGS__)
#define pr_warn(fmt, ...) print_on_level(LOG_WARN, "torpor_plugin: " fmt, ##__VA_ARGS__)
#define pr_info(fmt, ...) print_on_level(LOG_INFO, "torpor_plugin: " fmt, ##__VA_ARGS__)

static bool disabled;
static int stage_now = -1;
static bool paused;		   /* PAUSE_DEVICES handled the tree (locked or skipped) */
static char op_id[128];		   /* the open torpord operation, "" when none */
static int ctl_fd = -1;		   /* to the lock helper that ends it: "ok" or "failed" */
static char images[PATH_MAX];	   /* CRIU's images directory */
static int *restored;		   /* host PIDs from RESUME_DEVICES_LATE */
static size_t n_restored, cap_restored;

static const char *helper_path(void)
{
	const char *h = getenv("TORPOR_CRIU_HELPER");

	return h && *h ? h : TORPOR_HELPER;
}

static int images_dir(void)
{
	char link[64];
	ssize_t n;
	int fd = criu_get_image_dir();

	if (fd < 0)
		return -1;
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	n = readlink(link, images, sizeof(images) - 1);
	if (n <= 0)
		return -1;
	images[n] = '\0';
	return 0;
}

static bool result_of_peek(const char *out, const char *prefix)
{
	const char *p = out, *found = NULL;

	while ((p = strstr(p, RESULT))) {
		found = p + strlen(RESULT);
		p = found;
	}
	return found && strncmp(found, prefix, strlen(prefix)) == 0;
}

/*
 * Run the helper with argv, its stdout and stderr into out (NUL-terminated, truncated);
 * every line goes to CRIU's log. Returns its exit status, -1 when it did not exit.
 * CRIU's own descriptors (images, log, ptrace'd tasks' files) are closed in the child.
 */
static int run_helper_ctl(char *const argv[], char *out, size_t size, int ctl, bool *kept)
{
	int fd[2], status, ret = -1;
	size_t off = 0;
	pid_t pid;
	char *line, *save;

	out[0] = '\0';
	if (pipe2(fd, O_CLOEXEC)) {
		pr_err("pipe: %s\n", strerror(errno));
		return -1;
	}
	pid = fork();
	if (pid < 0) {
		pr_err("fork: %s\n", strerror(errno));
		close(fd[0]);
		close(fd[1]);
		return -1;
	}
	if (pid == 0) {
		long max = sysconf(_SC_OPEN_MAX), i;
		/* above 0-3 first: under an engine CRIU's own 0-2 may be closed, and a pipe end
		 * there would be clobbered by the dup2()s below */
		int null = open("/dev/null", O_RDONLY), w = fcntl(fd[1], F_DUPFD, 10),
		    c = ctl >= 0 ? fcntl(ctl, F_DUPFD, 10) : -1;

		if (null < 0 || w < 0 || (ctl >= 0 && c < 0))
			_exit(127);
		if (dup2(null, 0) < 0 || dup2(w, 1) < 0 || dup2(w, 2) < 0 || (c >= 0 && dup2(c, 3) < 0))
			_exit(127);
		for (i = ctl >= 0 ? 4 : 3; i < (max > 0 && max < 65536 ? max : 65536); i++)
			close(i);
		signal(SIGPIPE, SIG_DFL);
		/*
		 * A helper that stays past this hook must not be CRIU's child: CRIU waits for
		 * its children before it exits, and the helper waits for CRIU's exit.
		 */
		if (ctl >= 0) {
			pid_t g = fork();

			if (g < 0)
				_exit(127);
			if (g > 0)
				_exit(0);
			setsid();
		}
		execv(argv[0], argv);
		dprintf(2, "cannot run %s: %s\n", argv[0], strerror(errno));
		_exit(127);
	}
	close(fd[1]);
	for (;;) {
		char scratch[512];
		ssize_t n = off + 1 < size ? read(fd[0], out + off, size - off - 1)
					   : read(fd[0], scratch, sizeof(scratch));

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		if (off + 1 < size)
			off += n;
	}
	out[off] = '\0';
	close(fd[0]);
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR) {
			pr_err("waitpid %d: %s\n", pid, strerror(errno));
			return -1;
		}
	}
	if (kept) {
		/* detached: its result line is the verdict; a locked one stays until CRIU exits,
		 * to end the operation (see torpor_plugin_fini) */
		ret = strstr(out, RESULT) ? 0 : 1;
		*kept = result_of_peek(out, "locked ");
	} else if (WIFEXITED(status))
		ret = WEXITSTATUS(status);
	else
		pr_err("%s killed by signal %d\n", argv[0], WIFSIGNALED(status) ? WTERMSIG(status) : 0);
	/* log it line by line, keeping out intact for the caller */
	{
		char copy[OUT_MAX];

		memcpy(copy, out, strnlen(out, sizeof(copy) - 1) + 1);
		copy[sizeof(copy) - 1] = '\0';
		for (line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
			print_on_level(ret == 0 ? LOG_INFO : LOG_ERROR, "torpor_plugin: helper: %s\n", line);
	}
	return ret;
}

static int run_helper(char *const argv[], char *out, size_t size)
{
	return run_helper_ctl(argv, out, size, -1, NULL);
}

/* The value of the helper's last "torpor-criu-result: " line, or NULL. */
static const char *result_of(char *out)
{
	char *p = out, *found = NULL;

	while ((p = strstr(p, RESULT))) {
		found = p + strlen(RESULT);
		p = found;
	}
	if (found)
		found[strcspn(found, "\n")] = '\0';
	return found;
}

/* Does pid or any descendant map libcuda? /proc/<pid>/task/<tid>/children walks the tree. */
static bool maps_libcuda(int pid, int depth)
{
	char path[64], line[4096];
	bool found = false;
	FILE *f;
	DIR *d;
	struct dirent *de;

	snprintf(path, sizeof(path), "/proc/%d/maps", pid);
	f = fopen(path, "re");
	if (f) {
		while (!found && fgets(line, sizeof(line), f)) {
			char *slash = strrchr(line, '/');

			found = slash && strncmp(slash + 1, "libcuda.so", 10) == 0;
		}
		fclose(f);
	}
	if (found || depth > 64)
		return found;
	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	d = opendir(path);
	if (!d)
		return false;
	while (!found && (de = readdir(d))) {
		char cpath[320];
		FILE *c;
		int child;

		if (de->d_name[0] == '.')
			continue;
		snprintf(cpath, sizeof(cpath), "/proc/%d/task/%s/children", pid, de->d_name);
		c = fopen(cpath, "re");
		if (!c)
			continue;
		while (!found && fscanf(c, "%d", &child) == 1)
			found = maps_libcuda(child, depth + 1);
		fclose(c);
	}
	closedir(d);
	return found;
}

int torpor_plugin_init(int stage)
{
	const char *off = getenv("TORPOR_CRIU_PLUGIN");
	struct stat st;
	char path[PATH_MAX + 32], out[OUT_MAX];

	stage_now = stage;
	if (off && strcmp(off, "off") == 0) {
		pr_info("TORPOR_CRIU_PLUGIN=off: torpor drives this CRIU itself; plugin disabled\n");
		disabled = true;
		return 0;
	}
	if (stage == CR_PLUGIN_STAGE__PRE_DUMP) {
		disabled = true; /* a pre-dump copies memory only: no device phase */
		return 0;
	}
	if (images_dir()) {
		pr_err("cannot find CRIU's images directory\n");
		return -1;
	}
	if (stage == CR_PLUGIN_STAGE__RESTORE) {
		snprintf(path, sizeof(path), "%s/%s", images, MANIFEST);
		/* ours: the dump listed us (true too for images without a list), and the manifest */
		if ((check_and_remove_inventory_plugin &&
		     !check_and_remove_inventory_plugin(CR_PLUGIN_DESC.name, strlen(CR_PLUGIN_DESC.name))) ||
		    lstat(path, &st)) {
			disabled = true; /* not a torpor plugin checkpoint */
			return 0;
		}
		char *argv[] = { (char *)helper_path(), "check", "--images", images, NULL };

		if (run_helper(argv, out, sizeof(out))) {
			pr_err("the checkpoint holds GPU state and torpor cannot restore it here; "
			       "nothing was restored\n");
			return -1;
		}
	}
	pr_info("initialized (stage %d, images %s)\n", stage, images);
	return 0;
}

int torpor_plugin_pause_devices(int pid)
{
	char pidbuf[16], criubuf[16], out[OUT_MAX];
	const char *res;
	int rc, ctl[2];
	bool kept = false;

	if (disabled || stage_now != CR_PLUGIN_STAGE__DUMP)
		return -ENOTSUP;
	if (paused)
		return op_id[0] ? 0 : -ENOTSUP; /* the root's call covered its whole tree */
	paused = true;
	if (!maps_libcuda(pid, 0)) {
		pr_info("no process of tree %d maps libcuda: nothing to do\n", pid);
		return -ENOTSUP; /* the next plugin's turn (run_plugins stops at the first answer) */
	}
	snprintf(pidbuf, sizeof(pidbuf), "%d", pid);
	snprintf(criubuf, sizeof(criubuf), "%d", (int)getpid());
	char *argv[] = { (char *)helper_path(), "lock", "--pid", pidbuf, "--images", images,
			 "--criu-pid", criubuf, NULL };

	if (pipe2(ctl, O_CLOEXEC)) {
		pr_err("pipe: %s\n", strerror(errno));
		return -1;
	}
	rc = run_helper_ctl(argv, out, sizeof(out), ctl[0], &kept);
	close(ctl[0]);
	res = result_of(out);
	if (kept)
		ctl_fd = ctl[1];
	else
		close(ctl[1]);
	if (rc != 0 || !res) {
		pr_err("torpord could not lock and checkpoint the GPU state of tree %d (helper exit %d): "
		       "dump refused, the program keeps running\n", pid, rc);
		return -1;
	}
	if (strncmp(res, "locked ", 7) != 0) {
		pr_info("tree %d left alone: %s\n", pid, res);
		return -ENOTSUP;
	}
	snprintf(op_id, sizeof(op_id), "%s", res + 7);
	pr_info("tree %d locked and checkpointed by torpord (operation %s)\n", pid, op_id);
	if (add_inventory_plugin && add_inventory_plugin(CR_PLUGIN_DESC.name)) {
		pr_err("cannot record the plugin in the inventory: dump refused\n");
		return -1; /* fini says failed: the helper rolls back once CRIU has exited */
	}
	return 0;
}

int torpor_plugin_checkpoint_devices(int pid)
{
	if (disabled || stage_now != CR_PLUGIN_STAGE__DUMP || !op_id[0])
		return -ENOTSUP;
	return 0; /* the GPU state went to host memory at PAUSE_DEVICES, before CRIU stopped it */
}

int torpor_plugin_resume_devices_late(int pid)
{
	if (disabled || stage_now != CR_PLUGIN_STAGE__RESTORE)
		return -ENOTSUP;
	if (n_restored == cap_restored) {
		size_t cap = cap_restored ? cap_restored * 2 : 16;
		int *p = realloc(restored, cap * sizeof(*p));

		if (!p)
			return -ENOMEM;
		restored = p;
		cap_restored = cap;
	}
	restored[n_restored++] = pid;
	/* the driver's restore runs once CRIU lets the tasks go (fini); CRIU ignores this
	 * hook's errors, and other plugins may want the call too */
	return -ENOTSUP;
}

static void kill_restored(void)
{
	size_t i;

	for (i = 0; i < n_restored; i++)
		kill(restored[i], SIGKILL);
}

void torpor_plugin_fini(int stage, int ret)
{
	char out[OUT_MAX];

	if (disabled)
		return;
	if (stage == CR_PLUGIN_STAGE__DUMP && ctl_fd >= 0) {
		const char *verdict = ret ? "failed\n" : "ok\n";

		pr_info("dump %s: operation %s is %s once this CRIU has exited\n",
			ret ? "failed" : "done", op_id,
			ret ? "rolled back (the program runs on)" : "finished");
		if (write(ctl_fd, verdict, strlen(verdict)) < 0)
			pr_warn("cannot tell the helper: %s (it rolls back)\n", strerror(errno));
		close(ctl_fd);
		ctl_fd = -1;
	}
	if (stage == CR_PLUGIN_STAGE__RESTORE && ret == 0 && n_restored) {
		size_t i, len = 0;
		char *pids = malloc(n_restored * 12 + 1);

		if (!pids) {
			pr_err("out of memory: killing the restored tree\n");
			kill_restored();
			goto out;
		}
		pids[0] = '\0';
		for (i = 0; i < n_restored; i++)
			len += sprintf(pids + len, "%s%d", i ? "," : "", restored[i]);
		char *argv[] = { (char *)helper_path(), "restore", "--images", images, "--pids", pids,
				 NULL };

		if (run_helper(argv, out, sizeof(out))) {
			pr_err("torpord could not restore the GPU state of PIDs %s: killing them "
			       "(left CHECKPOINTED they would hang in their next CUDA call)\n",
			       pids);
			kill_restored();
		} else {
			pr_info("GPU state of PIDs %s restored and unlocked\n", pids);
		}
		free(pids);
	}
out:
	free(restored);
	restored = NULL;
	n_restored = cap_restored = 0;
}

CR_PLUGIN_REGISTER("torpor_plugin", torpor_plugin_init, torpor_plugin_fini)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__PAUSE_DEVICES, torpor_plugin_pause_devices)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__CHECKPOINT_DEVICES, torpor_plugin_checkpoint_devices)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, torpor_plugin_resume_devices_late)
