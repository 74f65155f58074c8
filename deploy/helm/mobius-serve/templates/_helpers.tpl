{{/* Names and labels. */}}
{{- define "mobius.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mobius.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mobius.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "mobius.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include "mobius.selectorLabels" (list $ "router") */}}
{{- define "mobius.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "mobius.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "mobius.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mobius.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "mobius.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Ranks of one replica. */}}
{{/* Ranks of one replica: tensor and expert parallelism run over the same ranks (each degree is
1 or the world size; mobius-worker --help), so the world is the larger degree. */}}
{{- define "mobius.worldSize" -}}
{{- $tp := int .Values.worker.parallel.tp }}{{- $ep := int .Values.worker.parallel.ep }}
{{- $world := max $tp $ep }}
{{- if or (and (ne $tp 1) (ne $tp $world)) (and (ne $ep 1) (ne $ep $world)) }}
{{- fail (printf "worker.parallel: tp (%d) and ep (%d) must each be 1 or the larger of the two (they share the ranks)" $tp $ep) }}
{{- end }}
{{- $world }}
{{- end }}

{{/* single: one StatefulSet, a pod per replica; statefulset: a StatefulSet per replica, a pod per
rank; lws: one LeaderWorkerSet, a group per replica. */}}
{{- define "mobius.workerMode" -}}
{{- if .Values.worker.leaderWorkerSet.enabled }}lws
{{- else if gt (int (include "mobius.worldSize" .)) 1 }}statefulset
{{- else }}single
{{- end }}
{{- end }}

{{/* The most replicas there can be: the router gets the address of each. */}}
{{- define "mobius.maxWorkerReplicas" -}}
{{- if .Values.autoscaling.worker.enabled }}{{ .Values.autoscaling.worker.maxReplicas }}
{{- else }}{{ .Values.worker.replicas }}
{{- end }}
{{- end }}

{{- define "mobius.workerServiceName" -}}
{{ include "mobius.fullname" . }}-workers
{{- end }}

{{- define "mobius.clusterDomain" -}}svc.cluster.local{{- end }}

{{/* The gRPC address (host:port) of replica $r's leader rank: include "mobius.leaderAddress" (list $ r) */}}
{{- define "mobius.leaderAddress" -}}
{{- $ := index . 0 -}}
{{- $r := index . 1 -}}
{{- $full := include "mobius.fullname" $ -}}
{{- $mode := include "mobius.workerMode" $ -}}
{{- if eq $mode "lws" -}}
{{ $full }}-worker-{{ $r }}.{{ $full }}-worker.{{ $.Release.Namespace }}.{{ include "mobius.clusterDomain" $ }}:{{ $.Values.worker.port }}
{{- else if eq $mode "statefulset" -}}
{{ $full }}-worker-{{ $r }}-0.{{ include "mobius.workerServiceName" $ }}.{{ $.Release.Namespace }}.{{ include "mobius.clusterDomain" $ }}:{{ $.Values.worker.port }}
{{- else -}}
{{ $full }}-worker-{{ $r }}.{{ include "mobius.workerServiceName" $ }}.{{ $.Release.Namespace }}.{{ include "mobius.clusterDomain" $ }}:{{ $.Values.worker.port }}
{{- end -}}
{{- end }}

{{- define "mobius.modelDir" -}}
{{- if .Values.model.path }}{{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.path }}
{{- else }}{{ .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* The tokenizer directory the router and the workers read (router.tokenizer): on its own
     volume, else in the model's; empty with model.source=dummy and no volume (the router then
     serves token-id prompts only and the workers refuse structured output). */}}
{{- define "mobius.tokenizerDir" -}}
{{- $t := .Values.router.tokenizer -}}
{{- if $t.volume }}{{ $t.mountPath }}{{ with $t.path }}/{{ . }}{{ end }}
{{- else if ne .Values.model.source "dummy" }}
{{- if $t.path }}{{ trimSuffix "/" .Values.model.mountPath }}/{{ $t.path }}{{ else }}{{ include "mobius.modelDir" . }}{{ end }}
{{- end }}
{{- end }}

{{/* The model volume (not for model.source=dummy). */}}
{{- define "mobius.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else if eq .Values.model.source "initContainer" }}
  emptyDir:
    sizeLimit: {{ .Values.model.initContainer.sizeLimit }}
{{- end }}
{{- end }}

{{- define "mobius.modelInitContainer" -}}
{{- if eq .Values.model.source "initContainer" }}
- name: fetch-model
  image: {{ required "model.initContainer.image is required with model.source=initContainer" .Values.model.initContainer.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- with .Values.model.initContainer.command }}
  command: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.model.initContainer.args }}
  args: {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: MODEL_DIR
      value: {{ include "mobius.modelDir" . | quote }}
    {{- with .Values.model.initContainer.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources: {{- toYaml (default (dict "requests" (dict "cpu" "1" "memory" "1Gi")) .Values.model.initContainer.resources) | nindent 4 }}
  securityContext: {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{- define "mobius.terminationGrace" -}}
{{- $ := index . 0 -}}
{{- add (int $.Values.drain.preStopSleepSeconds) (int (index . 1)) (int $.Values.drain.graceMarginSeconds) }}
{{- end }}

{{- define "mobius.preStop" -}}
preStop:
  exec:
    command: ["/bin/sleep", "{{ .Values.drain.preStopSleepSeconds }}"]
{{- end }}

{{- define "mobius.scrapeAnnotations" -}}
{{- $ := index . 0 -}}
{{- if $.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}
