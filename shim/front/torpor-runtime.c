/*
 * torpor-runtime: the native front of torpor's OCI runtime (docs/containers.md, "The native
 * front").
 *
 * Engines call it exactly as they call runc. It reads the command line as runc does and
 * execs, with the argv unchanged, either
 *   runc itself      for every command and container torpor has nothing to do with, or
 *   the Python side  (torpor-runtime-py, torpor.runtime.main) for the rest, which decides
 *                    with torpor's one set of GPU rules (torpor.oci) and execs runc itself
 *                    wherever they say "not ours".
 * It keeps no second copy of those rules. Routing:
 *   create, run           Python if the bundle's config.json mentions, anywhere, an NVIDIA
 *                         device (/dev/nvidia), NVIDIA_VISIBLE_DEVICES, a CDI GPU
 *                         (nvidia.com/gpu) or a torpor annotation (org.torpor.), or holds a
 *                         JSON escape that could spell one of them; else runc.
 *   checkpoint, restore   always Python: a restore has no container yet (the image decides),
 *                         and a checkpoint of a container created before this front (or
 *                         whose marker could not be written) must not lose its GPU state;
 *                         both take seconds, the Python start 0.2 s.
 *   any other command     Python if the container has a marker under its root: the file
 *   naming a container    <run_dir>/containers/<id>@<key> (key: root_key, FNV-1a 64 of
 *                         --root read lexically, "" for none) the Python side writes at
 *                         create/restore for each container it took over and removes at
 *                         delete (markers.py), or an earlier torpor's: keyed by --root as
 *                         given, or <run_dir>/containers/<id> of any root; else runc.
 *   no container          (--version, list, spec, features, help): runc.
 * Anything the front cannot read for sure (an option runc does not have, an unreadable spec
 * or config file, an odd container id) goes to Python: never fail closed, never guess "CPU".
 *
 * Settings are read as torpor.config reads them, only the two the front needs:
 * TORPOR_OCI_RUNTIME / TORPOR_RUN_DIR, else the config file ($TORPOR_CONFIG, default
 * /etc/torpor/config.toml) keys oci_runtime / run_dir, else runc / /run/torpor. The Python
 * side is torpor-runtime-py next to this binary (its real path), $TORPOR_RUNTIME_PY if set.
 * TORPOR_DEBUG=1: one line on stderr says where each call went and why.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SEARCH_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define DEFAULT_CONFIG "/etc/torpor/config.toml"
#define DEFAULT_RUN_DIR "/run/torpor"
#define PY_NAME "torpor-runtime-py"
#define MAX_SPEC (64 << 20)	/* a bigger config.json is odd: Python (oci.MAX_SPEC) decides */
#define MAX_CONFIG (1 << 20)
#define MAX_ID 128

static bool debug;

static void say(const char *fmt, ...)
{
	va_list ap;

	if (!debug)
		return;
	va_start(ap, fmt);
	fputs("torpor-runtime(front): ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

/* ---- runc's command line: urfave/cli v1 over Go's flag package ------------------------ */

/*
 * Options that take a value, per command; every other option a command accepts is listed
 * as a flag. An option in neither list is one runc (this or a newer release) may not have:
 * the call goes to Python. Names hold the long and short forms (urfave registers both).
 */
struct command {
	const char *name;
	const char *const *values;
	const char *const *flags;
	bool reorder;	/* urfave moves options after the id to the front (not exec, ps) */
};

#define LIST(...) ((const char *const[]){ __VA_ARGS__, NULL })
static const char *const NONE[] = { NULL };

static const char *const GLOBAL_VALUES[] = { "log", "log-format", "root", "criu", "rootless",
					     NULL };
static const char *const GLOBAL_FLAGS[] = { "debug", "systemd-cgroup", "help", "h", "version",
					    "v", NULL };

static const struct command COMMANDS[] = {
	{ "create", LIST("bundle", "b", "console-socket", "pid-file", "preserve-fds",
			 "pidfd-socket"),
	  LIST("no-pivot", "no-new-keyring", "help", "h"), true },
	{ "run", LIST("bundle", "b", "console-socket", "pid-file", "preserve-fds", "pidfd-socket"),
	  LIST("detach", "d", "keep", "no-subreaper", "no-pivot", "no-new-keyring", "help", "h"),
	  true },
	{ "delete", NONE, LIST("force", "f", "help", "h"), true },
	{ "start", NONE, LIST("help", "h"), true },
	{ "state", NONE, LIST("help", "h"), true },
	{ "pause", NONE, LIST("help", "h"), true },
	{ "resume", NONE, LIST("help", "h"), true },
	{ "kill", NONE, LIST("all", "a", "help", "h"), true },
	{ "events", LIST("interval"), LIST("stats", "help", "h"), true },
	{ "ps", LIST("format", "f"), LIST("help", "h"), false },
	{ "exec", LIST("console-socket", "pidfd-socket", "cwd", "env", "e", "user", "u",
		       "additional-gids", "g", "process", "p", "pid-file", "process-label",
		       "apparmor", "cap", "c", "preserve-fds", "cgroup"),
	  LIST("tty", "t", "detach", "d", "no-new-privs", "ignore-paused", "help", "h"), false },
	{ "update", LIST("resources", "r", "blkio-weight", "cpu-period", "cpu-quota", "cpu-share",
			 "cpu-rt-period", "cpu-rt-runtime", "cpuset-cpus", "cpuset-mems",
			 "kernel-memory", "kernel-memory-tcp", "memory", "memory-reservation",
			 "memory-swap", "pids-limit", "l3-cache-schema", "mem-bw-schema",
			 "cpu-idle"),
	  LIST("help", "h"), true },
};

/* commands without a container: nothing of torpor's, runc answers */
static const char *const NO_CONTAINER[] = { "list", "spec", "features", "help", "h", NULL };

static bool in(const char *const *names, const char *s, size_t n)
{
	for (; *names; names++)
		if (strlen(*names) == n && !strncmp(*names, s, n))
			return true;
	return false;
}

enum kind { POSITIONAL, END, FLAG, VALUE, UNKNOWN, BAD };

/*
 * One argument as Go's flag package reads it: "-name", "--name", "-name=v", "--name=v";
 * "-" is a positional, "--" ends the options, "---x" and "-=x" are errors. name, len: the
 * option's name; *has_eq: the value is in the same argument.
 */
static enum kind classify(const char *a, const char *const *values, const char *const *flags,
			  const char **name, size_t *len, bool *has_eq)
{
	if (a[0] != '-' || a[1] == '\0')
		return POSITIONAL;
	if (!strcmp(a, "--"))
		return END;
	a += (a[1] == '-') ? 2 : 1;
	if (a[0] == '-' || a[0] == '=')
		return BAD;
	*name = a;
	*len = strcspn(a, "=");
	*has_eq = a[*len] == '=';
	if (in(values, a, *len))
		return VALUE;
	if (in(flags, a, *len))
		return FLAG;
	return UNKNOWN;
}

struct inv {
	int argc;
	char **argv;		/* the program's own argv: argv[0] is us */
	const char *root;	/* --root as given, or NULL */
	const char *command;	/* NULL: none */
	const struct command *cmd;
	const char *id;		/* first positional after the command's options, or NULL */
	const char *bundle;	/* create/run: --bundle / -b, or NULL */
	unsigned global_help;	/* runc answers --help, --version: one bit per name set */
	unsigned command_help;
};

/* urfave registers each name of a flag apart: -h and --help are two flags, either asks */
static const char *const HELP[] = { "help", "h", "version", "v", NULL };

/*
 * A help or version flag as Go's flag package sets it (else nothing): a bare flag is true,
 * "=v" is strconv.ParseBool's, the last one given wins. "--help=false" asks for no help:
 * runc then runs the command. False: a value runc refuses.
 */
static bool help_flag(unsigned *bits, const char *name, size_t len, bool has_eq)
{
	static const char *const YES[] = { "1", "t", "T", "true", "TRUE", "True", NULL };
	static const char *const NO[] = { "0", "f", "F", "false", "FALSE", "False", NULL };
	const char *v = has_eq ? name + len + 1 : "true";

	for (unsigned k = 0; HELP[k]; k++) {
		if (strlen(HELP[k]) != len || strncmp(HELP[k], name, len))
			continue;
		if (in(YES, v, strlen(v)))
			*bits |= 1u << k;
		else if (in(NO, v, strlen(v)))
			*bits &= ~(1u << k);
		else
			return false;
	}
	return true;
}

static void set_opt(struct inv *inv, const char *name, size_t len, const char *value,
		    const char **bundle_b)
{
	if (len == 6 && !strncmp(name, "bundle", 6))
		inv->bundle = value;
	else if (len == 1 && name[0] == 'b')
		*bundle_b = value;
}

/*
 * The command's options and its first positional. Reordering (urfave v1's reorderArgs)
 * moves options written after the id to the front; the id is then the first argument that
 * is no option nor an option's value. It also moves the argument after a flag written without
 * "=" along with it, as if it were the flag's value: in "kill ID --all SIGNAL" runc reads
 * SIGNAL as the id. A second positional right after such a flag, a value that looks like an
 * option, a missing value, both -b and --bundle: odd, returns false.
 */
static bool parse_command(struct inv *inv, int i)
{
	const struct command *c = inv->cmd;
	const char *bundle_b = NULL;
	bool after_flag = false;	/* the argument before is a flag without "=" */

	for (; i < inv->argc; i++) {
		const char *a = inv->argv[i], *name;
		size_t len;
		bool eq;
		enum kind k = classify(a, c->values, c->flags, &name, &len, &eq);

		if (k == END) {
			if (i + 1 < inv->argc && !inv->id)
				inv->id = inv->argv[i + 1];
			break;
		}
		if (k == BAD || k == UNKNOWN)
			return false;
		if (k == POSITIONAL) {
			if (after_flag && inv->id)
				return false;
			if (!inv->id)
				inv->id = a;
			if (!c->reorder)
				break;	/* exec, ps: the rest is the process's argv */
			after_flag = false;
			continue;
		}
		after_flag = k == FLAG && !eq;
		if (k == FLAG) {
			if (!help_flag(&inv->command_help, name, len, eq))
				return false;
			continue;
		}
		/* VALUE */
		if (eq) {
			set_opt(inv, name, len, name + len + 1, &bundle_b);
			continue;
		}
		if (i + 1 >= inv->argc || inv->argv[i + 1][0] == '-')
			return false;
		set_opt(inv, name, len, inv->argv[++i], &bundle_b);
	}
	if (bundle_b && inv->bundle)
		return false;
	if (bundle_b)
		inv->bundle = bundle_b;
	return true;
}

/* runc's global options (no reordering: Go's flag package stops at the command). */
static bool parse(struct inv *inv)
{
	int i;

	for (i = 1; i < inv->argc; i++) {
		const char *a = inv->argv[i], *name;
		size_t len;
		bool eq;
		enum kind k = classify(a, GLOBAL_VALUES, GLOBAL_FLAGS, &name, &len, &eq);

		if (k == POSITIONAL)
			break;
		if (k == END) {
			i++;
			break;
		}
		if (k == BAD || k == UNKNOWN)
			return false;
		if (k == FLAG) {
			if (!help_flag(&inv->global_help, name, len, eq))
				return false;
			continue;
		}
		if (!eq) {
			if (i + 1 >= inv->argc || inv->argv[i + 1][0] == '-')
				return false;
			i++;
		}
		if (len == 4 && !strncmp(name, "root", 4))
			inv->root = eq ? name + len + 1 : inv->argv[i];
	}
	if (i >= inv->argc)
		return true;	/* no command: --version, --help */
	inv->command = inv->argv[i];
	for (size_t n = 0; n < sizeof(COMMANDS) / sizeof(COMMANDS[0]); n++)
		if (!strcmp(COMMANDS[n].name, inv->command))
			inv->cmd = &COMMANDS[n];
	if (!inv->cmd)
		return true;
	return parse_command(inv, i + 1);
}

/* ---- settings: torpor.config's lookup of oci_runtime and run_dir ------------------------ */

struct settings {
	char oci_runtime[PATH_MAX];
	char run_dir[PATH_MAX];
};

/* a regular file's bytes, NUL-terminated; NULL and *err if it cannot be read (a FIFO or a
 * device is refused at once: reading one could block the engine) */
static char *read_file(const char *path, size_t max, size_t *size, int *err)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	char *buf = NULL;
	size_t n = 0, cap = 0;
	struct stat st;

	*err = 0;
	if (fd < 0) {
		*err = errno;
		return NULL;
	}
	if (fstat(fd, &st))
		goto fail;
	if (!S_ISREG(st.st_mode)) {
		errno = EINVAL;
		goto fail;
	}
	for (;;) {
		ssize_t r;

		if (n + 1 >= cap) {
			char *nb;

			if (cap > max)
				goto too_big;
			cap = cap ? cap * 2 : 65536;
			nb = realloc(buf, cap);
			if (!nb)
				goto fail;
			buf = nb;
		}
		r = read(fd, buf + n, cap - n - 1);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			goto fail;
		}
		if (r == 0)
			break;
		n += (size_t)r;
	}
	if (n > max)
		goto too_big;
	close(fd);
	buf[n] = '\0';
	*size = n;
	return buf;
too_big:
	errno = EFBIG;
fail:
	*err = errno ? errno : EIO;
	close(fd);
	free(buf);
	return NULL;
}

/*
 * One config line "key = value": 1 if it set one of ours, 0 if another key or none, -1 if
 * the front cannot read it for sure (tables, dotted or quoted keys, multi-line values,
 * escapes in our values): then Python reads the file.
 */
static int config_line(char *line, struct settings *s, bool *seen_rt, bool *seen_rd)
{
	char *p = line, *key, *v, *end;
	size_t klen;
	char q;

	while (*p == ' ' || *p == '\t')
		p++;
	if (*p == '\0' || *p == '#')
		return 0;
	key = p;
	while ((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') ||
	       *p == '_' || *p == '-')
		p++;
	klen = (size_t)(p - key);
	if (!klen)
		return -1;
	while (*p == ' ' || *p == '\t')
		p++;
	if (*p++ != '=')
		return -1;
	while (*p == ' ' || *p == '\t')
		p++;
	v = p;
	if (strstr(v, "\"\"\"") || strstr(v, "'''"))
		return -1;
	bool ours_rt = klen == 11 && !strncmp(key, "oci_runtime", 11);
	bool ours_rd = klen == 7 && !strncmp(key, "run_dir", 7);

	if (!ours_rt && !ours_rd) {
		/* numbers, booleans, one-line strings: the rest of Config's keys */
		if (*v == '[' || *v == '{' || *v == '\0')
			return -1;
		if (*v == '"') {
			for (p = v + 1; *p && *p != '"'; p++)
				if (*p == '\\' && !*++p)
					return -1;
			return *p == '"' ? 0 : -1;
		}
		if (*v == '\'')
			return strchr(v + 1, '\'') ? 0 : -1;
		return 0;
	}
	q = *v;
	if (q != '"' && q != '\'')
		return -1;
	end = strchr(v + 1, q);
	if (!end || (q == '"' && memchr(v + 1, '\\', (size_t)(end - v - 1))))
		return -1;
	for (p = end + 1; *p == ' ' || *p == '\t'; p++)
		;
	if (*p != '\0' && *p != '#')
		return -1;
	if ((size_t)(end - v - 1) >= PATH_MAX)
		return -1;
	if ((ours_rt && *seen_rt) || (ours_rd && *seen_rd))
		return -1;	/* TOML forbids it: Python says so */
	*end = '\0';
	strcpy(ours_rt ? s->oci_runtime : s->run_dir, v + 1);
	*(ours_rt ? seen_rt : seen_rd) = true;
	return 1;
}

static bool load_settings(struct settings *s)
{
	const char *path = getenv("TORPOR_CONFIG");
	const char *env_rt = getenv("TORPOR_OCI_RUNTIME"), *env_rd = getenv("TORPOR_RUN_DIR");
	bool seen_rt = false, seen_rd = false;
	size_t size;
	int err;
	char *text, *line, *next;

	strcpy(s->oci_runtime, "runc");
	strcpy(s->run_dir, DEFAULT_RUN_DIR);
	if (!path)
		path = DEFAULT_CONFIG;
	if (!*path)
		return false;
	text = read_file(path, MAX_CONFIG, &size, &err);
	if (!text && err != ENOENT) {
		say("config %s: %s", path, strerror(err));
		return false;
	}
	if (text) {
		if (strlen(text) != size) {
			free(text);
			return false;
		}
		for (line = text; line; line = next) {
			next = strchr(line, '\n');
			if (next)
				*next++ = '\0';
			size_t n = strlen(line);
			if (n && line[n - 1] == '\r')
				line[n - 1] = '\0';
			if (config_line(line, s, &seen_rt, &seen_rd) < 0) {
				say("config %s: a line the front does not read", path);
				free(text);
				return false;
			}
		}
		free(text);
	}
	if (env_rt && *env_rt) {
		if (strlen(env_rt) >= PATH_MAX)
			return false;
		strcpy(s->oci_runtime, env_rt);
	}
	if (env_rd && *env_rd) {
		if (strlen(env_rd) >= PATH_MAX)
			return false;
		strcpy(s->run_dir, env_rd);
	}
	return *s->oci_runtime != '\0' && *s->run_dir != '\0';
}

/* ---- where runc and the Python side are ------------------------------------------------ */

static bool executable_file(const char *path)
{
	struct stat st;

	return !stat(path, &st) && !S_ISDIR(st.st_mode) && !access(path, X_OK);
}

/* shutil.which over $PATH:SEARCH_PATH, as torpor.runtime.runc.find_runtime searches */
static bool which(const char *name, char *out)
{
	const char *env = getenv("PATH");
	size_t n = (env ? strlen(env) : 0) + sizeof(SEARCH_PATH) + 1;
	char *path = malloc(n), *dir, *save = NULL;
	bool found = false;

	if (!path)
		return false;
	snprintf(path, n, "%s:%s", env ? env : "", SEARCH_PATH);
	/* strtok would skip empty entries: shutil.which reads them as the current directory */
	for (dir = path; dir && !found; dir = save) {
		save = strchr(dir, ':');
		if (save)
			*save++ = '\0';
		int r = *dir ? snprintf(out, PATH_MAX, "%s/%s", dir, name)
			     : snprintf(out, PATH_MAX, "%s", name);
		found = r > 0 && r < PATH_MAX && executable_file(out);
	}
	free(path);
	return found;
}

static bool find_runc(const char *name, char *out)
{
	char real[PATH_MAX], self[PATH_MAX];
	const char *base;

	if (strchr(name, '/')) {
		if (strlen(name) >= PATH_MAX || access(name, X_OK))
			return false;
		strcpy(out, name);
	} else if (!which(name, out)) {
		return false;
	}
	/* never ourselves: the Python side refuses it with one clear line */
	base = strrchr(out, '/');
	base = base ? base + 1 : out;
	if (!strncmp(base, "torpor-runtime", 14))
		return false;
	if (realpath(out, real) && realpath("/proc/self/exe", self) && !strcmp(real, self))
		return false;
	return true;
}

static bool find_python(char *out)
{
	const char *env = getenv("TORPOR_RUNTIME_PY");
	char self[PATH_MAX], *slash;

	if (env && *env) {
		if (strlen(env) >= PATH_MAX) {
			errno = ENAMETOOLONG;	/* the error line says why, not a stale errno */
			return false;
		}
		strcpy(out, env);
		return true;
	}
	if (realpath("/proc/self/exe", self) && (slash = strrchr(self, '/'))) {
		*slash = '\0';
		if (snprintf(out, PATH_MAX, "%s/%s", self, PY_NAME) < PATH_MAX &&
		    executable_file(out))
			return true;
	}
	return which(PY_NAME, out);
}

/* ---- what torpor has to do with ------------------------------------------------------- */

static const char *const NEEDLES[] = { "/dev/nvidia", "NVIDIA_VISIBLE_DEVICES", "nvidia.com/gpu",
				       "org.torpor.", NULL };

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/*
 * Whether a spec may concern torpor: a needle in its bytes, or an escape that decodes to a
 * character of one (JSON may write "/dev/nvidia0" as "\/dev\/nvidia0" or "\u002fdev...";
 * Go's encoder escapes only <, > and &, which are in none).
 */
static const char *spec_mentions(const char *buf, size_t n)
{
	for (const char *const *w = NEEDLES; *w; w++)
		if (memmem(buf, n, *w, strlen(*w)))
			return *w;
	for (const char *p = memchr(buf, '\\', n); p; p = memchr(p, '\\', n - (size_t)(p - buf))) {
		size_t left = n - (size_t)(p - buf);

		if (left < 2)
			return "a trailing backslash";
		if (p[1] == 'u') {
			int cp = 0;

			if (left < 6)
				return "a short \\u escape";
			for (int k = 2; k < 6; k++) {
				int h = hexval(p[k]);

				if (h < 0)
					return "a bad \\u escape";
				cp = cp * 16 + h;
			}
			for (const char *const *w = NEEDLES; *w; w++)
				if (cp > 0 && cp < 128 && strchr(*w, cp))
					return "a \\u escape of a character torpor looks for";
			p += 6;
		} else if (p[1] == '/') {
			return "an escaped /";
		} else {
			p += 2;	/* \" \\ \b \f \n \r \t: none is in a needle */
		}
		if (p >= buf + n)
			break;
	}
	return NULL;
}

/* create/run: the spec decides (NULL: not ours); why is set when it goes to Python */
static bool create_concerns_torpor(const struct inv *inv, const char **why)
{
	char path[PATH_MAX];
	const char *bundle = inv->bundle && *inv->bundle ? inv->bundle : ".";
	size_t size;
	int err;
	char *spec;

	if (snprintf(path, sizeof(path), "%s/config.json", bundle) >= (int)sizeof(path)) {
		*why = "bundle path too long";
		return true;
	}
	spec = read_file(path, MAX_SPEC, &size, &err);
	if (!spec) {
		*why = "spec unreadable";
		say("%s: %s", path, strerror(err));
		return true;
	}
	*why = spec_mentions(spec, size);
	free(spec);
	return *why != NULL;
}

/* a container id fit to name a file (torpor.oci.validate_container_id) */
static bool valid_id(const char *id)
{
	size_t n = strlen(id);

	if (n < 1 || n > MAX_ID || strstr(id, "..") || !strcmp(id, "."))
		return false;
	return strspn(id, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-") == n;
}

/*
 * The key of a runtime root in a marker's name: FNV-1a 64 of the bytes of --root as
 * normalized ("" for none, runc's default root), or as given (raw) as torpor keyed it before
 * it normalized roots. Normalized lexically: repeated '/' collapsed, '.' components and a
 * trailing '/' dropped, '..' and links left as they are; "/" stays "/", a relative root of
 * '.' only reads ".". markers.root_key and raw_key compute the same, bit for bit.
 */
#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL

static void fnv_bytes(uint64_t *h, const char *s, size_t n)
{
	for (size_t k = 0; k < n; k++) {
		*h ^= (unsigned char)s[k];
		*h *= FNV_PRIME;
	}
}

static uint64_t root_key(const char *root, bool raw)
{
	uint64_t h = FNV_OFFSET;
	bool any = false;

	if (raw || !*root) {
		fnv_bytes(&h, root, strlen(root));
		return h;
	}
	if (*root == '/')
		fnv_bytes(&h, "/", 1);
	for (const char *p = root; *p;) {
		size_t n = strcspn(p, "/");

		if (n && !(n == 1 && *p == '.')) {
			if (any)
				fnv_bytes(&h, "/", 1);
			fnv_bytes(&h, p, n);
			any = true;
		}
		p += n;
		p += strspn(p, "/");
	}
	if (*root != '/' && !any)
		fnv_bytes(&h, ".", 1);
	return h;
}

/* 1: the file is there (of any kind: Python reads it); 0: it is not; -1: cannot tell */
static int marker_at(const char *path)
{
	struct stat st;

	if (!lstat(path, &st))
		return 1;
	return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
}

/*
 * true: the container has a marker under this root (by its normal form, or as given where
 * that differs: an earlier torpor's), an earlier torpor's marker under any root (its JSON
 * names the root: Python reads it), or the front cannot tell. A key shared by two roots only
 * sends the other root's calls through Python.
 */
static bool has_marker(const struct settings *s, const char *root, const char *id,
		       const char **why)
{
	char path[PATH_MAX];
	uint64_t key, raw;
	int r;

	if (!valid_id(id)) {
		*why = "container id torpor cannot name a file after";
		return true;
	}
	root = root ? root : "";
	key = root_key(root, false);
	raw = root_key(root, true);
	for (int k = 0; k < (raw == key ? 1 : 2); k++) {
		if (snprintf(path, sizeof(path), "%s/containers/%s@%016" PRIx64, s->run_dir, id,
			     k ? raw : key) >= (int)sizeof(path)) {
			*why = "marker path too long";
			return true;
		}
		say("marker %s", path);
		r = marker_at(path);
		if (r) {
			*why = r < 0 ? "marker unreadable"
				     : k ? "marker of an unnormalized root" : "marker";
			return true;
		}
	}
	snprintf(path, sizeof(path), "%s/containers/%s", s->run_dir, id);	/* shorter: fits */
	r = marker_at(path);
	if (r) {
		*why = r > 0 ? "marker of an earlier torpor" : "marker unreadable";
		return true;
	}
	return false;
}

/* where the call goes; why: a few words for TORPOR_DEBUG */
static bool to_python(struct inv *inv, const struct settings *s, const char **why)
{
	if (!inv->command || inv->global_help || inv->command_help) {
		*why = inv->command ? "help" : "no command";
		return false;
	}
	if (!inv->cmd) {
		for (const char *const *c = NO_CONTAINER; *c; c++)
			if (!strcmp(*c, inv->command)) {
				*why = "no container";
				return false;
			}
		/* checkpoint, restore; a command this front does not know */
		*why = !strcmp(inv->command, "checkpoint") || !strcmp(inv->command, "restore")
			       ? "checkpoint/restore"
			       : "command the front does not know";
		return true;
	}
	if (!strcmp(inv->command, "create") || !strcmp(inv->command, "run")) {
		if (create_concerns_torpor(inv, why))
			return true;
		*why = "spec mentions nothing of torpor's";
		return false;
	}
	if (!inv->id) {
		*why = "no container id";
		return false;	/* runc says what is missing */
	}
	if (has_marker(s, inv->root, inv->id, why))
		return true;
	*why = "no marker";
	return false;
}

static void exec_with(const char *path, struct inv *inv)
{
	inv->argv[0] = (char *)path;
	execv(path, inv->argv);
}

int main(int argc, char **argv)
{
	struct inv inv = { .argc = argc, .argv = argv };
	struct settings s;
	char runc[PATH_MAX], py[PATH_MAX];
	const char *why = "";
	const char *dbg = getenv("TORPOR_DEBUG");
	bool python;

	debug = dbg && *dbg && strcmp(dbg, "0");
	if (!parse(&inv)) {
		python = true;
		why = "command line the front does not read";
	} else if (!load_settings(&s)) {
		python = true;
		why = "settings the front does not read";
	} else if (!find_runc(s.oci_runtime, runc)) {
		python = true;
		why = "OCI runtime not found or torpor-runtime itself";
	} else {
		python = to_python(&inv, &s, &why);
	}
	if (!python) {
		say("%s %s: runc (%s)", inv.command ? inv.command : "-", inv.id ? inv.id : "-", why);
		exec_with(runc, &inv);
		why = "exec of the OCI runtime failed";
	}
	say("%s %s: python (%s)", inv.command ? inv.command : "-", inv.id ? inv.id : "-", why);
	if (find_python(py))
		exec_with(py, &inv);
	fprintf(stderr, "torpor-runtime: error: cannot run %s (%s): reinstall torpor\n", PY_NAME,
		strerror(errno ? errno : ENOENT));
	return 1;
}
