{{/*
Transport security and drain of the pods (docs/deploy.md#security, #drain).

Internal mutual TLS: each role (frontend, core, worker) reads its certificate, key and CA from a
Secret with the keys tls.crt, tls.key and ca.crt, mounted read-only at the path below. The Secrets
are the user's (tls.internal.existingSecrets) or generated here: one CA and three certificates,
made once per rendering (the bundle is kept in .Values for the other templates of the same
rendering) and, on `helm upgrade`, taken over from the Secrets already in the cluster (lookup),
so that upgrades keep them. `helm template` cannot look up: it makes new ones every time.
*/}}

{{- define "splitserve.internalTlsMountPath" -}}/etc/splitserve/internal-tls{{- end }}
{{- define "splitserve.publicTlsMountPath" -}}/etc/splitserve/public-tls{{- end }}
{{- define "splitserve.internalTlsRoles" -}}frontend core worker{{- end }}

{{- define "splitserve.isInternalTls" -}}
{{- if .Values.tls.internal.enabled }}true{{ end }}
{{- end }}

{{/* "true" when the chart generates the internal certificates (no existing Secrets named). */}}
{{- define "splitserve.isGeneratedTls" -}}
{{- $given := .Values.tls.internal.existingSecrets }}
{{- if and .Values.tls.internal.enabled (not (or $given.frontend $given.core $given.worker)) }}true{{ end }}
{{- end }}

{{/* Name of a role's Secret: (dict "root" $ "role" "core"). */}}
{{- define "splitserve.internalTlsSecret" -}}
{{- $given := get .root.Values.tls.internal.existingSecrets .role }}
{{- $given | default (printf "%s-internal-tls-%s" (include "splitserve.fullname" .root) .role) }}
{{- end }}

{{/*
The generated bundle: role -> {tls.crt, tls.key, ca.crt} (base64, as Secret data). Reused from
the cluster when all three Secrets exist there with one CA; otherwise a new CA (genCA) signs a
certificate per role (genSignedCert, server and client use) named after the role, plus
"<role>.<fullname>.<namespace>" so that engines of different releases have different
identities (worker ownership, docs/reliability.md).
*/}}
{{- define "splitserve.internalTlsBundle" -}}
{{- if not (hasKey .Values "_splitserveInternalTls") }}
{{- $root := . }}
{{- $bundle := dict }}
{{- $cas := list }}
{{- range $role := splitList " " (include "splitserve.internalTlsRoles" .) }}
{{- $name := include "splitserve.internalTlsSecret" (dict "root" $root "role" $role) }}
{{- $found := lookup "v1" "Secret" $root.Release.Namespace $name }}
{{- $data := dig "data" dict $found }}
{{- if and (hasKey $data "tls.crt") (hasKey $data "tls.key") (hasKey $data "ca.crt") }}
{{- $_ := set $bundle $role (pick $data "tls.crt" "tls.key" "ca.crt") }}
{{- $cas = append $cas (get $data "ca.crt") }}
{{- end }}
{{- end }}
{{- if or (ne (len $bundle) 3) (ne (len (uniq $cas)) 1) }}
{{- $days := int .Values.tls.internal.generatedValidityDays }}
{{- $fullname := include "splitserve.fullname" . }}
{{- $ca := genCA (printf "%s internal CA" $fullname) $days }}
{{- $bundle = dict }}
{{- range $role := splitList " " (include "splitserve.internalTlsRoles" .) }}
{{- $cn := printf "splitserve-%s" $role }}
{{- $names := list $cn (printf "%s.%s.%s" $cn $fullname $root.Release.Namespace) }}
{{- $cert := genSignedCert $cn nil $names $days $ca }}
{{- $_ := set $bundle $role (dict "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) "ca.crt" ($ca.Cert | b64enc)) }}
{{- end }}
{{- end }}
{{- $_ := set .Values "_splitserveInternalTls" $bundle }}
{{- end }}
{{- toYaml (get .Values "_splitserveInternalTls") }}
{{- end }}

{{/* Pod annotation: the generated CA's fingerprint, so that new certificates roll every pod
together (a pod with another CA than its peers could not talk to them). */}}
{{- define "splitserve.internalTlsAnnotation" -}}
{{- if include "splitserve.isGeneratedTls" . -}}
checksum/internal-tls: {{ (fromYaml (include "splitserve.internalTlsBundle" .)).core | dig "ca.crt" "" | sha256sum }}
{{- end }}
{{- end }}

{{/* The role's certificate volume: (dict "root" $ "role" "core" ["volume" NAME]); a pod that
holds two roles (the engine-group leader) names its volumes apart. */}}
{{- define "splitserve.internalTlsVolume" -}}
{{- if include "splitserve.isInternalTls" .root -}}
- name: {{ .volume | default "internal-tls" }}
  secret:
    secretName: {{ include "splitserve.internalTlsSecret" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}

{{/* Its mount: $, or (dict "root" $ "volume" NAME). */}}
{{- define "splitserve.internalTlsMount" -}}
{{- $root := .root | default . }}
{{- if include "splitserve.isInternalTls" $root -}}
- name: {{ .volume | default "internal-tls" }}
  mountPath: {{ include "splitserve.internalTlsMountPath" $root }}
  readOnly: true
{{- end }}
{{- end }}

{{/* --tls-* flags of a service (its hops to the core / workers, or its own internal port). */}}
{{- define "splitserve.internalTlsArgs" -}}
{{- if include "splitserve.isInternalTls" . -}}
{{- $dir := include "splitserve.internalTlsMountPath" . -}}
- --tls-cert-file
- {{ printf "%s/tls.crt" $dir }}
- --tls-key-file
- {{ printf "%s/tls.key" $dir }}
- --tls-ca-file
- {{ printf "%s/ca.crt" $dir }}
{{- end }}
{{- end }}

{{/*
Plaintext internal hops (tls.internal.enabled false) are guarded by a shared secret instead
(--internal-secret, read from SPLITSERVE_INTERNAL_SECRET by every service): the user's Secret
(tls.internal.plaintextSecret.secretName) or one generated here, taken over from the cluster on
`helm upgrade` (lookup) so that running pods keep agreeing.
*/}}
{{- define "splitserve.isInternalSecret" -}}
{{- if not .Values.tls.internal.enabled }}true{{ end }}
{{- end }}

{{- define "splitserve.internalSecretName" -}}
{{- .Values.tls.internal.plaintextSecret.secretName | default (printf "%s-internal-secret" (include "splitserve.fullname" .)) }}
{{- end }}

{{/* The generated secret (base64, as Secret data), made once per rendering. */}}
{{- define "splitserve.generatedInternalSecret" -}}
{{- if not (hasKey .Values "_splitserveInternalSecret") }}
{{- $found := lookup "v1" "Secret" .Release.Namespace (include "splitserve.internalSecretName" .) }}
{{- $value := dig "data" .Values.tls.internal.plaintextSecret.key "" $found }}
{{- $_ := set .Values "_splitserveInternalSecret" ($value | default (randAlphaNum 48 | b64enc)) }}
{{- end }}
{{- get .Values "_splitserveInternalSecret" }}
{{- end }}

{{/* Pod annotation: the generated secret's fingerprint, so that a new one rolls every pod. */}}
{{- define "splitserve.internalSecretAnnotation" -}}
{{- if and (include "splitserve.isInternalSecret" .) (not .Values.tls.internal.plaintextSecret.secretName) -}}
checksum/internal-secret: {{ include "splitserve.generatedInternalSecret" . | sha256sum }}
{{- end }}
{{- end }}

{{/* The env entry every service reads it from (plaintext internal hops only). */}}
{{- define "splitserve.internalSecretEnv" -}}
{{- if include "splitserve.isInternalSecret" . -}}
{{- $ref := dict "name" (include "splitserve.internalSecretName" .) "key" .Values.tls.internal.plaintextSecret.key }}
{{- toYaml (list (dict "name" "SPLITSERVE_INTERNAL_SECRET" "valueFrom" (dict "secretKeyRef" $ref))) }}
{{- end }}
{{- end }}

{{/* The frontend's public TLS (frontend.ssl): volume, mount, flags. */}}
{{- define "splitserve.isPublicTls" -}}
{{- if .Values.frontend.ssl.secretName }}true{{ end }}
{{- end }}

{{- define "splitserve.publicTlsVolume" -}}
{{- $ssl := .Values.frontend.ssl -}}
{{- if $ssl.secretName -}}
- name: public-tls
  secret:
    secretName: {{ $ssl.secretName }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      {{- if $ssl.requireClientCertificate }}
      - key: ca.crt
        path: ca.crt
      {{- end }}
{{- end }}
{{- end }}

{{- define "splitserve.publicTlsMount" -}}
{{- if include "splitserve.isPublicTls" . -}}
- name: public-tls
  mountPath: {{ include "splitserve.publicTlsMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "splitserve.publicTlsArgs" -}}
{{- if include "splitserve.isPublicTls" . -}}
{{- $dir := include "splitserve.publicTlsMountPath" . -}}
- --ssl-certfile
- {{ printf "%s/tls.crt" $dir }}
- --ssl-keyfile
- {{ printf "%s/tls.key" $dir }}
{{- if .Values.frontend.ssl.requireClientCertificate }}
- --ssl-ca-certs
- {{ printf "%s/ca.crt" $dir }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Drain. (dict "root" $ "component" "frontend"): the preStop sleep, the shutdown timeout and the
grace period of the component's pods. The kubelet counts terminationGracePeriodSeconds from the
start of preStop: preStop sleep + --shutdown-timeout (the drain) + margin (closing streams and
servers) must fit in it. Workers have no preStop: on SIGTERM they refuse new calls but keep
the core's open step stream running for their own --shutdown-timeout.
*/}}
{{- define "splitserve.preStopSeconds" -}}
{{- if eq .component "worker" }}0{{ else }}{{ int .root.Values.drain.preStopSleepSeconds }}{{ end }}
{{- end }}

{{/* The component's --shutdown-timeout in whole seconds. A worker keeps the core's step stream
running for as long as the core pod may live (its grace period), unless told otherwise. */}}
{{- define "splitserve.shutdownSeconds" -}}
{{- if eq .component "worker" }}
{{- .root.Values.worker.shutdownTimeout | default (include "splitserve.terminationGrace" (dict "root" .root "component" "core")) | ceil | int }}
{{- else }}
{{- (get .root.Values .component).shutdownTimeout | ceil | int }}
{{- end }}
{{- end }}

{{/* Least grace that lets the component drain: preStop sleep + shutdown timeout. */}}
{{- define "splitserve.drainSeconds" -}}
{{- add (include "splitserve.preStopSeconds" .) (include "splitserve.shutdownSeconds" .) }}
{{- end }}

{{- define "splitserve.terminationGrace" -}}
{{- $values := get .root.Values .component }}
{{- $drain := int (include "splitserve.drainSeconds" .) }}
{{- $values.terminationGracePeriodSeconds | default (add $drain (int .root.Values.drain.marginSeconds)) | int }}
{{- end }}

{{- define "splitserve.lifecycle" -}}
{{- $seconds := int (include "splitserve.preStopSeconds" .) }}
{{- if gt $seconds 0 -}}
lifecycle:
  # Keep serving while endpoints and load balancers drop this pod, then SIGTERM starts the drain.
  preStop:
    exec:
      command: ["sleep", "{{ $seconds }}"]
{{- end }}
{{- end }}
