{{/*
The engine core's and the frontend's containers, shared by their own Deployments (one engine per
release) and the engine-group leader pod (engines.replicas engines, _engine.tpl), where both run
side by side: there the core's ports are named "core-<name>" (a pod's port names are unique) and
the frontend reaches the core in its own pod.
*/}}

{{/* Name of the core's port `name`: (dict "prefix" "core-" "name" "grpc"). */}}
{{- define "splitserve.corePortName" -}}{{ .prefix }}{{ .name }}{{- end }}

{{/*
The engine core container: (dict "root" $ "workerAddrs" "h:p,..." "distInit" "tcp://h:p"
"engineId" "0" ["portPrefix" "core-"] ["env" LIST] ["tlsVolume" NAME]).
*/}}
{{- define "splitserve.coreContainer" -}}
{{- $root := .root }}
{{- $core := $root.Values.core }}
{{- $par := $root.Values.parallelism }}
{{- $tls := include "splitserve.isInternalTls" $root }}
{{- /* With mutual TLS the kubelet's gRPC probes use the plaintext health-only port. */}}
{{- $probePort := ternary $core.healthPort $core.port (not (empty $tls)) }}
{{- $prefix := .portPrefix | default "" -}}
- name: core
  image: {{ include "splitserve.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["splitserve", "core"]
  args:
    # The pod's IP: frontends reach it through the core Service, nothing else on the node does.
    - --host
    - {{ $root.Values.internalListenAddress | quote }}
    - --port
    - {{ $core.port | int | quote }}
    - --metrics-port
    - {{ $core.metricsPort | int | quote }}
    - --engine-id
    - {{ .engineId | quote }}
    {{- with include "splitserve.modelPath" $root }}
    # The path the workers load from (their model volume); the core itself reads nothing.
    - --model
    - {{ . | quote }}
    {{- end }}
    - --tensor-parallel-size
    - {{ $par.tensorParallelSize | int | quote }}
    - --pipeline-parallel-size
    - {{ $par.pipelineParallelSize | int | quote }}
    # Rank order: rank = pp_rank * tp + tp_rank (_layout.tpl: which pod and port holds it).
    - --worker-addrs
    - {{ .workerAddrs | quote }}
    - --distributed-init-method
    - {{ .distInit | quote }}
    - --shutdown-timeout
    - {{ $core.shutdownTimeout | quote }}
    {{- if $tls }}
    - --health-port
    - {{ $core.healthPort | int | quote }}
    # Mutual TLS: serves frontends and calls the workers with splitserve-core's certificate.
    {{- include "splitserve.internalTlsArgs" $root | nindent 4 }}
    {{- end }}
    {{- range .args }}
    - {{ . | quote }}
    {{- end }}
    {{- range $core.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  envFrom:
    {{- include "splitserve.envFrom" $root | nindent 4 }}
  env:
    {{- include "splitserve.env" (dict "root" $root "values" $core "component" "core" "extra" .env) | nindent 4 }}
  ports:
    - name: {{ include "splitserve.corePortName" (dict "prefix" $prefix "name" "grpc") }}
      containerPort: {{ $core.port }}
      protocol: TCP
    - name: {{ include "splitserve.corePortName" (dict "prefix" $prefix "name" "metrics") }}
      containerPort: {{ $core.metricsPort }}
      protocol: TCP
    {{- if $tls }}
    - name: {{ include "splitserve.corePortName" (dict "prefix" $prefix "name" "health") }}
      containerPort: {{ $core.healthPort }}
      protocol: TCP
    {{- end }}
  startupProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $core.probes.startup "port" $probePort "service" (include "splitserve.readinessService.core" $root)) | nindent 4 }}
  livenessProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $core.probes.liveness "port" $probePort "service" "") | nindent 4 }}
  readinessProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $core.probes.readiness "port" $probePort "service" (include "splitserve.readinessService.core" $root)) | nindent 4 }}
  {{- with include "splitserve.lifecycle" (dict "root" $root "component" "core") }}
  {{- . | nindent 2 }}
  {{- end }}
  resources:
    {{- toYaml $core.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "splitserve.scratchVolumeMounts" $root | nindent 4 }}
    {{- with include "splitserve.internalTlsMount" (dict "root" $root "volume" .tlsVolume) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $core.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
The frontend container: (dict "root" $ "coreAddr" "h:p" ["args" LIST] ["env" LIST] ["tlsVolume"
NAME] ["noApiKey" true]): `args` go after the chart's own flags, `env` after its variables.
*/}}
{{- define "splitserve.frontendContainer" -}}
{{- $root := .root }}
{{- $fe := $root.Values.frontend }}
{{- $publicTls := include "splitserve.isPublicTls" $root }}
{{- /* gRPC probes reach the plaintext health port when the public port speaks TLS. */}}
{{- $grpcProbePort := ternary $fe.healthPort $fe.port (not (empty $publicTls)) -}}
- name: frontend
  image: {{ include "splitserve.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["splitserve", "frontend"]
  args:
    - --host
    - {{ $root.Values.listenAddress | quote }}
    - --port
    - {{ $fe.port | int | quote }}
    - --metrics-port
    - {{ $fe.metricsPort | int | quote }}
    - --core-addr
    - {{ .coreAddr | quote }}
    # OpenAI-compatible HTTP (-1: off; the service's own default would be 8000).
    - --http-port
    - {{ $fe.httpPort | default -1 | int | quote }}
    - --shutdown-timeout
    - {{ $fe.shutdownTimeout | quote }}
    {{- if $publicTls }}
    - --health-port
    - {{ $fe.healthPort | int | quote }}
    {{- end }}
    {{- with include "splitserve.publicTlsArgs" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "splitserve.internalTlsArgs" $root }}
    # Mutual TLS to the engine core (this frontend's certificate names splitserve-frontend).
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "splitserve.frontendModelPath" $root }}
    # Where the tokenizer files are (the frontend loads nothing else of the model).
    - --model
    - {{ . | quote }}
    {{- end }}
    {{- range .args }}
    - {{ . | quote }}
    {{- end }}
    {{- range $fe.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  envFrom:
    {{- include "splitserve.envFrom" $root | nindent 4 }}
  {{- with include "splitserve.env" (dict "root" $root "values" $fe "component" "frontend" "extra" .env "noApiKey" .noApiKey) }}
  env:
    {{- . | nindent 4 }}
  {{- end }}
  ports:
    - name: grpc
      containerPort: {{ $fe.port }}
      protocol: TCP
    - name: metrics
      containerPort: {{ $fe.metricsPort }}
      protocol: TCP
    {{- with $fe.httpPort }}
    - name: http
      containerPort: {{ . }}
      protocol: TCP
    {{- end }}
    {{- if $publicTls }}
    - name: health
      containerPort: {{ $fe.healthPort }}
      protocol: TCP
    {{- end }}
  {{- if $fe.httpPort }}
  # Ready = GET /health answers 200: the engine core can serve and this frontend is not
  # draining (the port routers and the InferencePool send requests to).
  startupProbe:
    {{- include "splitserve.httpProbe" (dict "probe" $fe.probes.startup "port" "http" "path" "/health" "scheme" (ternary "HTTPS" "HTTP" (not (empty $publicTls)))) | nindent 4 }}
  readinessProbe:
    {{- include "splitserve.httpProbe" (dict "probe" $fe.probes.readiness "port" "http" "path" "/health" "scheme" (ternary "HTTPS" "HTTP" (not (empty $publicTls)))) | nindent 4 }}
  {{- else }}
  startupProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $fe.probes.startup "port" $grpcProbePort "service" (include "splitserve.readinessService.frontend" $root)) | nindent 4 }}
  readinessProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $fe.probes.readiness "port" $grpcProbePort "service" (include "splitserve.readinessService.frontend" $root)) | nindent 4 }}
  {{- end }}
  # Live = the process serves gRPC health (not the engine: a lost core is not fixed by a restart here).
  livenessProbe:
    {{- include "splitserve.grpcProbe" (dict "probe" $fe.probes.liveness "port" $grpcProbePort "service" "") | nindent 4 }}
  {{- with include "splitserve.lifecycle" (dict "root" $root "component" "frontend") }}
  {{- . | nindent 2 }}
  {{- end }}
  resources:
    {{- toYaml $fe.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "splitserve.scratchVolumeMounts" $root | nindent 4 }}
    {{- with include "splitserve.internalTlsMount" (dict "root" $root "volume" .tlsVolume) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "splitserve.publicTlsMount" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if include "splitserve.frontendMountsModel" $root }}
    {{- with include "splitserve.modelVolumeMount" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- end }}
    {{- with $fe.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The frontend's init containers (the tokenizer files from the Hub), or nothing. */}}
{{- define "splitserve.frontendInitContainers" -}}
{{- if include "splitserve.isHub" . -}}
# The tokenizer files only, into the cache emptyDir: frontends never mount the model volume.
{{ include "splitserve.hubDownloadContainer" (dict "root" . "image" (include "splitserve.image" .) "pullPolicy" .Values.image.pullPolicy "target" (include "splitserve.frontendModelPath" .) "patterns" .Values.model.hub.tokenizerPatterns) }}
{{- end }}
{{- end }}
