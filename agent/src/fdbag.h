/* A bag of descriptors: more than one message can carry (the kernel's SCM_MAX_FD is 253) as
 * one descriptor. The bag is one end of a SOCK_SEQPACKET pair whose queue holds them, at most
 * FDBAG_BATCH a message (one byte "h" each); the other end is closed once they are in, so the
 * bag reads to its end. Whoever has the bag has them: in flight, the kernel keeps each one
 * open. Held memory past HOLD_DIRECT allocations travels this way (agent/PROTOCOL.md, "Held
 * memory"): in `detach hold`'s reply, `resume held=N`, `hold N` and the copier's go.
 *
 * Header-only: the agent (control.c) and torpor-copier (copier/copier.c, a program of its
 * own) both include it. shim/torpor/fdbag.py is the same for torpor. */
#ifndef TORPOR_FDBAG_H
#define TORPOR_FDBAG_H

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define FDBAG_BATCH 240
#define FDBAG_SO_PASSPIDFD 76 /* <asm-generic/socket.h>, Linux 6.5: not in older headers */
#define FDBAG_SCM_PIDFD 0x04

/* A bag holding duplicates of fds[0..n) (the caller keeps and closes its own); -1 with errno
 * (EMSGSIZE: the bag's queue is full; ETOOMANYREFS: this user's descriptors in flight are
 * past its limit on open files). Never blocks. */
static inline int fdbag_pack(const int *fds, int n)
{
	int sv[2];

	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	for (int at = 0; at < n;) {
		int k = n - at < FDBAG_BATCH ? n - at : FDBAG_BATCH;
		union {
			char buf[CMSG_SPACE(sizeof(int) * FDBAG_BATCH)];
			struct cmsghdr align;
		} u;
		struct iovec iov = { (void *)"h", 1 };
		struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
				    .msg_controllen = CMSG_SPACE(sizeof(int) * k) };
		struct cmsghdr *cm;
		ssize_t r;

		memset(u.buf, 0, sizeof(u.buf));
		cm = CMSG_FIRSTHDR(&m);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int) * k);
		memcpy(CMSG_DATA(cm), fds + at, sizeof(int) * k);
		do
			r = sendmsg(sv[0], &m, MSG_DONTWAIT | MSG_NOSIGNAL);
		while (r < 0 && errno == EINTR);
		if (r != 1) {
			int err = r < 0 ? (errno == EAGAIN ? EMSGSIZE : errno) : EIO;

			close(sv[0]);
			close(sv[1]); /* what was in it closes with it */
			errno = err;
			return -1;
		}
		at += k;
	}
	close(sv[0]);
	return sv[1];
}

/* Exactly want descriptors out of bag (someone else's: nothing in it is trusted) into out[],
 * in the order they went in, close-on-exec; 0, or -1 with why (whatever came out is closed;
 * the bag is the caller's to close either way). Never blocks: a bag whose other end is still
 * open reads to what is queued. */
static inline int fdbag_unpack(int bag, int *out, int want, char *why, size_t whysize)
{
	int got = 0, type = 0, messages = 0, off = 0;
	socklen_t tl = sizeof(type);

	if (getsockopt(bag, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || type != SOCK_SEQPACKET) {
		snprintf(why, whysize, "the bag of held descriptors is not a SOCK_SEQPACKET socket");
		return -1;
	}
	/* its maker may have asked the kernel for a pidfd with every message (SO_PASSPIDFD,
	 * Linux 6.5): not on our reads (and any that comes anyway is closed below) */
	setsockopt(bag, SOL_SOCKET, FDBAG_SO_PASSPIDFD, &off, sizeof(off));
	for (;;) {
		union {
			char buf[CMSG_SPACE(sizeof(int) * 253)];
			struct cmsghdr align;
		} u;
		char byte;
		struct iovec iov = { &byte, 1 };
		struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
				    .msg_controllen = sizeof(u.buf) };
		ssize_t r;
		int over = 0;

		do
			r = recvmsg(bag, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		while (r < 0 && errno == EINTR);
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			break;
		if (r < 0) {
			snprintf(why, whysize, "reading the bag of held descriptors: %s",
				 strerror(errno));
			goto fail;
		}
		for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
			size_t k;

			if (cm->cmsg_level != SOL_SOCKET)
				continue;
			k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			if (cm->cmsg_type == FDBAG_SCM_PIDFD) { /* a descriptor all the same: closed */
				for (size_t i = 0; i < k; i++) {
					int fd;

					memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
					close(fd);
				}
				continue;
			}
			if (cm->cmsg_type != SCM_RIGHTS)
				continue;
			for (size_t i = 0; i < k; i++) {
				int fd;

				memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
				if (got < want)
					out[got++] = fd;
				else {
					close(fd);
					over = 1;
				}
			}
		}
		if (r == 0 && !over && !(m.msg_flags & MSG_CTRUNC))
			break; /* its end */
		/* each message carries one descriptor at least: a bag that goes on and on (its
		 * other end still filling it) is not read for ever */
		if (over || (m.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) || ++messages > want) {
			snprintf(why, whysize, "the bag holds more than %d descriptors, or was cut short "
				 "(a limit on open files?)", want);
			goto fail;
		}
	}
	if (got != want) {
		snprintf(why, whysize, "the bag holds %d descriptors, not %d", got, want);
		goto fail;
	}
	return 0;
fail:
	while (got)
		close(out[--got]);
	return -1;
}

#endif
