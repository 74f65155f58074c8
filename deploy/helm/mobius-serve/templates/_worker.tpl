{{/* The worker pod template, shared by the StatefulSets and the LeaderWorkerSet.
     include "mobius.workerPodTemplate" (dict "root" $ "replica" R "role" "leader"|"worker") */}}

{{- define "mobius.workerArgs" -}}
{{- $ := .root -}}
{{- $v := $.Values.worker -}}
- --host=0.0.0.0
- --port={{ $v.port }}
- --metrics-port={{ $v.metricsPort }}
- --device={{ $v.device }}
- --threads={{ $v.threads }}
- --served-model-name={{ $.Values.model.servedModelName }}
{{- if eq $.Values.model.source "dummy" }}
- --load-format=dummy
- --config=/etc/mobius/model/config.json
- --seed={{ $.Values.model.dummy.seed }}
{{- else }}
- --model={{ include "mobius.modelDir" $ }}
{{- end }}
{{- /* The router's tokenizer: structured output masks every draw by the tokens' bytes. */}}
{{- with include "mobius.tokenizerDir" $ }}
- --tokenizer={{ . }}
{{- end }}
- --max-num-seqs={{ $v.maxNumSeqs }}
- --max-model-len={{ $v.maxModelLen }}
- --max-tokens-per-step={{ $v.maxTokensPerStep }}
- --kv-block-size={{ $v.kvBlockSize }}
{{- if $v.numKvBlocks }}
- --num-kv-blocks={{ $v.numKvBlocks }}
{{- end }}
- --sampling-seed={{ $v.samplingSeed }}
{{- if gt (int $v.specTokens) 0 }}
- --spec-tokens={{ $v.specTokens }}
{{- if $v.specTokenMap }}
- --spec-token-map={{ $v.specTokenMap }}
{{- end }}
{{- else if $v.specTokenMap }}
{{- /* mobius-worker refuses the map without drafts too; failing here names the value. */}}
{{- fail (printf "worker.specTokenMap (%s) is set but worker.specTokens is %d: the map only restricts the MTP head's drafts" $v.specTokenMap (int $v.specTokens)) }}
{{- end }}
- --drain-timeout-s={{ $v.drainTimeoutSeconds }}
{{- if gt (int (include "mobius.worldSize" $)) 1 }}
{{- /* Distributed execution (issue #5): rendered only for replicas of more than one rank. */}}
- --tp={{ $v.parallel.tp }}
- --ep={{ $v.parallel.ep }}
- --world-size={{ include "mobius.worldSize" $ }}
- --rank=$(MOBIUS_RANK)
- --leader={{ .leader }}
- --expert-placement={{ $v.parallel.expertPlacement }}
{{- if eq $v.parallel.expertPlacement "load-aware" }}
{{- if not $v.parallel.expertLoadFile }}
{{- fail "worker.parallel.expertLoadFile is required with expertPlacement load-aware" }}
{{- end }}
- --expert-load={{ $v.parallel.expertLoadFile }}
{{- end }}
{{- if $v.parallel.sequenceParallel }}
- --sequence-parallel
{{- end }}
{{- end }}
{{- with $v.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "mobius.workerResources" -}}
{{- $v := .Values.worker -}}
{{- $res := deepCopy (default dict $v.resources) -}}
{{- if eq $v.device "cuda" }}
{{- $gpu := dict $v.gpuResourceName (int $v.gpusPerRank) -}}
{{- $_ := set $res "requests" (merge (default dict $res.requests) $gpu) -}}
{{- $_ := set $res "limits" (merge (default dict $res.limits) $gpu) -}}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- define "mobius.workerPodTemplate" -}}
{{- $ := .root -}}
{{- $v := $.Values.worker -}}
{{- $mode := include "mobius.workerMode" $ -}}
{{- $world := int (include "mobius.worldSize" $) -}}
{{- $full := include "mobius.fullname" $ -}}
{{- $leader := "" -}}
{{- if eq $mode "lws" }}{{ $leader = printf "$(LWS_LEADER_ADDRESS):%v" $v.port }}
{{- else if eq $mode "statefulset" }}{{ $leader = include "mobius.leaderAddress" (list $ .replica) }}
{{- end }}
metadata:
  labels:
    {{- include "mobius.selectorLabels" (list $ "worker") | nindent 4 }}
    {{- if eq $mode "statefulset" }}
    mobius.ai/replica: {{ .replica | quote }}
    {{- else if eq $mode "lws" }}
    mobius.ai/role: {{ .role }}
    {{- end }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
    {{- with (include "mobius.scrapeAnnotations" (list $ $v.metricsPort)) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "mobius.serviceAccountName" $ }}
  automountServiceAccountToken: false
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- if $v.hostIPC }}
  hostIPC: true
  {{- end }}
  terminationGracePeriodSeconds: {{ include "mobius.terminationGrace" (list $ $v.drainTimeoutSeconds) }}
  securityContext: {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  {{- with $v.nodeSelector }}
  nodeSelector: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $v.affinity }}
  affinity: {{- toYaml $v.affinity | nindent 4 }}
  {{- else if or (ne $v.podAntiAffinity "none") (eq $mode "statefulset") }}
  affinity:
    {{- if eq $mode "statefulset" }}
    # The ranks of one StatefulSet replica share a node (tensor parallel over NVLink).
    podAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "mobius.selectorLabels" (list $ "worker") | nindent 14 }}
              mobius.ai/replica: {{ .replica | quote }}
    {{- end }}
    {{- if eq $v.podAntiAffinity "hard" }}
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "mobius.selectorLabels" (list $ "worker") | nindent 14 }}
    {{- else if eq $v.podAntiAffinity "soft" }}
    podAntiAffinity:
      preferredDuringSchedulingIgnoredDuringExecution:
        - weight: 100
          podAffinityTerm:
            topologyKey: kubernetes.io/hostname
            labelSelector:
              matchLabels:
                {{- include "mobius.selectorLabels" (list $ "worker") | nindent 16 }}
    {{- end }}
  {{- end }}
  {{- with (include "mobius.modelInitContainer" $) }}
  initContainers: {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "mobius.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command: ["/usr/local/bin/mobius-worker"]
      args:
        {{- include "mobius.workerArgs" (dict "root" $ "leader" $leader) | nindent 8 }}
      env:
        {{- if eq $mode "statefulset" }}
        - name: MOBIUS_RANK
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
        {{- else if eq $mode "lws" }}
        - name: MOBIUS_RANK
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
        {{- end }}
        - name: MOBIUS_POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- with $v.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $v.port }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $v.metricsPort }}
          protocol: TCP
      # The worker listens only once the model is loaded and its caches are allocated, and
      # turns NOT_SERVING when SIGTERM starts the drain: the startup probe covers loading,
      # readiness follows the health status. (Kubelets stop liveness probes of a terminating pod.)
      startupProbe:
        grpc: {port: {{ $v.port }}}
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: {{ max 1 (div (add (int $v.loadTimeoutSeconds) 9) 10) }}
      readinessProbe:
        grpc: {port: {{ $v.port }}}
        {{- toYaml $v.readinessProbe | nindent 8 }}
      livenessProbe:
        grpc: {port: {{ $v.port }}}
        {{- toYaml $v.livenessProbe | nindent 8 }}
      lifecycle:
        {{- include "mobius.preStop" $ | nindent 8 }}
      resources:
        {{- include "mobius.workerResources" $ | nindent 8 }}
      securityContext: {{- toYaml $.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if eq $.Values.model.source "dummy" }}
        - name: model-config
          mountPath: /etc/mobius/model
          readOnly: true
        {{- else }}
        - name: model
          mountPath: {{ $.Values.model.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $.Values.router.tokenizer.volume }}
        - name: tokenizer
          mountPath: {{ $.Values.router.tokenizer.mountPath }}
          readOnly: true
        {{- end }}
        {{- if gt $world 1 }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {sizeLimit: 1Gi}
    {{- if eq $.Values.model.source "dummy" }}
    - name: model-config
      configMap:
        name: {{ $full }}-model
    {{- else }}
    {{- include "mobius.modelVolume" $ | nindent 4 }}
    {{- end }}
    {{- with $.Values.router.tokenizer.volume }}
    - name: tokenizer
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- if gt $world 1 }}
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ $v.shmSize }}}
    {{- end }}
{{- end }}
