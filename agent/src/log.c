/* Logging to stderr, "torpor-agent[<pid>]: <file prefix>message", at or above
 * TORPOR_AGENT_LOG_LEVEL (Python logging numbers: 10 debug, 20 info, 30 warning (default),
 * 40 error; the names are accepted too). One write(2) a line, so that lines of several
 * threads and processes do not mix.
 */
#include "agent.h" /* first: _GNU_SOURCE */

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static int log_level = -1; /* read from the environment at the first message */

static int parse_level(const char *s)
{
	static const struct { const char *name; int level; } names[] = {
		{ "debug", LOG_DEBUG }, { "info", LOG_INFO },   { "warning", LOG_WARNING },
		{ "warn", LOG_WARNING }, { "error", LOG_ERROR }, { "critical", 50 },
	};
	char *end;
	long v;

	if (!s || !*s)
		return LOG_WARNING;
	v = strtol(s, &end, 10);
	if (end != s && *end == 0)
		return (int)v;
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!strcasecmp(s, names[i].name))
			return names[i].level;
	return LOG_WARNING;
}

int agent_log_enabled(int level)
{
	int cur = __atomic_load_n(&log_level, __ATOMIC_RELAXED);

	if (cur < 0) { /* a race here only parses the same variable twice */
		cur = parse_level(getenv("TORPOR_AGENT_LOG_LEVEL"));
		__atomic_store_n(&log_level, cur, __ATOMIC_RELAXED);
	}
	return level >= cur;
}

void agent_log(int level, const char *fmt, ...)
{
	int saved = errno; /* for %m, and the caller's errno is left as it was */
	char buf[1024];
	const char *tag = level >= LOG_ERROR ? "error: " : level >= LOG_WARNING ? "warning: " : "";
	va_list ap;
	int n, m;

	if (!agent_log_enabled(level))
		return;
	n = snprintf(buf, sizeof(buf), "torpor-agent[%d]: %s", (int)getpid(), tag);
	va_start(ap, fmt);
	errno = saved;
	m = vsnprintf(buf + n, sizeof(buf) - n - 1, fmt, ap);
	va_end(ap);
	if (m < 0)
		m = 0;
	n += m;
	if (n > (int)sizeof(buf) - 2)
		n = sizeof(buf) - 2;
	buf[n++] = '\n';
	if (write(STDERR_FILENO, buf, n) < 0) {
		/* nowhere left to report it */
	}
	errno = saved;
}

long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

double env_seconds(const char *name, double def)
{
	const char *s = getenv(name);
	char *end;
	double v;

	if (!s || !*s)
		return def;
	v = strtod(s, &end);
	/* finite and in (0, 1e9] only: inf, nan, 0 or 1e300 would overflow (or zero) the
	 * conversion to milliseconds and reopen the gate at once */
	if (end == s || *end || !(v > 0 && v <= 1e9)) {
		agent_log(LOG_WARNING, "%s=%s is not a number of seconds: using %g", name, s, def);
		return def;
	}
	return v;
}
