{{/* Names: <release>-kvgate unless the release name already says kvgate. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.fullname" -}}
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

{{- define "kvgate.gatewayName" -}}
{{- printf "%s-gateway" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.workerName" -}}
{{- printf "%s-worker" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.gatewayName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end }}

{{/* Selector labels; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* repository@digest when a digest pins the image, else repository:tag. */}}
{{- define "kvgate.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* The pod-level settings every workload takes; call with its values (.Values.gateway, ...). */}}
{{- define "kvgate.podSettings" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .initContainers }}
initContainers:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A workload's topology spread: its own constraints, else with spreadAcrossNodes one that
spreads its pods across nodes (ScheduleAnyway: a one-node cluster still schedules them).
Call with (dict "ctx" . "v" .Values.gateway "component" "gateway"). */}}
{{- define "kvgate.spread" -}}
{{- if .v.topologySpreadConstraints }}
{{- toYaml .v.topologySpreadConstraints }}
{{- else if .v.spreadAcrossNodes }}
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "kvgate.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 6 }}
{{- end }}
{{- end }}

{{- define "kvgate.servedModelName" -}}
{{- if .Values.model.servedModelName }}
{{- .Values.model.servedModelName }}
{{- else if .Values.model.demo }}
{{- "demo" }}
{{- else }}
{{- base .Values.model.path }}
{{- end }}
{{- end }}

{{/* Probes on /health (or "path"); call with (dict "probe" .Values.x.probes.readiness). */}}
{{- define "kvgate.httpProbe" -}}
httpGet:
  path: {{ .path | default "/health" }}
  port: http
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
timeoutSeconds: 5
{{- end }}

{{/* The Secret holding the shared worker token (docs/security.md). */}}
{{- define "kvgate.workerTokenSecret" -}}
{{- default (printf "%s-worker-token" (include "kvgate.fullname" .)) .Values.workerAuth.existingSecret }}
{{- end }}

{{/* KVGATE_WORKER_TOKEN from that Secret, for gateway and worker containers (an env list entry). */}}
{{- define "kvgate.workerTokenEnv" -}}
- name: KVGATE_WORKER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvgate.workerTokenSecret" . }}
      key: {{ .Values.workerAuth.secretKey }}
{{- end }}

{{- define "kvgate.eppName" -}}
{{- printf "%s-epp" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.poolName" -}}
{{- default (include "kvgate.fullname" .) .Values.epp.pool.name }}
{{- end }}
