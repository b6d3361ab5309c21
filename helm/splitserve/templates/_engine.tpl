{{/*
Engine groups (engines.replicas > 1, or engine autoscaling): one LeaderWorkerSet
"<fullname>-engine" whose group g is engine g. Its leader pod "<engine>-g" runs the engine core
and a frontend (the frontend reaches the core on the pod's IP); its worker pods "<engine>-g-<j+1>"
are worker pods j = 0.. of the release's layout (_layout.tpl), named under the headless Service
"<engine>" the LWS controller creates. The containers learn g from their pod's LWS group-index
label (ENGINE_INDEX): it names their worker pods and is the engine's --engine-id (the `engine`
label of its metrics).
*/}}

{{- define "splitserve.isEngineGroups" -}}
{{- $e := .Values.engines }}
{{- if or (gt (int $e.replicas) 1) $e.autoscaling.enabled $e.keda.enabled }}true{{ end }}
{{- end }}

{{- define "splitserve.hasGateway" -}}
{{- if and (include "splitserve.isEngineGroups" .) .Values.gateway.enabled }}true{{ end }}
{{- end }}

{{/* The component label of the pods that serve the public API: engine leaders, or frontends. */}}
{{- define "splitserve.servingComponent" -}}
{{- ternary "engine" "frontend" (not (empty (include "splitserve.isEngineGroups" .))) }}
{{- end }}

{{- define "splitserve.engineName" -}}{{ include "splitserve.fullname" . }}-engine{{- end }}
{{- define "splitserve.gatewayName" -}}{{ include "splitserve.fullname" . }}-gateway{{- end }}

{{- define "splitserve.engineIndexVar" -}}$(ENGINE_INDEX){{- end }}

{{/* ENGINE_INDEX: the pod's LWS group index. */}}
{{- define "splitserve.engineIndexEnv" -}}
- name: ENGINE_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/group-index']
{{- end }}

{{/* DNS name of worker pod J of this pod's engine group. */}}
{{- define "splitserve.engineWorkerHost" -}}
{{- $engine := include "splitserve.engineName" .root -}}
{{ $engine }}-{{ include "splitserve.engineIndexVar" . }}-{{ add1 (int .index) }}.{{ $engine }}.{{ .root.Release.Namespace }}.svc.{{ .root.Values.clusterDomain }}
{{- end }}

{{/* The core's --worker-addrs in an engine group (rank order, as splitserve.workerAddrs). */}}
{{- define "splitserve.engineWorkerAddrs" -}}
{{- $root := . }}
{{- $perPod := int (include "splitserve.ranksPerPod" $root) }}
{{- $addrs := list }}
{{- range $rank := until (int (include "splitserve.worldSize" $root)) }}
{{- $host := include "splitserve.engineWorkerHost" (dict "root" $root "index" (div $rank $perPod)) }}
{{- $addrs = append $addrs (printf "%s:%d" $host (add (int $root.Values.worker.port) (mod $rank $perPod))) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* The frontend's --kv-events-config in an engine group ("" = none). */}}
{{- define "splitserve.engineKvEventsArgs" -}}
{{- $gw := .Values.gateway }}
{{- if and (include "splitserve.hasGateway" .) (eq $gw.policy "cache_aware") $gw.kvEvents -}}
- --kv-events-config
- '{"enable_kv_cache_events": true, "publisher": "null"}'
{{- end }}
{{- end }}

{{/* The leader pod: the engine core and a frontend. Scheduling follows frontend.*; the grace
period is the longer of the two. */}}
{{- define "splitserve.engineLeaderTemplate" -}}
{{- $fe := .Values.frontend }}
{{- $core := .Values.core }}
{{- $index := include "splitserve.engineIndexVar" . }}
{{- $indexEnv := fromYamlArray (include "splitserve.engineIndexEnv" .) }}
{{- $podIp := dict "name" "POD_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP")) }}
{{- /* No --data-parallel-rank: each engine has a pod (and IP) of its own, so its ZMQ KV-event
       endpoints stay where llm-d looks for them (a rank would offset their ports). */}}
{{- $feArgs := fromYamlArray (include "splitserve.engineKvEventsArgs" .) }}
{{- $coreAddr := printf "$(POD_IP):%d" (int $core.port) }}
{{- $grace := max (int (include "splitserve.terminationGrace" (dict "root" . "component" "core"))) (int (include "splitserve.terminationGrace" (dict "root" . "component" "frontend"))) -}}
metadata:
  labels:
    {{- include "splitserve.podLabels" (dict "root" . "component" "engine" "values" $fe "extra" $fe.routerLabels) | nindent 4 }}
  annotations:
    {{- include "splitserve.podAnnotations" (dict "root" . "values" $fe) | nindent 4 }}
spec:
  {{- include "splitserve.podCommon" (dict "root" . "values" $fe "component" "frontend" "grace" $grace) | nindent 2 }}
  {{- with include "splitserve.frontendInitContainers" . }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    {{- include "splitserve.coreContainer" (dict "root" . "workerAddrs" (include "splitserve.engineWorkerAddrs" .) "distInit" (printf "tcp://%s:%d" (include "splitserve.engineWorkerHost" (dict "root" . "index" 0)) (int .Values.worker.distributedPort)) "engineId" $index "portPrefix" "core-" "env" $indexEnv "tlsVolume" "internal-tls-core") | nindent 4 }}
    {{- include "splitserve.frontendContainer" (dict "root" . "coreAddr" $coreAddr "args" $feArgs "env" (prepend $indexEnv $podIp) "tlsVolume" "internal-tls-frontend" "noApiKey" true) | nindent 4 }}
  volumes:
    {{- include "splitserve.scratchVolumes" . | nindent 4 }}
    {{- with include "splitserve.internalTlsVolume" (dict "root" . "role" "core" "volume" "internal-tls-core") }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "splitserve.internalTlsVolume" (dict "root" . "role" "frontend" "volume" "internal-tls-frontend") }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "splitserve.publicTlsVolume" . }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if include "splitserve.frontendMountsModel" . }}
    {{- with include "splitserve.modelVolume" . }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- end }}
    {{- with concat $core.extraVolumes $fe.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
