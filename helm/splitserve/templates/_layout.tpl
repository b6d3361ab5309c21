{{/*
Worker layout and addresses.

rank = pp_rank * tp + tp_rank (vLLM's order). The ranks live in worker pods:
  perRank  one pod per rank, one GPU each:            pod index = rank,         local rank 0
  tpGroup  one pod per pipeline stage, tp GPUs each:  pod index = rank / tp,    local rank = rank % tp
The local rank of a process picks its ports (worker.port + local rank, worker.metricsPort + local
rank) and, on GPUs, its device (CUDA_VISIBLE_DEVICES=<local rank>).
Worker pod N is "<worker>-N" of a StatefulSet behind the chart's headless Service, or, with
worker.leaderWorkerSet.enabled, "<worker>-0" (leader) / "<worker>-0-N" of the LeaderWorkerSet's
single group behind the headless Service the LWS controller creates (named after the LWS).
*/}}

{{- define "splitserve.worldSize" -}}
{{- mul (int .Values.parallelism.tensorParallelSize) (int .Values.parallelism.pipelineParallelSize) }}
{{- end }}

{{/* "perRank" or "tpGroup" ("auto": tpGroup when the workers get GPUs). */}}
{{- define "splitserve.workerLayout" -}}
{{- $layout := .Values.worker.layout | default "auto" }}
{{- if eq $layout "auto" }}
{{- ternary "tpGroup" "perRank" .Values.worker.gpu.enabled }}
{{- else }}
{{- $layout }}
{{- end }}
{{- end }}

{{/* Worker ranks (processes) per worker pod. */}}
{{- define "splitserve.ranksPerPod" -}}
{{- if eq (include "splitserve.workerLayout" .) "tpGroup" }}
{{- int .Values.parallelism.tensorParallelSize }}
{{- else -}}
1
{{- end }}
{{- end }}

{{- define "splitserve.numWorkerPods" -}}
{{- div (int (include "splitserve.worldSize" .)) (int (include "splitserve.ranksPerPod" .)) }}
{{- end }}

{{- define "splitserve.isLeaderWorkerSet" -}}
{{- if .Values.worker.leaderWorkerSet.enabled }}true{{ end }}
{{- end }}

{{/* The headless Service that gives worker pods their DNS names (the pods' subdomain). */}}
{{- define "splitserve.workerSubdomain" -}}
{{- if include "splitserve.isLeaderWorkerSet" . }}
{{- include "splitserve.workerName" . }}
{{- else }}
{{- include "splitserve.workerHeadlessName" . }}
{{- end }}
{{- end }}

{{/* Name of worker pod N: (dict "root" $ "index" N). */}}
{{- define "splitserve.workerPodName" -}}
{{- $name := include "splitserve.workerName" .root }}
{{- if and (include "splitserve.isLeaderWorkerSet" .root) (gt (int .index) 0) }}
{{- printf "%s-0-%d" $name (int .index) }}
{{- else }}
{{- printf "%s-%d" $name (int .index) }}
{{- end }}
{{- end }}

{{/* Fully qualified DNS name of worker pod N: (dict "root" $ "index" N). */}}
{{- define "splitserve.workerPodHost" -}}
{{- $root := .root -}}
{{ include "splitserve.workerPodName" . }}.{{ include "splitserve.workerSubdomain" $root }}.{{ $root.Release.Namespace }}.svc.{{ $root.Values.clusterDomain }}
{{- end }}

{{/* Comma-separated HOST:PORT of every rank, in rank order (the core's --worker-addrs). */}}
{{- define "splitserve.workerAddrs" -}}
{{- $root := . }}
{{- $perPod := int (include "splitserve.ranksPerPod" $root) }}
{{- $addrs := list }}
{{- range $rank := until (int (include "splitserve.worldSize" $root)) }}
{{- $host := include "splitserve.workerPodHost" (dict "root" $root "index" (div $rank $perPod)) }}
{{- $addrs = append $addrs (printf "%s:%d" $host (add (int $root.Values.worker.port) (mod $rank $perPod))) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* torch.distributed rendezvous: rank 0 (local rank 0 of worker pod 0) opens the TCPStore. */}}
{{- define "splitserve.distributedInitMethod" -}}
tcp://{{ include "splitserve.workerPodHost" (dict "root" . "index" 0) }}:{{ int .Values.worker.distributedPort }}
{{- end }}

{{/* Port name of local rank I: "grpc", "grpc-1", ... (dict "base" "grpc" "index" I). */}}
{{- define "splitserve.rankPortName" -}}
{{- if eq (int .index) 0 }}{{ .base }}{{ else }}{{ printf "%s-%d" .base (int .index) }}{{ end }}
{{- end }}

{{/* The engine core's Service address (the frontends' --core-addr). */}}
{{- define "splitserve.coreAddr" -}}
{{ include "splitserve.coreName" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ int .Values.core.service.port }}
{{- end }}

{{/*
Values the schema cannot check on its own; rendering stops with a message that says what to change.
*/}}
{{- define "splitserve.validate" -}}
{{- $w := .Values.worker }}
{{- $perPod := int (include "splitserve.ranksPerPod" .) }}
{{- $grpcEnd := add (int $w.port) $perPod }}
{{- $metricsEnd := add (int $w.metricsPort) $perPod }}
{{- if and (lt (int $w.port) $metricsEnd) (lt (int $w.metricsPort) $grpcEnd) }}
{{- fail (printf "worker.port %d..%d and worker.metricsPort %d..%d overlap: a worker pod uses one port of each per rank it holds (%d)" (int $w.port) (sub $grpcEnd 1) (int $w.metricsPort) (sub $metricsEnd 1) $perPod) }}
{{- end }}
{{- range $base := list (int $w.port) (int $w.metricsPort) }}
{{- if and (le $base (int $w.distributedPort)) (lt (int $w.distributedPort) (add $base $perPod)) }}
{{- fail (printf "worker.distributedPort %d collides with a rank's gRPC or metrics port (%d..%d)" (int $w.distributedPort) $base (sub (add $base $perPod) 1)) }}
{{- end }}
{{- end }}
{{- if and .Values.frontend.autoscaling.enabled .Values.frontend.keda.enabled }}
{{- fail "frontend.autoscaling.enabled (HPA) and frontend.keda.enabled (KEDA ScaledObject, which owns an HPA of its own) are mutually exclusive: enable one" }}
{{- end }}
{{- include "splitserve.validateEngines" . }}
{{- include "splitserve.validateSecurity" . }}
{{- if and (eq .Values.model.source "hub") (not .Values.model.hub.repoId) }}
{{- fail "model.source is hub: set model.hub.repoId (e.g. meta-llama/Llama-3.1-8B-Instruct)" }}
{{- end }}
{{- end }}

{{/* Transport-security and drain values (_security.tpl). */}}
{{- define "splitserve.validateSecurity" -}}
{{- $tls := .Values.tls.internal }}
{{- $given := $tls.existingSecrets }}
{{- if and $tls.enabled (or $given.frontend $given.core $given.worker) (not (and $given.frontend $given.core $given.worker)) }}
{{- fail "tls.internal.existingSecrets: name the Secrets of all three roles (frontend, core, worker; one CA) or none (Helm then generates them)" }}
{{- end }}
{{- range $component := list "frontend" "core" "worker" }}
{{- $explicit := int (get (get $.Values $component) "terminationGracePeriodSeconds") }}
{{- $drain := int (include "splitserve.drainSeconds" (dict "root" $ "component" $component)) }}
{{- if and $explicit (le $explicit $drain) }}
{{- fail (printf "%s.terminationGracePeriodSeconds %d leaves no time after the drain (preStop sleep + shutdownTimeout = %d s): raise it, or set 0 to have it computed" $component $explicit $drain) }}
{{- end }}
{{- end }}
{{- $fe := .Values.frontend }}
{{- if and (include "splitserve.isPublicTls" .) (has (int $fe.healthPort) (list (int $fe.port) (int $fe.httpPort) (int $fe.metricsPort))) }}
{{- fail (printf "frontend.healthPort %d collides with another frontend port" (int $fe.healthPort)) }}
{{- end }}
{{- $core := .Values.core }}
{{- if and $tls.enabled (has (int $core.healthPort) (list (int $core.port) (int $core.metricsPort))) }}
{{- fail (printf "core.healthPort %d collides with another core port" (int $core.healthPort)) }}
{{- end }}
{{- $w := .Values.worker }}
{{- $perPod := int (include "splitserve.ranksPerPod" .) }}
{{- $h := int $w.healthPort }}
{{- if and $tls.enabled (or (eq $h (int $w.distributedPort)) (and (le (int $w.port) $h) (lt $h (add (int $w.port) $perPod))) (and (le (int $w.metricsPort) $h) (lt $h (add (int $w.metricsPort) $perPod)))) }}
{{- fail (printf "worker.healthPort %d collides with a rank's gRPC, metrics or rendezvous port" $h) }}
{{- end }}
{{- if and $fe.httpIngress.enabled (not $fe.httpPort) }}
{{- fail "frontend.httpIngress needs frontend.httpPort (the OpenAI HTTP port)" }}
{{- end }}
{{- end }}

{{/* Engine groups (_engine.tpl) and their gateway. */}}
{{- define "splitserve.validateEngines" -}}
{{- $e := .Values.engines }}
{{- if and $e.autoscaling.enabled $e.keda.enabled }}
{{- fail "engines.autoscaling.enabled (HPA) and engines.keda.enabled (KEDA ScaledObject, which owns an HPA of its own) are mutually exclusive: enable one" }}
{{- end }}
{{- if $e.pd.enabled }}
{{- if or $e.autoscaling.enabled $e.keda.enabled }}
{{- fail "engines.pd: the prefill and decode groups have fixed counts (engines.pd.prefillReplicas, decodeReplicas); engine autoscaling is not supported with them" }}
{{- end }}
{{- if gt (int (include "splitserve.worldSize" .)) 1 }}
{{- fail (printf "engines.pd: the KV connector moves KV between engines of one rank; parallelism is %d ranks" (int (include "splitserve.worldSize" .))) }}
{{- end }}
{{- if not .Values.gateway.enabled }}
{{- fail "engines.pd needs the gateway (gateway.enabled): it sends each request's prefill and decode legs" }}
{{- end }}
{{- end }}
{{- if include "splitserve.isEngineGroups" . }}
{{- if or .Values.frontend.autoscaling.enabled .Values.frontend.keda.enabled }}
{{- fail "frontend.autoscaling / frontend.keda scale the frontend Deployment of a single engine; with engine groups (engines.replicas > 1 or engine autoscaling) each engine has its own frontend: scale engines with engines.autoscaling or engines.keda" }}
{{- end }}
{{- if and (eq .Values.gateway.discovery "static") (or $e.autoscaling.enabled $e.keda.enabled) }}
{{- fail "gateway.discovery static lists the engines.replicas engines once; with engine autoscaling the gateway must watch the engines come and go: gateway.discovery kubernetes" }}
{{- end }}
{{- if or .Values.frontend.ingress.enabled .Values.frontend.httpIngress.enabled }}
{{- fail "frontend.ingress / httpIngress route to the frontend Service of a single engine; with engine groups clients reach the gateway Service (<fullname>-gateway): put your Ingress in front of it" }}
{{- end }}
{{- end }}
{{- end }}
