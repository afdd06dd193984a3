{{/*
Chart name, overridable; truncated to 63 characters (the DNS label limit that
Service names and label values have).
*/}}
{{- define "sgl-sparse.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's resources: the release name alone when it already
contains the chart name (avoids "sgl-sparse-sgl-sparse").
*/}}
{{- define "sgl-sparse.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sgl-sparse.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that never change for a release: the Deployment's immutable selector. */}}
{{- define "sgl-sparse.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sgl-sparse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sgl-sparse.labels" -}}
helm.sh/chart: {{ include "sgl-sparse.chart" . }}
{{ include "sgl-sparse.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: server
{{- end }}

{{- define "sgl-sparse.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sgl-sparse.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sgl-sparse.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* GPUs per pod: gpu.count, or one per tensor-parallel rank, plus asyncspade's
cache GPU where sparse.config sets query_aware.asyncspade.cache_device (the server
refuses it beside TP > 1, so the chart does too). */}}
{{- define "sgl-sparse.gpuCount" -}}
{{- $tp := int .Values.tensorParallelSize }}
{{- $cache := dig "query_aware" "asyncspade" "cache_device" "" (.Values.sparse.config | default dict) }}
{{- if and $cache (gt $tp 1) }}
{{- fail (printf "sparse.config.query_aware.asyncspade.cache_device (%s): one cache GPU serves one serving GPU; tensorParallelSize must be 1, not %d" $cache $tp) }}
{{- end }}
{{- $need := $tp }}
{{- if $cache }}
{{- $need = add $tp 1 | int }}
{{- end }}
{{- $count := $need }}
{{- if not (kindIs "invalid" .Values.gpu.count) }}
{{- $count = int .Values.gpu.count }}
{{- end }}
{{- if lt $count $tp }}
{{- fail (printf "gpu.count (%d) is smaller than tensorParallelSize (%d): each TP rank needs its own GPU" $count $tp) }}
{{- end }}
{{- if lt $count $need }}
{{- fail (printf "gpu.count (%d): sparse.config.query_aware.asyncspade.cache_device (%s) needs a GPU beside the serving one" $count $cache) }}
{{- end }}
{{- $count }}
{{- end }}

{{/* Where --sparse-config points inside the container. */}}
{{- define "sgl-sparse.sparseConfigDir" -}}
/etc/sgl-sparse
{{- end }}

{{/* The model volume, from model.volume.type. */}}
{{- define "sgl-sparse.modelVolume" -}}
{{- $v := .Values.model.volume -}}
- name: model
{{- if eq $v.type "pvc" }}
{{- if not $v.claimName }}
{{- fail "model.volume.claimName is required when model.volume.type is pvc" }}
{{- end }}
  persistentVolumeClaim:
    claimName: {{ $v.claimName }}
{{- else if eq $v.type "hostPath" }}
{{- if not $v.path }}
{{- fail "model.volume.path is required when model.volume.type is hostPath" }}
{{- end }}
  hostPath:
    path: {{ $v.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ $v.sizeLimit }}
{{- end }}
{{- end }}

{{/*
extraArgs, after refusing literal API keys: values end up in the release Secret
and in `helm get values`. A key flag's value must be a $(VAR) reference to an
env variable filled from a Secret (extraEnv), as apiKey.existingSecret does.
*/}}
{{- define "sgl-sparse.extraArgs" -}}
{{- $keyFlag := "^--(admin-)?api-key$" }}
{{- $ref := "^\\$\\([A-Za-z_][A-Za-z0-9_]*\\)$" }}
{{- $prev := "" }}
{{- range .Values.extraArgs }}
{{- $value := "" }}
{{- $isKey := false }}
{{- if regexMatch "^--(admin-)?api-key=" . }}
{{- $isKey = true }}
{{- $value = regexReplaceAll "^--(admin-)?api-key=" . "" }}
{{- else if regexMatch $keyFlag $prev }}
{{- $isKey = true }}
{{- $value = . }}
{{- end }}
{{- if and $isKey (not (regexMatch $ref $value)) }}
{{- fail "extraArgs: a literal API key would be stored in the release; use apiKey.existingSecret (or, for --admin-api-key, an extraEnv variable from a Secret and its reference \"$(VAR)\" as the value)" }}
{{- end }}
{{- $prev = . }}
- {{ . | quote }}
{{- end }}
{{- end }}
