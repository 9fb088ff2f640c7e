/*
 * torpor-pause: the pod sandbox's process for containerd 2.x's CRI plugin, built here
 * (gcc -static) because the machines torpor is tested on cannot pull registry.k8s.io/pause.
 *
 * What the kubelet's pause does and nothing more: hold the pod's namespaces by staying
 * alive, reap orphans (it is PID 1 of the pod when the PID namespace is shared), and exit
 * 0 on SIGINT/SIGTERM (the CRI plugin's StopPodSandbox).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig)
{
	(void)sig;
	_exit(0);
}

static void on_child(int sig)
{
	int saved = errno;

	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
	errno = saved;
}

int main(int argc, char **argv)
{
	struct sigaction stop = { .sa_handler = on_stop };
	struct sigaction child = { .sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART };

	if (argc > 1 && strcmp(argv[1], "-v") == 0) {
		puts("torpor-pause 1");
		return 0;
	}
	if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
	    sigaction(SIGCHLD, &child, NULL) < 0) {
		perror("torpor-pause: sigaction");
		return 1;
	}
	if (getpid() != 1)
		fputs("torpor-pause: warning: not PID 1\n", stderr);
	for (;;)
		pause();
}
