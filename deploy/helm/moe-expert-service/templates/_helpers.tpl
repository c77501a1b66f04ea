{{/* Names */}}
{{- define "moe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "moe.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* NAME-SUFFIX, at most 63 characters. Call with (dict "root" $ "suffix" "coordinator"). */}}
{{- define "moe.componentName" -}}
{{- printf "%s-%s" (include "moe.fullname" .root | trunc (int (sub 62 (len .suffix)))) .suffix | trimSuffix "-" }}
{{- end }}

{{/* Labels */}}
{{- define "moe.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "moe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "moe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Images */}}
{{- define "moe.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{- define "moe.workerImage" -}}
{{- $repo := .Values.worker.image.repository | default .Values.image.repository }}
{{- $tag := .Values.worker.image.tag | default .Values.image.tag | default .Chart.AppVersion }}
{{- printf "%s:%s" $repo (toString $tag) }}
{{- end }}

{{/* The coordinator's address as the agents and moectl dial it (and TLS certificates name it). */}}
{{- define "moe.coordinatorHost" -}}
{{- printf "%s.%s.svc.%s" (include "moe.componentName" (dict "root" . "suffix" "coordinator")) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "moe.coordinatorAddress" -}}
{{- printf "%s:%d" (include "moe.coordinatorHost" .) (int .Values.coordinator.port) }}
{{- end }}

{{/* Host directory of the shm sockets. */}}
{{- define "moe.shmHostDir" -}}
{{- .Values.shm.hostDir | default (printf "/run/moe/%s-%s" .Release.Namespace .Release.Name) }}
{{- end }}

{{/* Socket of NUMA slot N on this node, as seen in the containers ($(NODE_NAME) is expanded by the kubelet). */}}
{{- define "moe.shmSocket" -}}
{{- printf "/run/moe/$(NODE_NAME)-numa%d.sock" (int .) }}
{{- end }}

{{/* uid of the worker processes. */}}
{{- define "moe.workerUid" -}}
{{- if kindIs "invalid" .Values.worker.runAsUser }}
{{- int64 .Values.securityContext.runAsUser }}
{{- else }}
{{- int64 .Values.worker.runAsUser }}
{{- end }}
{{- end }}

{{/* TLS flags of a server process (the same files serve as client credentials towards its peers). */}}
{{- define "moe.tlsArgs" -}}
{{- if .Values.tls.insecure -}}
- --insecure
{{- else -}}
- --tls-cert=/etc/moe/tls/{{ .Values.tls.certKey }}
- --tls-key=/etc/moe/tls/{{ .Values.tls.keyKey }}
- --tls-ca=/etc/moe/tls/{{ .Values.tls.caKey }}
{{- end }}
{{- end }}

{{/* TLS secret of a component. Call with (dict "root" $ "component" "worker"). */}}
{{- define "moe.tlsSecretName" -}}
{{- $name := index .root.Values.tls.secretNames .component | default .root.Values.tls.secretName }}
{{- required "tls.secretName (or tls.insecure=true) is required" $name }}
{{- end }}

{{- define "moe.tlsVolume" -}}
{{- if not .root.Values.tls.insecure -}}
- name: tls
  secret:
    secretName: {{ include "moe.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "moe.tlsVolumeMount" -}}
{{- if not .Values.tls.insecure -}}
- name: tls
  mountPath: /etc/moe/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Model volume (mounted read-only in expert servers and workers). */}}
{{- define "moe.modelVolume" -}}
{{- $v := .Values.model.volume }}
{{- if eq $v.type "hostPath" -}}
- name: model
  hostPath:
    path: {{ required "model.volume.hostPath is required for type hostPath" $v.hostPath }}
    type: Directory
{{- else if eq $v.type "pvc" -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.volume.claimName is required for type pvc" $v.claimName }}
    readOnly: true
{{- else if ne $v.type "none" -}}
{{- fail (printf "model.volume.type: %q is not none, hostPath or pvc" $v.type) }}
{{- end }}
{{- end }}

{{- define "moe.modelVolumeMount" -}}
{{- if ne .Values.model.volume.type "none" -}}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
Probe action. The kubelet's native gRPC probe calls grpc.health.v1.Health/Check
in plaintext only (it has no TLS settings), so with TLS the probe checks that
the port accepts connections instead. Call with (dict "root" $ "port" N).
*/}}
{{- define "moe.probeAction" -}}
{{- if .root.Values.tls.insecure -}}
grpc:
  port: {{ int .port }}
{{- else -}}
tcpSocket:
  port: {{ int .port }}
{{- end }}
{{- end }}

{{/* Pod annotations: Prometheus scrape hints plus the component's own. Call with (dict "root" $ "extra" MAP). */}}
{{- define "moe.podAnnotations" -}}
{{- $m := .root.Values.metrics }}
{{- if and $m.enabled $m.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ int $m.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* --metrics-port flag, bound to the pod IP (the binaries default to loopback) so Prometheus can scrape it. */}}
{{- define "moe.metricsArgs" -}}
{{- if .Values.metrics.enabled -}}
- --metrics-port={{ int .Values.metrics.port }}
- --metrics-address={{ .Values.metrics.address }}
{{- end }}
{{- end }}

{{/*
The coordinator's role allow-lists (SECURITY.md). admin: empty keeps the
binary's default (the coordinator's own uid on its admin socket: moectl via
kubectl exec). worker and server: empty means any caller the listener admits
(with TLS: any certificate the CA signed), since with one shared secret every
component presents the same certificate; set them, with per-component
secrets (tls.secretNames), to separate the roles.
*/}}
{{- define "moe.roleArgs" -}}
{{- $r := .Values.coordinator.identities -}}
{{- with $r.admin }}
- --admin-identities={{ join "," . }}
{{- end }}
- --worker-identities={{ $r.worker | default (list "*") | join "," }}
- --server-identities={{ $r.server | default (list "*") | join "," }}
{{- end }}

{{- define "moe.metricsPort" -}}
{{- if .Values.metrics.enabled -}}
- name: metrics
  containerPort: {{ int .Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Downward-API environment used in the flags ($(POD_IP), $(NODE_NAME)). */}}
{{- define "moe.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}

{{/* Pod security context shared by every component. */}}
{{- define "moe.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ int64 .Values.securityContext.runAsUser }}
runAsGroup: {{ int64 .Values.securityContext.runAsGroup }}
fsGroup: {{ int64 .Values.securityContext.fsGroup }}
# Volume contents keep the modes their writers gave them (recursive group
# rw is applied only when the volume's root does not match): the
# coordinator refuses a group-writable state file.
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container security context. Call with (dict "add" LIST). */}}
{{- define "moe.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
  {{- with .add }}
  add:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* "#experts=LIST" of a numaNodes entry that hosts a subset, else "". */}}
{{- define "moe.expertsSuffix" -}}
{{- with get . "experts" }}{{ printf "#experts=%v" . }}{{ end }}
{{- end }}

{{/* moectl's TLS flags (client side: CA, client certificate for mTLS). */}}
{{- define "moe.moectlTlsArgs" -}}
{{- if .Values.tls.insecure -}}
- --insecure
{{- else -}}
- --tls-ca=/etc/moe/tls/{{ .Values.tls.caKey }}
- --tls-cert=/etc/moe/tls/{{ .Values.tls.certKey }}
- --tls-key=/etc/moe/tls/{{ .Values.tls.keyKey }}
{{- end }}
{{- end }}
