{{/*
The model. Who reads what:
  workers   the weights, from the model volume (read-only) at "<mountPath>/<subPath>", the path
            the engine core sends them in LoadModel;
  frontend  the tokenizer files only: from the model volume (read-only) for pvc / hostPath, or,
            for hub, downloaded by its own init container into its cache emptyDir;
  core      nothing: it only forwards the path, so it mounts no model volume.
*/}}

{{- define "splitserve.hasModelVolume" -}}
{{- if ne .Values.model.source "embedded" }}true{{ end }}
{{- end }}

{{- define "splitserve.isHub" -}}
{{- if eq .Values.model.source "hub" }}true{{ end }}
{{- end }}

{{/* The checkpoint folder as the workers see it ("tiny" = the embedded tiny demo model). */}}
{{- define "splitserve.modelPath" -}}
{{- if not (include "splitserve.hasModelVolume" .) }}
{{- "tiny" }}
{{- else }}
{{- $sub := trimAll "/" .Values.model.subPath }}
{{- if and (not $sub) (include "splitserve.isHub" .) }}
{{- $sub = .Values.model.hub.repoId }}
{{- end }}
{{- if $sub }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) $sub }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/* The folder the frontend loads its tokenizer from ("tiny" = the embedded tiny demo model). */}}
{{- define "splitserve.frontendModelPath" -}}
{{- if include "splitserve.isHub" . }}
{{- printf "%s/hub-tokenizer" (trimSuffix "/" .Values.cache.mountPath) }}
{{- else }}
{{- include "splitserve.modelPath" . }}
{{- end }}
{{- end }}

{{/* Does the frontend mount the model volume (pvc, hostPath)? */}}
{{- define "splitserve.frontendMountsModel" -}}
{{- if and (include "splitserve.hasModelVolume" .) (not (include "splitserve.isHub" .)) }}true{{ end }}
{{- end }}

{{/* The name clients and metrics see: as the engine core derives it, or the Hub repo id (as vLLM). */}}
{{- define "splitserve.servedModelName" -}}
{{- if .Values.model.servedModelName }}
{{- .Values.model.servedModelName }}
{{- else if include "splitserve.isHub" . }}
{{- .Values.model.hub.repoId }}
{{- else if include "splitserve.hasModelVolume" . }}
{{- base (include "splitserve.modelPath" .) }}
{{- else -}}
tiny-llama-v1
{{- end }}
{{- end }}

{{/* The served model name as a label value (pod label "model"): at most 63 of [A-Za-z0-9._-],
alphanumeric at both ends ("meta-llama/Llama-3.1-8B" -> "meta-llama-Llama-3.1-8B"). */}}
{{- define "splitserve.modelLabel" -}}
{{- $value := regexReplaceAll "[^A-Za-z0-9._-]+" (include "splitserve.servedModelName" .) "-" | trunc 63 | trimAll "-._" }}
{{- $value | default "model" }}
{{- end }}

{{- define "splitserve.modelClaimName" -}}
{{- if .Values.model.pvc.existingClaim }}
{{- .Values.model.pvc.existingClaim }}
{{- else }}
{{- include "splitserve.fullname" . }}-model
{{- end }}
{{- end }}

{{/* The model volume (pvc, hub, hostPath); writable only for the hub download init containers. */}}
{{- define "splitserve.modelVolume" -}}
{{- if include "splitserve.hasModelVolume" . -}}
- name: model
{{- if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ include "splitserve.modelClaimName" . }}
    readOnly: {{ not (include "splitserve.isHub" .) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "splitserve.modelVolumeMount" -}}
{{- if include "splitserve.hasModelVolume" . -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
Init container that downloads from the Hugging Face Hub with huggingface_hub.snapshot_download:
(dict "root" $ "image" IMAGE "pullPolicy" POLICY "target" FOLDER "patterns" LIST "mount" VOLUMEMOUNTS).
Idempotent: files already in the folder (same revision) are not downloaded again.
*/}}
{{- define "splitserve.hubDownloadContainer" -}}
{{- $root := .root }}
{{- $hub := $root.Values.model.hub -}}
- name: model-download
  image: {{ .image }}
  imagePullPolicy: {{ .pullPolicy }}
  command:
    - python
    - -c
    - |-
      import os, sys
      from huggingface_hub import snapshot_download
      repo_id, revision, local_dir, max_workers, *patterns = sys.argv[1:]
      print(f"downloading {repo_id} ({revision}) into {local_dir}", flush=True)
      path = snapshot_download(
          repo_id, revision=revision, local_dir=local_dir,
          allow_patterns=patterns or None, max_workers=int(max_workers),
      )
      print(f"downloaded {repo_id} ({revision}): {sorted(os.listdir(path))}", flush=True)
  args:
    - {{ $hub.repoId | quote }}
    - {{ $hub.revision | quote }}
    - {{ .target | quote }}
    - {{ $hub.maxWorkers | int | quote }}
    {{- range .patterns }}
    - {{ . | quote }}
    {{- end }}
  envFrom:
    {{- include "splitserve.envFrom" $root | nindent 4 }}
  env:
    - name: HF_HUB_OFFLINE
      value: "0"
    {{- with $hub.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- with $hub.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $hub.tokenSecret.key }}
    {{- end }}
    {{- with $root.Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $hub.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "splitserve.scratchVolumeMounts" $root | nindent 4 }}
    {{- with .mount }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* NetworkPolicy egress rule for the download init containers (networkPolicy.restrictEgress). */}}
{{- define "splitserve.hubEgress" -}}
{{- if include "splitserve.isHub" . -}}
# model download from the Hugging Face Hub (HTTPS)
- to:
    {{- toYaml .Values.model.hub.egressTo | nindent 4 }}
  ports:
    - port: 443
      protocol: TCP
{{- end }}
{{- end }}
