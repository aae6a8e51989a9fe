{{/* The image every container runs; the tag defaults to the kpng release of the chart. */}}
{{- define "kpng.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Both have no default: a guess would break every Service of the cluster. */}}
{{- define "kpng.apiServer" -}}
{{ required "apiServer: the API server's real address, e.g. https://10.0.0.1:6443 (not the kubernetes Service: it needs a proxy first)" .Values.apiServer }}
{{- end }}

{{- define "kpng.clusterCIDR" -}}
{{ required "clusterCIDR: the pod CIDRs, comma-separated, e.g. 10.244.0.0/16" .Values.clusterCIDR }}
{{- end }}

{{/* Each shape's ConfigMap has its own name, as in deploy/: switching shapes replaces it. */}}
{{- define "kpng.configMap" -}}
{{ get (dict "daemonset" "kpng" "sidecar" "kpng-sidecar" "central" "kpng-central") .Values.shape }}
{{- end }}

{{/* kpng's backend command for the mode. */}}
{{- define "kpng.backend" -}}
{{ get (dict "nftables" "to-nft" "iptables" "to-iptables" "ebpf" "to-ebpf") .Values.mode }}
{{- end }}

{{/* The backend and its flags, as list items: kube-proxy's defaults (in nftables mode, which
kpng applies in every mode), and to-ebpf's cgroup and object. */}}
{{- define "kpng.backendArgs" -}}
- {{ include "kpng.backend" . }}
- --cluster-cidr={{ include "kpng.clusterCIDR" . }}
- --nodeport-addresses=primary
{{- if eq .Values.mode "ebpf" }}
- --cgroup=/run/kpng/host-cgroup
{{- with .Values.ebpf.bpfObject }}
- --bpf-object={{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The security context of the container that programs the node. NET_ADMIN is all to-nft
and to-iptables use (netlink calls for nftables and conntrack). to-ebpf adds what its bpf()
calls ask of the kernel, and nothing else: BPF to create its maps, load their BTF and its
programs and make the cgroup links (the kernel asks CAP_BPF for each, Linux 5.8+); NET_ADMIN
too for loading programs of the cgroup sock_addr type (a networking type) as for nftables;
SYS_RESOURCE only on kernels before 5.11, which charge BPF maps to RLIMIT_MEMLOCK: libbpf lifts
that limit there, and leaves it alone on later kernels, which charge the pod's memory cgroup.
For what kpng does in the pods' network namespaces: see each namespace as local traffic
detection sees its traffic (Linux 5.14+), and, with --connected-udp destroy, destroy the
connected UDP sockets it translated at connect (Linux 6.5+) once their endpoint is gone:
SYS_ADMIN to setns into a pod's network namespace, where the kernel's socket iterator runs (it
also stands for PERFMON, which loading an iterator, a tracing program, asks for; kpng mounts
nothing: bpffs and cgroup2 come from the host), and SYS_PTRACE to open /proc/PID/ns/net of a
pod's process, which runs as another user or with capabilities kpng lacks (the kernel asks
ptrace's read access). Without SYS_ADMIN or SYS_PTRACE (or the pod's hostPID) kpng says so at
start, leaves connected UDP sockets to nftables and conntrack even with --connected-udp destroy,
and translates the sockets of pods that detection does not count as local, which are then not
masqueraded. Not privileged. */}}
{{- define "kpng.nodeSecurityContext" -}}
capabilities:
  drop: [ALL]
  {{- if eq .Values.mode "ebpf" }}
  add: [BPF, NET_ADMIN, SYS_ADMIN, SYS_PTRACE, SYS_RESOURCE]
  {{- else }}
  add: [NET_ADMIN]
  {{- end }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
{{- end }}

{{/* to-ebpf's mounts. The host's bpffs, where the maps and the links are pinned: pins on the
pod's own would go with the pod, and the programs with them; on the host's they outlive it, and
the next pod takes them over, so that a restart or a roll breaks no connection. The host's
cgroup2 hierarchy (read-only: attaching needs only an open directory), since the pod's own
cgroup namespace shows only its own cgroup. */}}
{{- define "kpng.ebpfMounts" -}}
{{- if eq .Values.mode "ebpf" }}
- name: bpffs
  mountPath: /sys/fs/bpf
- name: host-cgroup
  mountPath: /run/kpng/host-cgroup
  readOnly: true
{{- end }}
{{- end }}

{{- define "kpng.ebpfVolumes" -}}
{{- if eq .Values.mode "ebpf" }}
- name: bpffs
  hostPath:
    path: /sys/fs/bpf
    type: Directory
- name: host-cgroup
  hostPath:
    path: {{ .Values.ebpf.cgroup }}
    type: Directory
{{- end }}
{{- end }}

{{/* The init container of every node pod: the only privileged part, in every mode, and it
exits at once. /proc/sys is read-only in an unprivileged container, and these
sysctls belong to the node's network namespace. */}}
{{- define "kpng.initContainers" -}}
- name: conntrack-sysctls
  image: {{ include "kpng.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - kpng
    - kube-proxy
    - --config=/var/lib/kpng/config.conf
    - --init-only
  securityContext:
    privileged: true
  volumeMounts:
    - name: config
      mountPath: /var/lib/kpng
      readOnly: true
{{- end }}

{{/* The node's health, on kube-proxy's port: load balancers and probes already expect 10256.
/livez fails only when a change has waited longer than the healthz timeout: a slow first list,
a draining node or an absent brain restarts nothing. */}}
{{- define "kpng.nodeProbes" -}}
ports:
  - name: healthz
    containerPort: 10256
livenessProbe:
  httpGet:
    path: /livez
    port: 10256
  initialDelaySeconds: 15
  periodSeconds: 10
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: /healthz
    port: 10256
  periodSeconds: 5
  failureThreshold: 2
{{- end }}

{{- define "kpng.nodeName" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}
