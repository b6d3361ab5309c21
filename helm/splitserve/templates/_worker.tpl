{{/*
The worker pod template, shared by the StatefulSet and the LeaderWorkerSet (see _layout.tpl).
*/}}

{{/* Flags of the worker process with local rank I: (dict "root" $ "localRank" I). */}}
{{- define "splitserve.workerRankArgs" -}}
{{- $w := .root.Values.worker -}}
- --host
- {{ .root.Values.internalListenAddress | quote }}
- --port
- {{ add (int $w.port) .localRank | quote }}
- --metrics-port
- {{ add (int $w.metricsPort) .localRank | quote }}
- --shutdown-timeout
- {{ include "splitserve.shutdownSeconds" (dict "root" .root "component" "worker") | quote }}
{{- if include "splitserve.isInternalTls" .root }}
{{- if eq (int .localRank) 0 }}
- --health-port
- {{ $w.healthPort | int | quote }}
{{- end }}
{{- include "splitserve.internalTlsArgs" .root | nindent 0 }}
{{- end }}
{{- range $w.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
bash supervisor of a tpGroup pod: its arguments are the ranks' command lines, separated by ";".
It starts every rank, and when any rank exits it stops the others and exits non-zero, so the
kubelet restarts the TP group as a whole (a TP group whose member died cannot all-reduce); on
SIGTERM it passes the signal on and exits once every rank has stopped.
*/}}
{{- define "splitserve.tpGroupSupervisor" -}}
set -u
pids=()
cmd=()
launch() { "${cmd[@]}" & pids+=("$!"); cmd=(); }
for arg in "$@"; do
  if [ "$arg" = ";" ]; then launch; else cmd+=("$arg"); fi
done
launch
stop() { kill -TERM "${pids[@]}" 2>/dev/null; wait; }
trap 'stop; exit 0' TERM INT
# Poll rather than "wait -n", which can miss a child that exits early (bash 5.2).
while :; do
  for pid in "${pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid"
      code=$?
      echo "splitserve tp-group: a rank exited with status $code, stopping the TP group" >&2
      stop
      if [ "$code" -eq 0 ]; then code=1; fi
      exit "$code"
    fi
  done
  sleep 1 &
  wait "$!"
done
{{- end }}

{{/* Resources of a worker container: worker.resources plus one GPU per rank it holds. */}}
{{- define "splitserve.workerResources" -}}
{{- $w := .Values.worker }}
{{- $resources := deepCopy $w.resources }}
{{- if $w.gpu.enabled }}
{{- $gpu := dict $w.gpu.resourceName (int (include "splitserve.ranksPerPod" .)) }}
{{- $_ := set $resources "limits" (merge (dict) $gpu ($resources.limits | default dict)) }}
{{- $_ := set $resources "requests" (merge (dict) $gpu ($resources.requests | default dict)) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{- define "splitserve.workerContainer" -}}
{{- $root := . }}
{{- $w := .Values.worker }}
{{- $tls := include "splitserve.isInternalTls" . }}
{{- $probePort := ternary $w.healthPort $w.port (not (empty $tls)) }}
{{- $perPod := int (include "splitserve.ranksPerPod" .) -}}
- name: worker
  image: {{ include "splitserve.workerImage" . }}
  imagePullPolicy: {{ include "splitserve.workerPullPolicy" . }}
  {{- if eq $perPod 1 }}
  command: ["splitserve", "worker"]
  args:
    {{- include "splitserve.workerRankArgs" (dict "root" $root "localRank" 0) | nindent 4 }}
  {{- else }}
  # One process per TP rank of this pipeline stage (local rank i: ports +i{{ if $w.gpu.enabled }}, GPU i{{ end }}).
  command:
    - bash
    - -c
    - |-
      {{- include "splitserve.tpGroupSupervisor" . | nindent 6 }}
    - tp-group
  args:
    {{- range $i := until $perPod }}
    {{- if $i }}
    - ";"
    {{- end }}
    {{- if $w.gpu.enabled }}
    - env
    - CUDA_VISIBLE_DEVICES={{ $i }}
    {{- end }}
    - splitserve
    - worker
    {{- include "splitserve.workerRankArgs" (dict "root" $root "localRank" $i) | nindent 4 }}
    {{- end }}
  {{- end }}
  envFrom:
    {{- include "splitserve.envFrom" . | nindent 4 }}
  env:
    {{- include "splitserve.env" (dict "root" . "values" $w "component" "worker") | nindent 4 }}
  ports:
    {{- range $i := until $perPod }}
    - name: {{ include "splitserve.rankPortName" (dict "base" "grpc" "index" $i) }}
      containerPort: {{ add (int $w.port) $i }}
      protocol: TCP
    - name: {{ include "splitserve.rankPortName" (dict "base" "metrics" "index" $i) }}
      containerPort: {{ add (int $w.metricsPort) $i }}
      protocol: TCP
    {{- end }}
    - name: dist
      containerPort: {{ $w.distributedPort }}
      protocol: TCP
    {{- if $tls }}
    - name: health
      containerPort: {{ $w.healthPort }}
      protocol: TCP
    {{- end }}
  # Probes reach local rank 0 (on its plaintext health port under mutual TLS); a tpGroup
  # supervisor ends the container when any rank exits.
  startupProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $w.probes.startup "port" $probePort "service" "") | nindent 4 }}
  livenessProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $w.probes.liveness "port" $probePort "service" "") | nindent 4 }}
  readinessProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $w.probes.readiness "port" $probePort "service" (include "splitserve.readinessService.worker" .)) | nindent 4 }}
  {{- with include "splitserve.lifecycle" (dict "root" . "component" "worker") }}
  {{- . | nindent 2 }}
  {{- end }}
  resources:
    {{- include "splitserve.workerResources" . | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "splitserve.scratchVolumeMounts" . | nindent 4 }}
    {{- with include "splitserve.internalTlsMount" . }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "splitserve.modelVolumeMount" . }}
    {{- . | nindent 4 }}
    {{- end }}
    - name: dshm
      mountPath: /dev/shm
    {{- with $w.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The worker PodTemplateSpec (metadata + spec). */}}
{{- define "splitserve.workerPodTemplate" -}}
{{- $w := .Values.worker }}
{{- $par := .Values.parallelism -}}
metadata:
  labels:
    {{- include "splitserve.podLabels" (dict "root" . "component" "worker" "values" $w) | nindent 4 }}
  annotations:
    {{- include "splitserve.podAnnotations" (dict "root" . "values" $w) | nindent 4 }}
    # A new layout restarts every rank (they re-join a fresh torch.distributed world).
    splitserve.io/parallelism: {{ printf "tp=%d,pp=%d,layout=%s" (int $par.tensorParallelSize) (int $par.pipelineParallelSize) (include "splitserve.workerLayout" .) | quote }}
spec:
  {{- include "splitserve.podCommon" (dict "root" . "values" $w "component" "worker") | nindent 2 }}
  {{- with $w.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- if include "splitserve.isHub" . }}
  initContainers:
    {{- $mount := list (dict "name" "model" "mountPath" .Values.model.mountPath) }}
    {{- include "splitserve.hubDownloadContainer" (dict "root" . "image" (include "splitserve.workerImage" .) "pullPolicy" (include "splitserve.workerPullPolicy" .) "target" (include "splitserve.modelPath" .) "patterns" .Values.model.hub.allowPatterns "mount" $mount) | nindent 4 }}
  {{- end }}
  containers:
    {{- include "splitserve.workerContainer" . | nindent 4 }}
  volumes:
    {{- include "splitserve.scratchVolumes" . | nindent 4 }}
    {{- with include "splitserve.internalTlsVolume" (dict "root" . "role" "worker") }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "splitserve.modelVolume" . }}
    {{- . | nindent 4 }}
    {{- end }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shm.sizeLimit }}
    {{- with $w.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
