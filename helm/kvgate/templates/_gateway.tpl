{{/*
The gateway's own flags, environment and volumes, shared by the HTTP gateway
(gateway-deployment.yaml) and the endpoint picker (epp-deployment.yaml): both run
`python -m gateway` with the same limits, overload and tenant settings.
*/}}

{{/* vLLM workers' facts, input limits, image fetching, overload, API keys and extra flags
(after discovery). */}}
{{- define "kvgate.gatewayRequestArgs" -}}
{{- if eq .Values.worker.kind "vllm" }}
# vLLM has no /kvgate/assets: the tokenizer comes from the model volume. Its events ports come
# from the Service's named ports (kv-events, kv-replay) where discovery sees them, else from
# these flags (an InferencePool names no ports but the HTTP one); + rank each.
- --model-dir={{ .Values.model.path }}
- --vllm-kv-events-port={{ .Values.worker.ports.kvEvents }}
- --vllm-kv-events-replay-port={{ .Values.worker.ports.kvReplay }}
- "--vllm-kv-events-topic=kv@{pod}@{model}"
{{- end }}
{{- with .Values.gateway.limits }}
- --max-body-bytes={{ .maxBodyBytes | int64 }}
- --body-read-timeout={{ .bodyReadTimeoutSeconds }}
{{- if .bodyReadBudget }}
- --body-read-budget={{ .bodyReadBudget | int64 }}
{{- end }}
- --max-messages={{ .maxMessages | int64 }}
- --max-content-parts={{ .maxContentParts | int64 }}
- --max-images-per-request={{ .maxImagesPerRequest | int64 }}
- --max-image-bytes={{ .maxImageBytes | int64 }}
- --max-image-pixels={{ .maxImagePixels | int64 }}
{{- if .maxPromptTokens }}
- --max-prompt-tokens={{ .maxPromptTokens | int64 }}
{{- end }}
- --max-output-tokens={{ .maxOutputTokens | int64 }}
- --max-n={{ .maxN | int64 }}
- --max-json-depth={{ .maxJsonDepth | int64 }}
- --max-json-elements={{ .maxJsonElements | int64 }}
{{- end }}
{{- with .Values.gateway.imageFetch }}
{{- if not .remoteImages }}
- --no-remote-images
{{- end }}
{{- range .allow }}
- {{ printf "--image-fetch-allow=%s" . | quote }}
{{- end }}
- --image-fetch-timeout={{ .timeoutSeconds }}
- --image-fetch-max-bytes={{ .maxBytes | int64 }}
{{- if .allowClientUuids }}
- --allow-image-uuids
{{- end }}
{{- end }}
{{- with .Values.gateway.overload }}
- --max-inflight-per-replica={{ .maxInflightPerReplica | int64 }}
- --max-queue={{ .maxQueue | int64 }}
- --queue-timeout={{ .queueTimeoutSeconds }}
{{- end }}
- --drain-timeout={{ .Values.gateway.drainTimeoutSeconds }}
{{- if .Values.auth.existingSecret }}
- --api-keys-file=/etc/kvgate/auth/{{ .Values.auth.secretKey }}
{{- end }}
{{- range .Values.gateway.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Rollouts (values.yaml, gateway.drainTimeoutSeconds): the pod's grace period covers the
preStop sleep, the drain and 5 s to exit. */}}
{{- define "kvgate.gatewayGracePeriod" -}}
{{- add .Values.gateway.preStopSleepSeconds .Values.gateway.drainTimeoutSeconds 5 }}
{{- end }}

{{/* Serve on while the endpoints and the proxies in front forget the terminating pod. */}}
{{- define "kvgate.gatewayLifecycle" -}}
{{- if .Values.gateway.preStopSleepSeconds }}
preStop:
  exec:
    command: ["sleep", "{{ .Values.gateway.preStopSleepSeconds }}"]
{{- end }}
{{- end }}

{{- define "kvgate.gatewayEnv" -}}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: HOME
  value: /tmp
- name: KVGATE_CACHE_DIR
  value: /var/cache/kvgate
{{- if .Values.workerAuth.enabled }}
{{ include "kvgate.workerTokenEnv" . }}
{{- end }}
{{- if and .Values.auth.existingSecret .Values.auth.saltSecretKey }}
- name: KVGATE_TENANT_SALT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.existingSecret }}
      key: {{ .Values.auth.saltSecretKey }}
{{- end }}
{{- with .Values.gateway.env }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}

{{- define "kvgate.gatewayVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/kvgate
{{- if eq .Values.worker.kind "vllm" }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.auth.existingSecret }}
# A whole-directory mount (no subPath), so Secret updates reach the pod.
- name: api-keys
  mountPath: /etc/kvgate/auth
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvgate.gatewayVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir:
    sizeLimit: 1Gi
{{- if eq .Values.worker.kind "vllm" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- end }}
{{- if .Values.auth.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ .Values.auth.existingSecret }}
    items:
      - key: {{ .Values.auth.secretKey }}
        path: {{ .Values.auth.secretKey }}
{{- end }}
{{- end }}

{{/* Peers (values.yaml, gateway.peers): the gateway and EPP pods are one group, found by this
label, so the in-flight cap and the placements hold across both. */}}
{{- define "kvgate.peerLabel" -}}
kvgate.io/peer-group: {{ include "kvgate.fullname" . }}
{{- end }}

{{- define "kvgate.peerArgs" -}}
{{- if .Values.gateway.peers.enabled }}
- --peer-port={{ .Values.gateway.peers.port }}
- --peers-from-kubernetes=kvgate.io/peer-group={{ include "kvgate.fullname" . }}
- --peer-timeout={{ .Values.gateway.peers.timeoutSeconds }}
{{- end }}
{{- end }}

{{- define "kvgate.peerPort" -}}
{{- if .Values.gateway.peers.enabled }}
- name: peers
  containerPort: {{ .Values.gateway.peers.port }}
  protocol: TCP
{{- end }}
{{- end }}
