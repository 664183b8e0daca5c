{{/* Names and labels. Kept inside the subset tests/deploy/helm_render.py supports. */}}
{{- define "proxima.fullname" -}}
{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "proxima.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "proxima.labels" -}}
{{ include "proxima.selectorLabels" . }}
app.kubernetes.io/component: kv-tier
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "proxima.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Refuse values that cannot work together. */}}
{{- define "proxima.checkReserved" -}}
{{- if .Values.cluster.enabled }}{{ if not .Values.cluster.peerTokenSecret }}{{ fail "cluster.enabled needs cluster.peerTokenSecret: the Secret with the token daemons present to each other" }}{{ end }}{{ end }}
{{- end }}
