{{/*
Names
*/}}

{{/* Chart name, overridable. */}}
{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix of every resource. Kept to 40 characters so that the longest derived name
("<fullname>-worker-headless", and the worker pods' "<fullname>-worker-<ordinal>" hostnames)
stays a valid DNS label.
*/}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitserve.frontendName" -}}{{ include "splitserve.fullname" . }}-frontend{{- end }}
{{- define "splitserve.coreName" -}}{{ include "splitserve.fullname" . }}-core{{- end }}
{{- define "splitserve.workerName" -}}{{ include "splitserve.fullname" . }}-worker{{- end }}
{{- define "splitserve.workerHeadlessName" -}}{{ include "splitserve.fullname" . }}-worker-headless{{- end }}
{{- define "splitserve.metricsName" -}}{{ include "splitserve.fullname" . }}-metrics{{- end }}
{{- define "splitserve.configName" -}}{{ include "splitserve.fullname" . }}-config{{- end }}

{{/*
Labels. Call with (dict "root" $ "component" "frontend").
*/}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ include "splitserve.chart" .root }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Images
*/}}
{{- define "splitserve.imageRef" -}}
{{- if .digest -}}
{{ .repository }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ .tag }}
{{- end -}}
{{- end }}

{{/* Image of the frontend and the engine core. */}}
{{- define "splitserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-cpu" .Chart.AppVersion) }}
{{- include "splitserve.imageRef" (dict "repository" .Values.image.repository "tag" $tag "digest" .Values.image.digest) }}
{{- end }}

{{/* Image of the workers: the CUDA variant when they get GPUs. */}}
{{- define "splitserve.workerImage" -}}
{{- $w := .Values.worker.image }}
{{- $repo := $w.repository | default .Values.image.repository }}
{{- $defaultTag := .Values.image.tag | default (printf "%s-cpu" .Chart.AppVersion) }}
{{- if .Values.worker.gpu.enabled }}
{{- $defaultTag = printf "%s-cuda" .Chart.AppVersion }}
{{- end }}
{{- $digest := $w.digest }}
{{- if and (not $w.repository) (not $w.tag) (not .Values.worker.gpu.enabled) }}
{{- $digest = $w.digest | default .Values.image.digest }}
{{- end }}
{{- include "splitserve.imageRef" (dict "repository" $repo "tag" ($w.tag | default $defaultTag) "digest" $digest) }}
{{- end }}

{{- define "splitserve.workerPullPolicy" -}}
{{- .Values.worker.image.pullPolicy | default .Values.image.pullPolicy }}
{{- end }}

{{/*
Topology and addresses. Workers are one StatefulSet: pod ordinal = rank = pp_rank * tp + tp_rank,
each rank reachable at "<statefulset>-<rank>.<headless service>.<namespace>.svc.<clusterDomain>".
*/}}
{{- define "splitserve.worldSize" -}}
{{- mul (int .Values.parallelism.tensorParallelSize) (int .Values.parallelism.pipelineParallelSize) }}
{{- end }}

{{/* Fully qualified DNS name of worker rank N: (dict "root" $ "rank" N). */}}
{{- define "splitserve.workerHost" -}}
{{- $root := .root -}}
{{ include "splitserve.workerName" $root }}-{{ .rank }}.{{ include "splitserve.workerHeadlessName" $root }}.{{ $root.Release.Namespace }}.svc.{{ $root.Values.clusterDomain }}
{{- end }}

{{/* Comma-separated HOST:PORT of every rank, in rank order (the core's --worker-addrs). */}}
{{- define "splitserve.workerAddrs" -}}
{{- $root := . }}
{{- $addrs := list }}
{{- range $rank := until (int (include "splitserve.worldSize" $root)) }}
{{- $addrs = append $addrs (printf "%s:%d" (include "splitserve.workerHost" (dict "root" $root "rank" $rank)) (int $root.Values.worker.port)) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* torch.distributed rendezvous at rank 0 (the core's --distributed-init-method). */}}
{{- define "splitserve.distributedInitMethod" -}}
tcp://{{ include "splitserve.workerHost" (dict "root" . "rank" 0) }}:{{ int .Values.worker.distributedPort }}
{{- end }}

{{/* The engine core's Service address (the frontends' --core-addr). */}}
{{- define "splitserve.coreAddr" -}}
{{ include "splitserve.coreName" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ int .Values.core.service.port }}
{{- end }}

{{/*
Model
*/}}
{{- define "splitserve.hasModelVolume" -}}
{{- if ne .Values.model.source "embedded" }}true{{ end }}
{{- end }}

{{/* The checkpoint folder as every pod sees it ("tiny" = the embedded tiny demo model). */}}
{{- define "splitserve.modelPath" -}}
{{- if not (include "splitserve.hasModelVolume" .) }}
{{- "tiny" }}
{{- else }}
{{- $sub := trimAll "/" .Values.model.subPath }}
{{- if $sub }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) $sub }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{- define "splitserve.modelClaimName" -}}
{{- if .Values.model.pvc.existingClaim }}
{{- .Values.model.pvc.existingClaim }}
{{- else }}
{{- include "splitserve.fullname" . }}-model
{{- end }}
{{- end }}

{{/*
Pod parts shared by the three workloads
*/}}

{{/* Volumes every pod has: /tmp, the cache, the model. */}}
{{- define "splitserve.commonVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.cache.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ include "splitserve.modelClaimName" . }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- end }}
{{- end }}

{{- define "splitserve.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: {{ .Values.cache.mountPath }}
{{- if include "splitserve.hasModelVolume" . }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* env of every container: the ConfigMap, then chart-wide and per-component extras. */}}
{{- define "splitserve.envFrom" -}}
- configMapRef:
    name: {{ include "splitserve.configName" . }}
{{- end }}

{{/* Pod spec fields every workload shares: (dict "root" $ "values" .Values.frontend). */}}
{{- define "splitserve.podCommon" -}}
{{- $root := .root -}}
serviceAccountName: {{ include "splitserve.serviceAccountName" $root }}
automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
{{- /* Service links would inject e.g. SPLITSERVE_PORT=tcp://... for a Service named "splitserve",
       which the services would read as their --port flag. */}}
enableServiceLinks: false
terminationGracePeriodSeconds: {{ .values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod annotations: config checksum (restarts pods when the ConfigMap changes) + user's. */}}
{{- define "splitserve.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Native gRPC probe: (dict "probe" .Values.frontend.probes.startup "port" 50051 "service" "name").
An empty service is the liveness check of the process as a whole.
*/}}
{{- define "splitserve.grpcProbe" -}}
grpc:
  port: {{ int .port }}
  {{- if .service }}
  service: {{ .service }}
  {{- end }}
{{- range $key, $value := .probe }}
{{ $key }}: {{ $value }}
{{- end }}
{{- end }}

{{/* Health service names (splitserve/service_host.py). */}}
{{- define "splitserve.readinessService.frontend" -}}splitserve.frontend.v1.GenerationService{{- end }}
{{- define "splitserve.readinessService.core" -}}splitserve.core.v1.EngineCoreService{{- end }}
{{- define "splitserve.readinessService.worker" -}}splitserve.worker.v1.WorkerService{{- end }}
