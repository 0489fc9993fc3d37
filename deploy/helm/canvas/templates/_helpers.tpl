{{/* The release's resource name: the release name, or release-chart when they differ. */}}
{{- define "canvas.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "canvas.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "canvas.labels" -}}
{{ include "canvas.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "canvas.secretName" -}}
{{- if .Values.apiKey.value -}}
{{- include "canvas.fullname" . }}-api-key
{{- else -}}
{{- .Values.apiKey.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "canvas.claimName" -}}
{{- .Values.model.existingClaim | default (printf "%s-model" (include "canvas.fullname" .)) -}}
{{- end -}}

{{- define "canvas.downloadClaimName" -}}
{{- .Values.model.downloadCache.existingClaim | default (printf "%s-hub-cache" (include "canvas.fullname" .)) -}}
{{- end -}}

{{- define "canvas.eppName" -}}
{{- include "canvas.fullname" . | trunc 59 | trimSuffix "-" }}-epp
{{- end -}}

{{/* The container's resources: .Values.resources, with nvidia.com/gpu requested and limited to
the tensor-parallel size where it is above 1 (one GPU per rank, all in this pod). */}}
{{- define "canvas.resources" -}}
{{- $resources := deepCopy .Values.resources -}}
{{- $size := int .Values.parallelism.tensorParallelSize -}}
{{- if gt $size 1 -}}
{{- range $part := list "requests" "limits" -}}
{{- $amounts := (get $resources $part) | default (dict) -}}
{{- $_ := set $amounts "nvidia.com/gpu" $size -}}
{{- $_ := set $resources $part $amounts -}}
{{- end -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}
