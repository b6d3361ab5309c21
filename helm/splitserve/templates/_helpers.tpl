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

{{/*
Labels of a workload's pods: the standard labels, "model" (the served model name as a label
value, for routers, autoscalers and dashboards), then the component's podLabels (and extra).
(dict "root" $ "component" "frontend" "values" .Values.frontend ["extra" DICT]).
*/}}
{{- define "splitserve.podLabels" -}}
{{- $labels := fromYaml (include "splitserve.labels" (dict "root" .root "component" .component)) }}
{{- $_ := set $labels "model" (include "splitserve.modelLabel" .root) }}
{{- $labels = mergeOverwrite $labels (.extra | default dict) (.values.podLabels | default dict) }}
{{- toYaml $labels }}
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
Pod parts shared by the three workloads
*/}}

{{/* Scratch volumes every pod has: /tmp and the cache (the root filesystem is read-only). */}}
{{- define "splitserve.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.cache.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
{{- end }}

{{- define "splitserve.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: {{ .Values.cache.mountPath }}
{{- end }}

{{/* env of every container: the ConfigMap, then chart-wide and per-component extras. */}}
{{- define "splitserve.envFrom" -}}
- configMapRef:
    name: {{ include "splitserve.configName" . }}
{{- end }}

{{/* Pod spec fields every workload shares: (dict "root" $ "values" .Values.frontend
"component" "frontend" ["grace" SECONDS]). */}}
{{- define "splitserve.podCommon" -}}
{{- $root := .root -}}
serviceAccountName: {{ include "splitserve.serviceAccountName" $root }}
automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
{{- /* Service links would inject e.g. SPLITSERVE_PORT=tcp://... for a Service named "splitserve",
       which the services would read as their --port flag. */}}
enableServiceLinks: false
terminationGracePeriodSeconds: {{ .grace | default (include "splitserve.terminationGrace" (dict "root" $root "component" .component)) }}
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
{{- with include "splitserve.internalTlsAnnotation" .root }}
{{ . }}
{{- end }}
{{- with include "splitserve.internalSecretAnnotation" .root }}
{{ . }}
{{- end }}
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

{{/* HTTP GET probe: (dict "probe" .Values.frontend.probes.readiness "port" "http" "path" "/health"
"scheme" "HTTPS"). The kubelet does not verify the server's certificate. */}}
{{- define "splitserve.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
  scheme: {{ .scheme | default "HTTP" }}
{{- range $key, $value := .probe }}
{{ $key }}: {{ $value }}
{{- end }}
{{- end }}

{{/*
env of a service container: (dict "root" $ "values" .Values.core "component" "core" ["extra"
LIST] ["noApiKey" true]). The core and the workers get their pod's IP (POD_IP, for --host); the
frontend its API key from the user's Secret (unless noApiKey: an engine group's, behind the
gateway, which holds the key); every service the internal secret when the internal hops are plaintext;
then `extra` (the caller's), chart-wide and per-component extras.
*/}}
{{- define "splitserve.env" -}}
{{- $env := list }}
{{- if ne .component "frontend" }}
{{- $podIp := dict "fieldRef" (dict "fieldPath" "status.podIP") }}
{{- $env = append $env (dict "name" "POD_IP" "valueFrom" $podIp) }}
{{- end }}
{{- $key := .root.Values.frontend.apiKey }}
{{- if and (eq .component "frontend") $key.secretName (not .noApiKey) }}
{{- $ref := dict "secretKeyRef" (dict "name" $key.secretName "key" $key.key) }}
{{- $env = append $env (dict "name" "SPLITSERVE_API_KEY" "valueFrom" $ref) }}
{{- end }}
{{- with include "splitserve.internalSecretEnv" .root }}
{{- $env = concat $env (fromYamlArray .) }}
{{- end }}
{{- $env = concat $env (.extra | default list) .root.Values.extraEnv .values.extraEnv }}
{{- if $env }}
{{- toYaml $env }}
{{- end }}
{{- end }}

{{/* Health service names (splitserve/service_host.py). */}}
{{- define "splitserve.readinessService.frontend" -}}splitserve.frontend.v1.GenerationService{{- end }}
{{- define "splitserve.readinessService.core" -}}splitserve.core.v1.EngineCoreService{{- end }}
{{- define "splitserve.readinessService.worker" -}}splitserve.worker.v1.WorkerService{{- end }}

{{/*
vLLM's `vllm serve` batch defaults for the workers' device (vLLM 0.32's
EngineArgs.get_batch_defaults): 1024 sequences and 16384 tokens per step on GPUs with at least
160 GiB, 1024 and 8192 with at least 70 GiB unless an A100, else 256 and 2048. On CPU nothing
(0): the engine core's own defaults apply (2048 tokens per rank, vLLM-CPU's). As JSON.
*/}}
{{- define "splitserve.batchDefaults" -}}
{{- $gpu := .Values.worker.gpu -}}
{{- $memory := int ($gpu.memoryGiB | default 0) -}}
{{- $isA100 := contains "a100" (lower ($gpu.product | default "")) -}}
{{- if not $gpu.enabled -}}
{"maxNumSeqs": 0, "maxNumBatchedTokens": 0}
{{- else if ge $memory 160 -}}
{"maxNumSeqs": 1024, "maxNumBatchedTokens": 16384}
{{- else if and (ge $memory 70) (not $isA100) -}}
{"maxNumSeqs": 1024, "maxNumBatchedTokens": 8192}
{{- else -}}
{"maxNumSeqs": 256, "maxNumBatchedTokens": 2048}
{{- end -}}
{{- end }}
