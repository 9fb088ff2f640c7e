/* agent_plain.c as a library: its main() runs from a constructor, and the process exits with
 * its code. For tests/unit/test_agent_glibc.py, which loads it (LD_PRELOAD, after the agent)
 * into a program of an older glibc's own (its getconf): a program built on this host would
 * need this host's glibc from its start files on.
 *
 *   cc -shared -fPIC -Dmain=agent_plain_main -o agent_plain_ctor.so agent_plain.c \
 *      agent_plain_ctor.c -l:libcuda.so.1 -ldl
 */
#include <stdlib.h>

int agent_plain_main(void);

__attribute__((constructor)) static void run_agent_plain(void)
{
	exit(agent_plain_main());
}
