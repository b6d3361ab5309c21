{{/*
HorizontalPodAutoscaler and KEDA ScaledObject of a scalable workload: the frontend Deployment
(one engine per release), or the engine groups' LeaderWorkerSet (engines.*).
*/}}

{{/* (dict "root" $ "values" .Values.frontend.autoscaling "name" NAME "component" "frontend"
"target" (dict "apiVersion" "apps/v1" "kind" "Deployment" "name" NAME)) */}}
{{- define "splitserve.hpa" -}}
{{- $as := .values -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  labels:
    {{- include "splitserve.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  scaleTargetRef:
    {{- toYaml .target | nindent 4 }}
  minReplicas: {{ $as.minReplicas }}
  maxReplicas: {{ $as.maxReplicas }}
  metrics:
    {{- if $as.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $as.targetCPUUtilizationPercentage }}
    {{- end }}
    {{- if $as.targetMemoryUtilizationPercentage }}
    - type: Resource
      resource:
        name: memory
        target:
          type: Utilization
          averageUtilization: {{ $as.targetMemoryUtilizationPercentage }}
    {{- end }}
    {{- with $as.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $as.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* A ScaledObject on the release's waiting requests: same arguments, "values" the keda block.
The query counts each engine's gauge once (max by engine), whichever pods export it. */}}
{{- define "splitserve.scaledObject" -}}
{{- $keda := .values }}
{{- $prom := $keda.prometheus }}
{{- $sel := printf "namespace=%q, service=%q" .root.Release.Namespace (include "splitserve.metricsName" .root) }}
{{- /* The series the ServiceMonitor scrapes through the metrics Service, where only engine cores
       export it (one source per engine), so a plain sum is the queue as vLLM's KEDA examples
       write it. */}}
{{- $query := $prom.query | default (printf "sum(vllm:num_requests_waiting{%s})" $sel) -}}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ .name }}
  labels:
    {{- include "splitserve.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  scaleTargetRef:
    {{- toYaml .target | nindent 4 }}
  minReplicaCount: {{ $keda.minReplicaCount }}
  maxReplicaCount: {{ $keda.maxReplicaCount }}
  pollingInterval: {{ $keda.pollingInterval }}
  cooldownPeriod: {{ $keda.cooldownPeriod }}
  {{- with $keda.behavior }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        {{- toYaml . | nindent 8 }}
  {{- end }}
  triggers:
    - type: prometheus
      {{- with $prom.authenticationRef }}
      authenticationRef:
        name: {{ . }}
      {{- end }}
      metadata:
        serverAddress: {{ $prom.serverAddress | quote }}
        query: {{ $query | quote }}
        threshold: {{ $prom.threshold | toString | quote }}
        activationThreshold: {{ $prom.activationThreshold | toString | quote }}
{{- end }}
