{{/* A worker's grace period: the preStop sleep, the drain and 5 s to exit, unless set (then it
must cover them). */}}
{{- define "kvgate.workerGracePeriod" -}}
{{- $w := .Values.worker }}
{{- $need := add $w.preStopSleepSeconds $w.drainTimeoutSeconds 5 }}
{{- if kindIs "invalid" $w.terminationGracePeriodSeconds }}
{{- $need }}
{{- else if lt (int $w.terminationGracePeriodSeconds) (int $need) }}
{{- fail (printf "worker.terminationGracePeriodSeconds %v must cover worker.preStopSleepSeconds + worker.drainTimeoutSeconds + 5 = %v" $w.terminationGracePeriodSeconds $need) }}
{{- else }}
{{- $w.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}
