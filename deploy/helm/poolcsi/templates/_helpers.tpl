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

{{/*
RBAC of csi-snapshotter (kubernetes-csi/external-snapshotter v8): it updates the
VolumeSnapshotContents of its driver and their status, reads the classes, and, as the
VolumeGroupSnapshot feature is on by default in v8, looks for the group snapshot CRDs and
watches their objects when they are installed, and takes the group snapshots of its driver
(docs/snapshots.md).
*/}}
{{- define "poolcsi.snapshotterRules" -}}
- apiGroups: [snapshot.storage.k8s.io]
  resources: [volumesnapshotclasses]
  verbs: [get, list, watch]
- apiGroups: [snapshot.storage.k8s.io]
  resources: [volumesnapshotcontents]
  verbs: [get, list, watch, update, patch]
- apiGroups: [snapshot.storage.k8s.io]
  resources: [volumesnapshotcontents/status]
  verbs: [update, patch]
- apiGroups: [groupsnapshot.storage.k8s.io]
  resources: [volumegroupsnapshotclasses]
  verbs: [get, list, watch]
- apiGroups: [groupsnapshot.storage.k8s.io]
  resources: [volumegroupsnapshotcontents]
  verbs: [get, list, watch, update, patch]
- apiGroups: [groupsnapshot.storage.k8s.io]
  resources: [volumegroupsnapshotcontents/status]
  verbs: [update, patch]
{{- end }}

{{/* The Secret holding the cluster's share key (key "key"): shareKey.existingSecret, or
its former name shares.keySecret. templates/sharekey.yaml refuses to render without one
where it is needed. */}}
{{- define "poolcsi.shareKeySecret" -}}
{{- (.Values.shareKey).existingSecret | default .Values.shares.keySecret -}}
{{- end -}}
