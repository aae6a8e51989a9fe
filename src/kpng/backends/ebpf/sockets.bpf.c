// SPDX-License-Identifier: Apache-2.0
/*
 * to-ebpf's socket-level balancing: cgroup sock_addr programs that give a socket an endpoint
 * when it connects to (or sends to) a service address, so that the packets leave already
 * addressed to the endpoint: no per-packet NAT, no conntrack entry for the translation.
 *
 * Maps (every key and value is written by kpng/backends/ebpf/entries.py; keep both in step):
 *   kpng_frontends  (address, port, protocol) -> the endpoint set, affinity memory and timeout
 *   kpng_sets       set id -> how many endpoints it holds
 *   kpng_slots      (set id, index) -> endpoint; the program picks an index below the count
 *   kpng_members    (set id, endpoint) -> present: is a remembered endpoint still in the set
 *   kpng_affinity   (network namespace, affinity id) -> ClientIP affinity memory (LRU)
 *   kpng_flows      (namespace, source port, frontend) -> the endpoint of unconnected UDP sends
 *   kpng_revnat     (socket, endpoint) -> frontend, for getpeername and recvmsg (LRU)
 *   kpng_counters   hook -> translations and lookups that found no endpoint (per CPU; the
 *                   programs count, kpng sums the CPUs for /metrics)
 *   kpng_traffic    frontend -> the connections translated to its endpoints (per CPU), for
 *                   the frontends kpng made an entry for (--traffic-counters service)
 *   kpng_endpoint_traffic  (set id, endpoint) -> the connections the programs gave that
 *                   endpoint of that set (per CPU), for the pairs kpng made an entry for
 *                   (--traffic-counters endpoint)
 *   kpng_locality   0 -> the families whose sockets are translated only in the network
 *                   namespaces of kpng_local_netns (locality.py)
 *   kpng_local_netns  network namespace -> the families local traffic detection counts its
 *                   traffic as the node's pods' for
 *
 * Addresses are 16 bytes, IPv4 as IPv4-mapped IPv6 (::ffff:a.b.c.d), so one map serves both
 * families and a dual-stack socket connecting to a mapped address finds the IPv4 frontend.
 * Ports are in network byte order, as the socket calls carry them. Every key spells out its
 * padding, so that a key built here compares equal to the bytes kpng wrote.
 *
 * udp_destroy.bpf.c, a separate object since it needs the kernel's BTF and Linux 6.5, reads
 * kpng_frontends, kpng_members and kpng_revnat: their structs and definitions are in
 * maps.bpf.h, which both include.
 */
#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.bpf.h"

#define NS_PER_S 1000000000ULL

struct set_info {
	__u32 count;
	__u32 pad;
};

struct slot_key {
	__u64 set;
	__u32 index;
	__u32 pad;
};

struct affinity_key {
	__u64 netns;
	__u64 affinity;
};

struct affinity_value {
	struct endpoint ep;
	__u32 pad;
	__u64 last_ns;
};

struct flow_key {
	__u64 netns;
	struct frontend_key frontend;
	__u16 src_port;
	__u16 pad;
};

struct flow {
	struct endpoint ep;
	__u32 pad;
	__u64 last_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, struct set_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_sets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 2097152);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct slot_key);
	__type(value, struct endpoint);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct affinity_key);
	__type(value, struct affinity_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct flow_key);
	__type(value, struct flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_flows SEC(".maps");

/* Local traffic detection (kube-proxy's --detect-local-mode) decides whether a connection to a
 * service is masqueraded, and whether an external IP with eTP=Local short-circuits it, by its
 * source address or the interface it arrives on: neither exists when a socket connects. kpng
 * decides by the socket's network namespace instead: where detection is set for a family, a
 * socket of that family is translated only if kpng found its namespace local; any other (one
 * kpng has not looked at yet included) is left to the nftables part, which decides by the
 * packet, as kube-proxy does. */
#define LOCAL_V4 1
#define LOCAL_V6 2

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_locality SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u64);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_local_netns SEC(".maps");

/* Set by kpng before the load (libbpf's .rodata, so the verifier drops the code it disables):
 * whether kpng destroys a connected UDP socket once its endpoint is gone, with
 * udp_destroy.bpf.c's iterator in every network namespace of the cgroup. */
const volatile __u32 connected_udp = 0;

/* kpng_counters' keys: one per program, in the order of PROGRAMS in __init__.py. */
enum hook {
	HOOK_CONNECT4,
	HOOK_CONNECT6,
	HOOK_SENDMSG4,
	HOOK_SENDMSG6,
	HOOK_RECVMSG4,
	HOOK_RECVMSG6,
	HOOK_GETPEERNAME4,
	HOOK_GETPEERNAME6,
	HOOKS,
};

struct counters {
	__u64 translated;  /* addresses rewritten: to an endpoint, or back to the frontend */
	__u64 no_endpoint; /* a frontend found with no endpoint: left to the nftables part */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, HOOKS);
	__type(key, __u32);
	__type(value, struct counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_counters SEC(".maps");

/* Per CPU, so no atomic operation: a program is not preempted by another on its CPU. */
static __always_inline struct counters *counters(__u32 hook)
{
	return bpf_map_lookup_elem(&kpng_counters, &hook);
}

/* kpng makes (zeroed) and deletes the entries, with the frontends they count, and only with
 * --traffic-counters service: the programs never add one, so the map holds no more than the
 * frontends, and without the flag a translation costs one lookup that finds nothing. Refused
 * connections (no endpoint) are left untranslated: the nftables part counts them. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct frontend_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_traffic SEC(".maps");

/* Keyed by what the endpoint is, not by its slot: a slot that passes to another endpoint
 * (relayout) never carries one endpoint's count over to the next. kpng makes a zeroed entry
 * for each endpoint of each set a frontend points at, before the slot that exposes it, and
 * deletes it once the endpoint left the set: as for kpng_traffic, the programs never add one,
 * and without --traffic-counters endpoint the map is empty. The set id stands for its service
 * port (entries.py), member_key's layout is the key. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 2097152);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct member_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_endpoint_traffic SEC(".maps");

/* One new connection of this frontend, given the endpoint ep of set (the frontend's). */
static __always_inline void count_connection(const struct frontend_key *key, __u64 set,
					     const struct endpoint *ep)
{
	__u64 *n = bpf_map_lookup_elem(&kpng_traffic, key);
	if (n)
		(*n)++;
	struct member_key ekey = {.set = set, .ep = *ep};
	n = bpf_map_lookup_elem(&kpng_endpoint_traffic, &ekey);
	if (n)
		(*n)++;
}

static __always_inline int l4(const struct bpf_sock_addr *ctx, __u8 *proto)
{
	if (ctx->protocol == IPPROTO_TCP || ctx->protocol == IPPROTO_UDP) {
		*proto = ctx->protocol;
		return 1;
	}
	return 0;
}

/* The socket call's address as 16 bytes (IPv4 mapped), and back. v6 is a constant in each
 * program, so each keeps only its family's accesses to the context. */
static __always_inline void load_addr(const struct bpf_sock_addr *ctx, int v6, struct addr *a)
{
	if (v6) {
		a->w[0] = ctx->user_ip6[0];
		a->w[1] = ctx->user_ip6[1];
		a->w[2] = ctx->user_ip6[2];
		a->w[3] = ctx->user_ip6[3];
	} else {
		a->w[0] = 0;
		a->w[1] = 0;
		a->w[2] = bpf_htonl(0xffff);
		a->w[3] = ctx->user_ip4;
	}
}

static __always_inline void store_addr(struct bpf_sock_addr *ctx, int v6, const struct addr *a)
{
	if (v6) {
		ctx->user_ip6[0] = a->w[0];
		ctx->user_ip6[1] = a->w[1];
		ctx->user_ip6[2] = a->w[2];
		ctx->user_ip6[3] = a->w[3];
	} else {
		ctx->user_ip4 = a->w[3];
	}
}

/* The endpoint a new connection of this network namespace gets: its remembered one while
 * ClientIP affinity holds and the endpoint is still in the set, else a uniform pick. */
static __always_inline int pick(struct bpf_sock_addr *ctx, const struct frontend *fe,
				struct endpoint *out)
{
	struct set_info *info = bpf_map_lookup_elem(&kpng_sets, &fe->set);
	if (!info || info->count == 0)
		return 0;
	struct affinity_key akey = {};
	__u64 now = 0;
	if (fe->affinity) {
		akey.netns = bpf_get_netns_cookie(ctx);
		akey.affinity = fe->affinity;
		now = bpf_ktime_get_ns();
		struct affinity_value *seen = bpf_map_lookup_elem(&kpng_affinity, &akey);
		if (seen && now - seen->last_ns < (__u64)fe->timeout_s * NS_PER_S) {
			struct member_key mkey = {.set = fe->set, .ep = seen->ep};
			if (bpf_map_lookup_elem(&kpng_members, &mkey)) {
				*out = seen->ep;
				seen->last_ns = now;
				return 1;
			}
		}
	}
	struct slot_key skey = {.set = fe->set, .index = bpf_get_prandom_u32() % info->count};
	struct endpoint *ep = bpf_map_lookup_elem(&kpng_slots, &skey);
	if (!ep)
		return 0;
	*out = *ep;
	if (fe->affinity) {
		struct affinity_value remembered = {.ep = *ep, .last_ns = now};
		bpf_map_update_elem(&kpng_affinity, &akey, &remembered, BPF_ANY);
	}
	return 1;
}

/* What getpeername and recvmsg say instead of the endpoint: the frontend it was reached by. */
static __always_inline void remember_frontend(struct bpf_sock_addr *ctx,
					      const struct frontend_key *key,
					      const struct endpoint *ep)
{
	struct revnat_key rkey = {.cookie = bpf_get_socket_cookie(ctx), .ep = *ep};
	struct revnat_value front = {.addr = key->addr, .port = key->port};
	bpf_map_update_elem(&kpng_revnat, &rkey, &front, BPF_ANY);
}

/* Unconnected UDP: each send is translated. Sends from one source port to one frontend are a
 * flow, as conntrack sees them (the port is bound by now: the kernel binds before this hook):
 * the flow keeps its endpoint while that endpoint serves anywhere and the flow is not idle
 * for FLOW_IDLE_NS (conntrack's UDP stream timeout), even across sockets, as kube-proxy's
 * conntrack entries do. */
#define FLOW_IDLE_NS (120 * NS_PER_S)

/* A new flow (a pick) is one connection for kpng_traffic and kpng_endpoint_traffic, as
 * conntrack counts one. */
static __always_inline int pick_for_send(struct bpf_sock_addr *ctx,
					 const struct frontend_key *key,
					 const struct frontend *fe, struct endpoint *out)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk) {
		if (!pick(ctx, fe, out))
			return 0;
		count_connection(key, fe->set, out);
		return 1;
	}
	struct flow_key fkey = {.netns = bpf_get_netns_cookie(ctx), .frontend = *key,
				.src_port = (__u16)sk->src_port};
	__u64 now = bpf_ktime_get_ns();
	struct flow *kept = bpf_map_lookup_elem(&kpng_flows, &fkey);
	if (kept && now - kept->last_ns < FLOW_IDLE_NS) {
		struct member_key mkey = {.set = fe->serving ? fe->serving : fe->set, .ep = kept->ep};
		if (bpf_map_lookup_elem(&kpng_members, &mkey)) {
			*out = kept->ep;
			kept->last_ns = now;
			return 1;
		}
	}
	if (!pick(ctx, fe, out))
		return 0;
	struct flow started = {.ep = *out, .last_ns = now};
	bpf_map_update_elem(&kpng_flows, &fkey, &started, BPF_ANY);
	count_connection(key, fe->set, out);
	return 1;
}

/* Whether detection is set for this connection's family and its namespace is not known local.
 * An IPv4-mapped address is an IPv4 connection, whatever the socket's family. */
static __always_inline int left_to_nftables(struct bpf_sock_addr *ctx, const struct addr *a)
{
	__u32 zero = 0;
	__u32 *checked = bpf_map_lookup_elem(&kpng_locality, &zero);
	__u32 family = (a->w[0] == 0 && a->w[1] == 0 && a->w[2] == bpf_htonl(0xffff)) ? LOCAL_V4
										     : LOCAL_V6;
	if (!checked || !(*checked & family))
		return 0;
	__u64 netns = bpf_get_netns_cookie(ctx);
	__u32 *local = bpf_map_lookup_elem(&kpng_local_netns, &netns);
	return !local || !(*local & family);
}

static __always_inline int translate(struct bpf_sock_addr *ctx, int v6, int send, __u32 hook)
{
	struct frontend_key key = {};
	/* Zeroed: the verifier lets a program read uninitialised stack only with CAP_PERFMON, and
	 * the UDP flow's copy of it may read its padding. */
	struct endpoint ep = {};
	if (!l4(ctx, &key.proto))
		return 1;
	/* A connected UDP socket translated here would stay on its endpoint after that endpoint is
	 * gone, where kube-proxy deletes the flow and the next datagram goes to another endpoint:
	 * it is translated only when kpng destroys it then (the application gets an error and
	 * connects again). Otherwise it is left to the nftables part, whose conntrack entry
	 * moves. */
	if (!send && key.proto == IPPROTO_UDP && !connected_udp)
		return 1;
	load_addr(ctx, v6, &key.addr);
	key.port = (__u16)ctx->user_port;
	struct frontend *fe = bpf_map_lookup_elem(&kpng_frontends, &key);
	/* No frontend, or no endpoint: the packet goes as addressed, and the node's nftables
	 * rules answer it (REJECT or DROP, as for any proxy). */
	if (!fe || left_to_nftables(ctx, &key.addr))
		return 1;
	struct counters *c = counters(hook);
	if (!fe->set || !(send ? pick_for_send(ctx, &key, fe, &ep) : pick(ctx, fe, &ep))) {
		if (c)
			c->no_endpoint++;
		return 1;
	}
	store_addr(ctx, v6, &ep.addr);
	ctx->user_port = ep.port;
	remember_frontend(ctx, &key, &ep);
	if (c)
		c->translated++;
	if (!send)
		count_connection(&key, fe->set, &ep);
	return 1;
}

static __always_inline int reverse(struct bpf_sock_addr *ctx, int v6, __u32 hook)
{
	struct revnat_key rkey = {.cookie = bpf_get_socket_cookie(ctx)};
	load_addr(ctx, v6, &rkey.ep.addr);
	rkey.ep.port = (__u16)ctx->user_port;
	struct revnat_value *front = bpf_map_lookup_elem(&kpng_revnat, &rkey);
	if (front) {
		store_addr(ctx, v6, &front->addr);
		ctx->user_port = front->port;
		struct counters *c = counters(hook);
		if (c)
			c->translated++;
	}
	return 1;
}

SEC("cgroup/connect4")
int kpng_connect4(struct bpf_sock_addr *ctx) { return translate(ctx, 0, 0, HOOK_CONNECT4); }

SEC("cgroup/connect6")
int kpng_connect6(struct bpf_sock_addr *ctx) { return translate(ctx, 1, 0, HOOK_CONNECT6); }

SEC("cgroup/sendmsg4")
int kpng_sendmsg4(struct bpf_sock_addr *ctx) { return translate(ctx, 0, 1, HOOK_SENDMSG4); }

SEC("cgroup/sendmsg6")
int kpng_sendmsg6(struct bpf_sock_addr *ctx) { return translate(ctx, 1, 1, HOOK_SENDMSG6); }

SEC("cgroup/recvmsg4")
int kpng_recvmsg4(struct bpf_sock_addr *ctx) { return reverse(ctx, 0, HOOK_RECVMSG4); }

SEC("cgroup/recvmsg6")
int kpng_recvmsg6(struct bpf_sock_addr *ctx) { return reverse(ctx, 1, HOOK_RECVMSG6); }

SEC("cgroup/getpeername4")
int kpng_peername4(struct bpf_sock_addr *ctx) { return reverse(ctx, 0, HOOK_GETPEERNAME4); }

SEC("cgroup/getpeername6")
int kpng_peername6(struct bpf_sock_addr *ctx) { return reverse(ctx, 1, HOOK_GETPEERNAME6); }

char LICENSE[] SEC("license") = "Dual BSD/GPL";
