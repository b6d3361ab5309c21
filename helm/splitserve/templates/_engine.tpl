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
{{- if or (gt (int $e.replicas) 1) $e.autoscaling.enabled $e.keda.enabled $e.pd.enabled }}true{{ end }}
{{- end }}

{{/*
The engine groups: one (role "") of engines.replicas, or with engines.pd the prefill and the decode
group. Each is rendered with the root context plus PdRole (merge): engineName, the worker hosts
and the engine ids then name the group's own LeaderWorkerSet.
*/}}
{{- define "splitserve.engineGroups" -}}
{{- $e := .Values.engines }}
{{- if $e.pd.enabled }}
- {role: prefill, replicas: {{ int $e.pd.prefillReplicas }}, kvRole: kv_producer}
- {role: decode, replicas: {{ int $e.pd.decodeReplicas }}, kvRole: kv_consumer}
{{- else }}
- {role: "", replicas: {{ int $e.replicas }}, kvRole: ""}
{{- end }}
{{- end }}

{{/* The pod label that tells a P/D group's leader pods apart (the gateway's PD selectors). */}}
{{- define "splitserve.pdRoleLabel" -}}splitserve.dev/pd-role{{- end }}

{{/* A P/D engine core's --kv-transfer-config (vLLM's JSON; its id prefill-<g> / decode-<g>). */}}
{{- define "splitserve.engineKvTransferArgs" -}}
{{- if .PdRole }}
{{- $pd := .Values.engines.pd }}
{{- $config := dict "kv_connector" $pd.connector "kv_role" .KvRole "engine_id" (printf "%s-%s" .PdRole (include "splitserve.engineIndexVar" .)) "kv_connector_extra_config" $pd.extraConfig -}}
- --kv-transfer-config
- {{ toJson $config | quote }}
{{- end }}
{{- end }}

{{- define "splitserve.hasGateway" -}}
{{- if and (include "splitserve.isEngineGroups" .) .Values.gateway.enabled }}true{{ end }}
{{- end }}

{{/* The component label of the pods that serve the public API: engine leaders, or frontends. */}}
{{- define "splitserve.servingComponent" -}}
{{- ternary "engine" "frontend" (not (empty (include "splitserve.isEngineGroups" .))) }}
{{- end }}

{{- define "splitserve.engineName" -}}{{ include "splitserve.fullname" . }}-engine{{ with .PdRole }}-{{ . }}{{ end }}{{- end }}
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
{{- $engineId := ternary (printf "%s-%s" (.PdRole | default "") $index) $index (not (empty .PdRole)) }}
{{- $labels := ternary (merge (dict (include "splitserve.pdRoleLabel" .) .PdRole) ($fe.routerLabels | default dict)) $fe.routerLabels (not (empty .PdRole)) }}
{{- $indexEnv := fromYamlArray (include "splitserve.engineIndexEnv" .) }}
{{- $podIp := dict "name" "POD_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP")) }}
{{- /* No --data-parallel-rank: each engine has a pod (and IP) of its own, so its ZMQ KV-event
       endpoints stay where llm-d looks for them (a rank would offset their ports). */}}
{{- $feArgs := fromYamlArray (include "splitserve.engineKvEventsArgs" .) }}
{{- $coreAddr := printf "$(POD_IP):%d" (int $core.port) }}
{{- $grace := max (int (include "splitserve.terminationGrace" (dict "root" . "component" "core"))) (int (include "splitserve.terminationGrace" (dict "root" . "component" "frontend"))) -}}
metadata:
  labels:
    {{- include "splitserve.podLabels" (dict "root" . "component" "engine" "values" $fe "extra" $labels) | nindent 4 }}
  annotations:
    {{- include "splitserve.podAnnotations" (dict "root" . "values" $fe) | nindent 4 }}
spec:
  {{- include "splitserve.podCommon" (dict "root" . "values" $fe "component" "frontend" "grace" $grace) | nindent 2 }}
  {{- with include "splitserve.frontendInitContainers" . }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    {{- include "splitserve.coreContainer" (dict "root" . "workerAddrs" (include "splitserve.engineWorkerAddrs" .) "distInit" (printf "tcp://%s:%d" (include "splitserve.engineWorkerHost" (dict "root" . "index" 0)) (int .Values.worker.distributedPort)) "engineId" $engineId "args" (fromYamlArray (include "splitserve.engineKvTransferArgs" .)) "portPrefix" "core-" "env" $indexEnv "tlsVolume" "internal-tls-core") | nindent 4 }}
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

{{/* The gateway's selectors of the engine leader pods (kubernetes discovery): one, or with
engines.pd a prefill and a decode selector (the pd-role label). */}}
{{- define "splitserve.gatewaySelectors" -}}
{{- $selector := fromYaml (include "splitserve.selectorLabels" (dict "root" . "component" "engine")) }}
{{- range $group := fromYamlArray (include "splitserve.engineGroups" .) }}
{{- if $group.role }}
- --{{ $group.role }}-selector
{{- else }}
- --selector
{{- end }}
{{- range $k, $v := $selector }}
- {{ printf "%s=%s" $k $v | quote }}
{{- end }}
{{- if $group.role }}
- {{ printf "%s=%s" (include "splitserve.pdRoleLabel" $) $group.role | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The gateway's engines by DNS name (static discovery): --worker-urls, or with engines.pd
--prefill and --decode per engine. */}}
{{- define "splitserve.gatewayStaticWorkers" -}}
{{- $root := . }}
{{- range $group := fromYamlArray (include "splitserve.engineGroups" .) }}
{{- $engine := include "splitserve.engineName" (merge (dict "PdRole" $group.role) $root) }}
{{- if not $group.role }}
- --worker-urls
{{- end }}
{{- range $g := until (int $group.replicas) }}
{{- if $group.role }}
- --{{ $group.role }}
{{- end }}
- {{ printf "grpc://%s-%d.%s.%s.svc.%s:%d" $engine $g $engine $root.Release.Namespace $root.Values.clusterDomain (int $root.Values.frontend.port) | quote }}
{{- end }}
{{- end }}
{{- end }}
