// SPDX-License-Identifier: Apache-2.0
/*
 * to-ebpf's destroy of connected UDP sockets whose endpoint is gone (Linux 6.5+: the
 * bpf_sock_destroy kfunc, callable from iter/udp programs).
 *
 * sockets.bpf.c translates a connected UDP socket at connect only when kpng loaded this object
 * too: such a socket would otherwise stay on its endpoint for good, where kube-proxy's conntrack
 * entry moves to another endpoint. kpng runs the iterator in every network namespace that has
 * processes in the cgroup (a udp iterator walks the sockets of the namespace its reader was in
 * when it was created) after each change that may take an endpoint from a UDP service. The
 * iterator destroys a connected socket that sockets.bpf.c translated (kpng_revnat has its
 * cookie and peer) and whose endpoint no longer serves its frontend: the test that decides
 * whether an unconnected flow keeps its endpoint, on the maps as kpng just wrote them. A socket
 * connected to a pod IP directly has no kpng_revnat entry and is never touched. The
 * application gets ECONNABORTED from its next receive (or EDESTADDRREQ from its next send, the
 * socket being disconnected) and connects again, to a live endpoint: glibc's resolver does.
 *
 * A separate object from sockets.bpf.c because it reads kernel structs, relocated against the
 * running kernel's BTF (CO-RE), and calls a kfunc: libbpf then needs /sys/kernel/btf/vmlinux
 * to load any program of the object. sockets.bpf.o alone needs neither, and loads where this
 * one does not (an older kernel, no BTF, no CAP_PERFMON), as it did before this object existed.
 *
 * The maps are sockets.bpf.c's, reused from their pins, as maps.bpf.h defines them for both.
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.bpf.h"

#define AF_INET 2
#define AF_INET6 10
#define SK_CONNECTED 1 /* TCP_ESTABLISHED: what connect makes of a UDP socket */

/* The kernel's structs, reduced to the fields read: preserve_access_index has libbpf find
 * each field by name in the running kernel's BTF, wherever the kernel puts it. */
struct sock_common {
	__be32 skc_daddr;
	__be16 skc_dport;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	struct in6_addr skc_v6_daddr;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
} __attribute__((preserve_access_index));

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
} __attribute__((preserve_access_index));

struct udp_sock;

struct bpf_iter__udp {
	struct bpf_iter_meta *meta;
	struct udp_sock *udp_sk;
} __attribute__((preserve_access_index));

/* __weak: a kernel without it refuses the program (kpng then leaves connected UDP to the
 * nftables part), rather than libbpf failing to open the object. */
extern int bpf_sock_destroy(struct sock_common *sk) __ksym __weak;

/* Whether the endpoint a socket was given for this frontend still serves it: the frontend is
 * still there and the endpoint is a member of its serving set (as in pick_for_send). */
static __always_inline int serves(const struct revnat_value *front, const struct endpoint *ep)
{
	struct frontend_key key = {.addr = front->addr, .port = front->port,
				   .proto = IPPROTO_UDP};
	struct frontend *fe = bpf_map_lookup_elem(&kpng_frontends, &key);
	if (!fe)
		return 0;
	struct member_key mkey = {.set = fe->serving ? fe->serving : fe->set, .ep = *ep};
	return mkey.set && bpf_map_lookup_elem(&kpng_members, &mkey);
}

/* Writes the cookie of each socket destroyed, for kpng to count. */
SEC("iter/udp")
int kpng_udp_destroy(struct bpf_iter__udp *ctx)
{
	struct sock *sk = (struct sock *)ctx->udp_sk;
	if (!sk || sk->__sk_common.skc_state != SK_CONNECTED)
		return 0;
	struct revnat_key rkey = {.cookie = bpf_get_socket_cookie(sk)};
	if (sk->__sk_common.skc_family == AF_INET) {
		rkey.ep.addr.w[2] = bpf_htonl(0xffff);
		rkey.ep.addr.w[3] = sk->__sk_common.skc_daddr;
	} else if (sk->__sk_common.skc_family == AF_INET6) {
		/* A dual-stack socket connected to an IPv4 address has it mapped here, as the key. */
		rkey.ep.addr.w[0] = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[0];
		rkey.ep.addr.w[1] = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[1];
		rkey.ep.addr.w[2] = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[2];
		rkey.ep.addr.w[3] = sk->__sk_common.skc_v6_daddr.in6_u.u6_addr32[3];
	} else {
		return 0;
	}
	rkey.ep.port = sk->__sk_common.skc_dport;
	struct revnat_value *front = bpf_map_lookup_elem(&kpng_revnat, &rkey);
	if (!front || serves(front, &rkey.ep))
		return 0;
	if (bpf_sock_destroy((struct sock_common *)sk) == 0)
		bpf_seq_write(ctx->meta->seq, &rkey.cookie, sizeof(rkey.cookie));
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
