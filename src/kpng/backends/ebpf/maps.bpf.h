// SPDX-License-Identifier: Apache-2.0
/*
 * The maps both objects use: kpng writes kpng_frontends and kpng_members (entries.py packs
 * these structs), sockets.bpf.c's programs read them and write kpng_revnat, and
 * udp_destroy.bpf.c reads all three from their pins. One definition, so that the two objects
 * cannot drift apart: libbpf refuses to reuse a pinned map whose type, sizes or flags differ,
 * but not a changed layout of the same size. The toolchain's digests cover this file with each
 * source that includes it.
 */
#ifndef KPNG_MAPS_BPF_H
#define KPNG_MAPS_BPF_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct addr {
	__u32 w[4];
};

struct frontend_key {
	struct addr addr;
	__u16 port;
	__u8 proto;
	__u8 pad;
};

struct frontend {
	__u64 set;      /* 0: the service has no endpoint for this traffic */
	__u64 affinity; /* 0: no ClientIP affinity */
	__u64 serving;  /* UDP: the set of endpoints serving anywhere; 0: the set above */
	__u32 timeout_s;
	__u32 pad;
};

struct endpoint {
	struct addr addr;
	__u16 port;
	__u16 pad;
};

struct member_key {
	__u64 set;
	struct endpoint ep;
	__u32 pad;
};

struct revnat_key {
	__u64 cookie;
	struct endpoint ep;
	__u32 pad;
};

struct revnat_value {
	struct addr addr;
	__u16 port;
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct frontend_key);
	__type(value, struct frontend);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_frontends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 2097152);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct member_key);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_members SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 131072);
	__type(key, struct revnat_key);
	__type(value, struct revnat_value);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kpng_revnat SEC(".maps");

#endif
