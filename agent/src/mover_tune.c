/* The mover's tuning (issue 20, "close to the copy limit"): the choices that decide how fast GPU
 * memory reaches host memory, each settable from the program's environment so that they can be
 * measured side by side on a GPU host (bench/mover_sweep.py) without a rebuild. Read once, when
 * the agent starts its control socket; a value that is not one of those listed is ignored with
 * a warning (the default stays). The defaults are the mover as it was measured best so far.
 *
 *   TORPOR_AGENT_MOVER_BUFFERS=N      pinned staging buffers (and streams) a worker, 2-8 (2):
 *                                     N chunks in flight a worker (N x 32 MiB pinned each)
 *   TORPOR_AGENT_MOVER_WORKERS=N      workers of a save into the agent's own memory, 1-16
 *                                     (default: one a CPU); into files: one a file, as torpor
 *                                     gives them (config agent_files)
 *   TORPOR_AGENT_MOVER_SINK=staged    the GPU copies into pinned staging buffers, and the
 *                                     worker copies those into the sink (default)
 *                          direct     each chunk's place in the sink (the file mapped shared,
 *                                     or the region) is registered with the driver and the
 *                                     GPU copies straight into it; unregistered when done
 *                          direct-whole  the whole sink mapped with MAP_POPULATE and
 *                                     registered once by its worker, then copied straight into
 *                                     (a sparse file's holes get pages of zeros)
 *                                     Where a mapping or a registration is refused, the chunk
 *                                     goes staged (one warning).
 *   TORPOR_AGENT_MOVER_CHECK=host     every part is summed (XXH3) on the host on its way out
 *                                     and checked on its way back
 *                            gpu      (default: bench/mover_sweep.py on the H200, 16 GiB:
 *                                     suspend 1.04 s against the host sums' 1.27 s, the copy
 *                                     32-37 GB/s against 20-23) no host pass over the data: every part is fingerprinted
 *                                     on the GPU before the copy (the zero scan's pass) and
 *                                     checked on the GPU after the reload (on the CPU from the
 *                                     sink if the kernel cannot run then). Saves without an
 *                                     index or a stream only: the image store's own rules stay.
 *   TORPOR_AGENT_MOVER_REGION_HUGE=1  the agent's memory regions get MADV_HUGEPAGE (default 0)
 *   TORPOR_AGENT_MOVER_PRESIZE=0      data files sized once written, as before, instead of
 *                                     before the first write (default 1: mover.c says why)
 *   TORPOR_AGENT_MOVER_STAGE=part     the staged copies go a part (4 MiB) at a time, each
 *                                     staging buffer one part long (default): on the H200 at
 *                                     16 GiB (bench/mover_sweep.py, 2026-12-05) resume copied at
 *                                     47-49 GB/s against 31-34 with chunks, suspend at 33-35
 *                                     against 28-30 (bench/host_bounds.c's staged shape had
 *                                     said the same: 49.9 against 35.3 GB/s in).
 *                            chunk    a chunk (32 MiB) at a time, as before.
 *   TORPOR_AGENT_MOVER_WRITE=part     a saved part goes to its data file in one pwrite
 *                                     (default): whole huge pages of the tmpfs, which the
 *                                     kernel then need not zero first (mover_workers.c's
 *                                     part_io says why)
 *                            block    SUB (1 MiB) at a time, as before, to measure against
 *                                     A direct sink always copies chunks (asking for part there
 *                                     warns once); a streamed load stages chunks whatever it says.
 */
#define LOG_PREFIX "mover: "
#include "agent.h" /* first: _GNU_SOURCE */

#include <stdio.h>
#include <stdlib.h>

#include "mover.h"

struct mover_tune tune = { .buffers = 2, .workers = 0, .direct = DIRECT_OFF, .gpu_check = 1,
			   .region_huge = 0, .presize = 1, .stage_part = 1,
			   .write_part = 1 };

/* name's value as an integer in [lo, hi] into *out; unset leaves it, anything else warns. */
static void tune_int(const char *name, int lo, int hi, int *out)
{
	const char *v = getenv(name);
	char *end;
	long n;

	if (!v || !*v)
		return;
	errno = 0;
	n = strtol(v, &end, 10);
	if (errno || end == v || *end || n < lo || n > hi) {
		pr_warn("%s=%s is not a whole number from %d to %d: ignored", name, v, lo, hi);
		return;
	}
	*out = (int)n;
}

/* name's value as one of words (index into *out); unset leaves it, anything else warns. */
static void tune_word(const char *name, const char *const *words, int n, int *out)
{
	const char *v = getenv(name);

	if (!v || !*v)
		return;
	for (int i = 0; i < n; i++)
		if (!strcmp(v, words[i])) {
			*out = i;
			return;
		}
	pr_warn("%s=%s is none of %s%s%s%s%s: ignored", name, v, words[0], n > 1 ? ", " : "",
		n > 1 ? words[1] : "", n > 2 ? ", " : "", n > 2 ? words[2] : "");
}

void mover_tune_read(void)
{
	static const char *const sinks[] = { "staged", "direct", "direct-whole" };
	static const char *const checks[] = { "host", "gpu" };
	static const char *const onoff[] = { "0", "1" };
	static const char *const stages[] = { "chunk", "part" };
	static const char *const writes[] = { "block", "part" };
	struct mover_tune t = tune;
	const char *stage_env = getenv("TORPOR_AGENT_MOVER_STAGE");
	int stage_asked = stage_env && !strcmp(stage_env, "part");

	tune_int("TORPOR_AGENT_MOVER_BUFFERS", 2, MAX_BUFFERS, &t.buffers);
	tune_int("TORPOR_AGENT_MOVER_WORKERS", 1, MAX_FILES, &t.workers);
	tune_word("TORPOR_AGENT_MOVER_SINK", sinks, 3, &t.direct);
	tune_word("TORPOR_AGENT_MOVER_CHECK", checks, 2, &t.gpu_check);
	tune_word("TORPOR_AGENT_MOVER_REGION_HUGE", onoff, 2, &t.region_huge);
	tune_word("TORPOR_AGENT_MOVER_PRESIZE", onoff, 2, &t.presize);
	tune_word("TORPOR_AGENT_MOVER_STAGE", stages, 2, &t.stage_part);
	tune_word("TORPOR_AGENT_MOVER_WRITE", writes, 2, &t.write_part);
	if (t.stage_part && t.direct != DIRECT_OFF) {
		/* the default goes quietly; only someone who asked for part is told */
		if (stage_asked)
			pr_warn("TORPOR_AGENT_MOVER_STAGE=part is for a staged sink, not %s: ignored",
				sinks[t.direct]);
		t.stage_part = 0;
	}
	if (memcmp(&t, &tune, sizeof(t)))
		pr_info("tuned: buffers %d, workers %d, sink %s, check %s, region huge pages %s, "
			"files sized %s, staged a %s at a time, written a %s at a time", t.buffers,
			t.workers, sinks[t.direct], checks[t.gpu_check], t.region_huge ? "on" : "off",
			t.presize ? "first" : "last", stages[t.stage_part], writes[t.write_part]);
	tune = t;
}

int mover_gpu_checked(void)
{
	return tune.gpu_check;
}
