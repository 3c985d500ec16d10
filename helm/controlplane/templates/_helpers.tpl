{{/* Names, labels and shared snippets of the controlplane chart. */}}

{{- define "cp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels every object carries; "cp.labels" (dict "ctx" $ "component" "router"). */}}
{{- define "cp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cp.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "cp.labels" -}}
{{ include "cp.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The control plane's image (router, indexer, autoscaler): a digest pins it when given. */}}
{{- define "cp.image" -}}
{{- $img := .Values.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* Names of the generated secrets and of the in-cluster Redis. */}}
{{- define "cp.secretName" -}}{{ include "cp.fullname" . }}-secrets{{- end -}}
{{- define "cp.redisName" -}}{{ include "cp.fullname" . }}-redis{{- end -}}
{{- define "cp.routerName" -}}{{ include "cp.fullname" . }}-router{{- end -}}
{{- define "cp.engineName" -}}{{ include "cp.fullname" .ctx }}-engine-{{ .group.name }}{{- end -}}

{{/* The Redis URL every component uses (password apart, from a Secret). */}}
{{- define "cp.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc:%d/0" (include "cp.redisName" .) .Release.Namespace (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* secretKeyRef of the Redis password: the chart's secret, an existing one, or the external one. */}}
{{- define "cp.redisPasswordRef" -}}
{{- if .Values.redis.enabled -}}
name: {{ default (include "cp.secretName" .) .Values.redis.auth.existingSecret }}
key: {{ .Values.redis.auth.existingSecretKey }}
{{- else -}}
name: {{ required "redis.external.passwordSecret.name is required with an external Redis" .Values.redis.external.passwordSecret.name }}
key: {{ .Values.redis.external.passwordSecret.key }}
{{- end -}}
{{- end -}}

{{/* A secret's key: the existing secret when named, else the chart's own. */}}
{{- define "cp.secretRef" -}}
name: {{ default (include "cp.secretName" .ctx) .ref.existingSecret }}
key: {{ .ref.existingSecretKey }}
{{- end -}}

{{/* Restricted pod and container security contexts (the image runs as uid 10001). */}}
{{- define "cp.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsUser }}
fsGroup: {{ .Values.securityContext.runAsUser }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "cp.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The engine groups the chart runs (empty unless engines.enabled). */}}
{{- define "cp.engineGroups" -}}
{{- if .Values.engines.enabled -}}{{ toJson .Values.engines.groups }}{{- else -}}[]{{- end -}}
{{- end -}}

{{/* Label selector of the chart's engine pods (router discovery). */}}
{{- define "cp.engineSelector" -}}
{{- printf "app.kubernetes.io/instance=%s,app.kubernetes.io/component=engine" .Release.Name -}}
{{- end -}}

{{/* Seconds a router pod needs to stop: preStop sleep + drain window + grace, rounded up. */}}
{{- define "cp.routerStopSeconds" -}}
{{- $s := .Values.router.shutdown -}}
{{- add (int .Values.router.preStopSleepSeconds) (ceil (addf $s.drainSeconds $s.graceSeconds) | int) -}}
{{- end -}}

{{/* The indexer's sources (JSON list): every ordinal up to each engine group's largest size, then
indexer.replicas; empty when the indexer is off. */}}
{{- define "cp.indexerSources" -}}
{{- $ctx := . -}}
{{- if .Values.indexer.enabled -}}
{{- $groups := include "cp.engineGroups" $ctx | fromJsonArray -}}
{{- $sources := list -}}
{{- range $g := $groups -}}
{{- $max := int (default 1 $g.replicas) -}}
{{- range $t := $ctx.Values.autoscaler.targets -}}
{{- if and $ctx.Values.autoscaler.enabled (eq (default "" $t.engineGroup) $g.name) (gt (int $t.maxReplicas) $max) }}{{ $max = int $t.maxReplicas }}{{ end -}}
{{- end -}}
{{- $sts := include "cp.engineName" (dict "ctx" $ctx "group" $g) -}}
{{- range $i := until $max -}}
{{- $host := printf "%s-%d.%s.%s.svc" $sts $i $sts $ctx.Release.Namespace -}}
{{- $src := dict "id" (printf "%s-%d" $sts $i) "model" $g.servedModelName "events" (printf "tcp://%s:%d" $host (int $ctx.Values.engines.kvEvents.port)) "replay" (printf "tcp://%s:%d" $host (int $ctx.Values.engines.kvEvents.replayPort)) "topic" $ctx.Values.engines.kvEvents.topic "block_size" (int (default 16 $g.blockSize)) -}}
{{- $sources = append $sources $src -}}
{{- end -}}
{{- end -}}
{{- $sources = concat $sources $ctx.Values.indexer.replicas -}}
{{- toJson $sources -}}
{{- else -}}[]{{- end -}}
{{- end -}}
