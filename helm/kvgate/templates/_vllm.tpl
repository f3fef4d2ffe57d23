{{/* vLLM as the worker (worker.kind=vllm): its flags and environment, and the checks. */}}

{{- define "kvgate.vllm.topic" -}}
kv@$(POD_NAME)@{{ include "kvgate.servedModelName" . }}
{{- end }}

{{/* vLLM's --kv-events-config: its PUB and replay ROUTER bind on every interface; rank r of a
data-parallel pod offsets both ports by r. */}}
{{- define "kvgate.vllm.kvEventsConfig" -}}
{{- $w := .Values.worker }}
{{- dict
  "enable_kv_cache_events" true
  "publisher" "zmq"
  "endpoint" (printf "tcp://*:%d" (int $w.ports.kvEvents))
  "replay_endpoint" (printf "tcp://*:%d" (int $w.ports.kvReplay))
  "buffer_steps" (int $w.vllm.kvEventsBufferSteps)
  "topic" (include "kvgate.vllm.topic" .)
  | toJson }}
{{- end }}

{{- define "kvgate.vllm.args" -}}
{{- $m := .Values.model }}
{{- $w := .Values.worker -}}
- --model={{ $m.path }}
- --served-model-name={{ include "kvgate.servedModelName" . }}
- --host=0.0.0.0
- --port={{ $w.ports.http }}
- --dtype={{ $w.dtype }}
- --block-size={{ $w.blockSize }}
- --enable-prefix-caching
- --prefix-caching-hash-algo={{ $w.vllm.hashAlgo }}
- {{ printf "--kv-events-config=%s" (include "kvgate.vllm.kvEventsConfig" .) | quote }}
{{- if gt (int $w.vllm.dataParallelSize) 1 }}
- --data-parallel-size={{ $w.vllm.dataParallelSize }}
{{- end }}
{{- with $w.maxModelLen }}
- --max-model-len={{ . }}
{{- end }}
{{- with $w.maxNumSeqs }}
- --max-num-seqs={{ . }}
{{- end }}
{{- with $w.numBlocks }}
- --num-gpu-blocks-override={{ . }}
{{- end }}
{{- end }}

{{/* The chart's root filesystem is read-only: vLLM's caches go to the cache emptyDir. */}}
{{- define "kvgate.vllm.env" -}}
- name: POD_NAME  # in the KV-events topic, as llm-d names its topics
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /var/cache/kvgate
- name: HF_HOME
  value: /var/cache/kvgate/huggingface
- name: VLLM_CACHE_ROOT
  value: /var/cache/kvgate/vllm
{{- if .Values.workerAuth.enabled }}
# vLLM's --api-key: the worker token every gateway sends as its bearer (vLLM checks /v1/* only).
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvgate.workerTokenSecret" . }}
      key: {{ .Values.workerAuth.secretKey }}
{{- end }}
{{- end }}

{{- define "kvgate.vllm.check" -}}
{{- $w := .Values.worker }}
{{- if eq $w.kind "vllm" }}
{{- if or .Values.model.demo (not .Values.model.existingClaim) .Values.model.claimTemplate.enabled }}
{{- fail "worker.kind=vllm: set model.existingClaim to a volume holding the model (ReadOnlyMany): the gateway reads its tokenizer and chat template from the same volume" }}
{{- end }}
{{- $n := int $w.vllm.dataParallelSize }}
{{- $e := int $w.ports.kvEvents }}
{{- $r := int $w.ports.kvReplay }}
{{- if and (lt $e (add $r $n)) (lt $r (add $e $n)) }}
{{- fail (printf "worker.ports: vLLM offsets both KV-event ports by the rank; with dataParallelSize=%d the ranges %d-%d and %d-%d overlap" $n $e (add $e $n -1) $r (add $r $n -1)) }}
{{- end }}
{{- end }}
{{- end }}
