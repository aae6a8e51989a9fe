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
and to-iptables use (netlink calls for nftables and conntrack). to-ebpf also loads BPF
programs, attaches them to the host's cgroup2 hierarchy and pins them on bpffs, which takes
CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN and the host's mounts: privileged, as other eBPF proxies
run. */}}
{{- define "kpng.nodeSecurityContext" -}}
{{- if eq .Values.mode "ebpf" }}
privileged: true
readOnlyRootFilesystem: true
{{- else }}
capabilities:
  drop: [ALL]
  add: [NET_ADMIN]
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
{{- end }}
{{- end }}

{{/* to-ebpf's mounts: bpffs for the pins that outlive the pod, the host's cgroup2 hierarchy
(the pod's own cgroup namespace would only show its own cgroup), a cache for the clang
compile. */}}
{{- define "kpng.ebpfMounts" -}}
{{- if eq .Values.mode "ebpf" }}
- name: bpffs
  mountPath: /sys/fs/bpf
- name: host-cgroup
  mountPath: /run/kpng/host-cgroup
- name: ebpf-cache
  mountPath: /var/cache/kpng
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
- name: ebpf-cache
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "kpng.ebpfEnv" -}}
{{- if eq .Values.mode "ebpf" }}
# Where the clang compile is cached: the root file system is read-only.
- name: XDG_CACHE_HOME
  value: /var/cache/kpng
{{- end }}
{{- end }}

{{/* The init container of every node pod: the only privileged part when the mode is not
ebpf, and it exits at once. /proc/sys is read-only in an unprivileged container, and these
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
