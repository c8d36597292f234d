{{/* Common labels. */}}
{{- define "poolcsi.labels" -}}
app.kubernetes.io/name: poolcsi
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "poolcsi.selector" -}}
app.kubernetes.io/name: poolcsi
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "poolcsi.fullname" -}}
{{- if eq .Release.Name "poolcsi" -}}poolcsi{{- else -}}{{ printf "%s-poolcsi" .Release.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "poolcsi.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Directory of a driver's socket on the host: kubelet's plugins dir + driver name. */}}
{{- define "poolcsi.pluginDir" -}}
{{ .root.Values.kubeletDir }}/plugins/{{ .driver }}
{{- end -}}

{{/* A host-path volume name for a pool. */}}
{{- define "poolcsi.poolVolume" -}}
pool-{{ .kind }}-{{ .name | lower | replace "_" "-" | replace "." "-" }}
{{- end -}}
