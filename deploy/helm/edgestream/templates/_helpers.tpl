{{/* Names, labels and the pieces every edgestream pod shares. */}}

{{- define "edgestream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, or the release name alone when it already contains the
chart name. Kept at 52 characters so "-simulator" and StatefulSet pod suffixes fit. */}}
{{- define "edgestream.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "edgestream.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every resource carries. */}}
{{- define "edgestream.labels" -}}
helm.sh/chart: {{ include "edgestream.chart" . }}
{{ include "edgestream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: edgestream
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select every edgestream pod of this release. */}}
{{- define "edgestream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "edgestream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "worker"). */}}
{{- define "edgestream.componentLabels" -}}
{{ include "edgestream.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "edgestream.componentSelector" -}}
{{ include "edgestream.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "edgestream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "edgestream.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "edgestream.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- if or (not .Values.image.tag) (eq (toString .Values.image.tag) "latest") }}
{{- fail "image.tag must be a pinned version (not empty, not latest)" }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* edgestream.serverStrategies and edgestream.inboxStrategies: generated from the strategy
registry into _strategies.tpl (edgestream generate). */}}

{{/* The job file parsed (fails on invalid TOML). */}}
{{- define "edgestream.jobData" -}}
{{- $job := fromToml .Values.job }}
{{- if hasKey $job "Error" }}
{{- fail (printf "values.job is not valid TOML: %s" (get $job "Error")) }}
{{- end }}
{{- toJson $job }}
{{- end }}

{{/* Checks between values and the job, run by every template that renders pods. */}}
{{- define "edgestream.validate" -}}
{{- $job := include "edgestream.jobData" . | fromJson }}
{{- $train := get $job "train" | default dict }}
{{- $strategy := get $train "strategy" | default "bsp" }}
{{- $needsServer := has $strategy (splitList " " (include "edgestream.serverStrategies" .)) }}
{{- if and $needsServer (not .Values.server.enabled) }}
{{- fail (printf "the job's train.strategy %q needs the parameter server: set server.enabled=true" $strategy) }}
{{- end }}
{{- if and .Values.server.enabled (not $needsServer) }}
{{- fail (printf "server.enabled=true but the job's train.strategy %q has no parameter server (only %s): set server.enabled=false" $strategy (include "edgestream.serverStrategies" . | replace " " ", ")) }}
{{- end }}
{{- if not .Values.kafka.bootstrap }}
{{- fail "kafka.bootstrap is required (host:port of your Kafka cluster)" }}
{{- end }}
{{- include "edgestream.validateSecurity" . }}
{{- if le (int .Values.service.terminationGracePeriodSeconds) (int .Values.service.shutdownGraceSeconds) }}
{{- fail "service.terminationGracePeriodSeconds must be above service.shutdownGraceSeconds" }}
{{- end }}
{{- if lt (int .Values.workers.replicas) 1 }}
{{- fail "workers.replicas must be at least 1" }}
{{- end }}
{{- $devices := get $job "devices" | default dict }}
{{- $source := get (get $job "data" | default dict) "source" | default "digits" }}
{{- $deviceCount := int (get $devices "count" | default 10) }}
{{- $stages := get $train "stages" | default list }}
{{- if $stages }}
{{- if ne (int .Values.workers.replicas) (add1 (len $stages)) }}
{{- fail (printf "workers.replicas must be %d: one worker per stage of the job's train.stages" (add1 (len $stages))) }}
{{- end }}
{{- else if and (ne $source "recording") (gt (int .Values.workers.replicas) $deviceCount) }}
{{- fail (printf "workers.replicas=%d exceeds the job's devices.count=%d: every worker needs at least one device stream" (int .Values.workers.replicas) $deviceCount) }}
{{- end }}
{{- if and .Values.replay.enabled (not .Values.replay.existingClaim) }}
{{- fail "replay.enabled needs replay.existingClaim: the PVC holding the recording" }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every edgestream pod. */}}
{{- define "edgestream.podSpecCommon" -}}
serviceAccountName: {{ include "edgestream.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ .Values.service.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod template annotations: a checksum of the job, so a changed job rolls the pods. */}}
{{- define "edgestream.podAnnotations" -}}
checksum/job: {{ .Values.job | sha256sum }}
{{- end }}

{{/* Container settings shared by every edgestream container. */}}
{{- define "edgestream.containerCommon" -}}
image: {{ include "edgestream.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
ports:
  - name: metrics
    containerPort: {{ .Values.metricsPort }}
    protocol: TCP
{{- end }}

{{/* Environment of every edgestream container: the EDGESTREAM__ overrides that follow
the deployment, the Kafka security settings of its role, and writable HOME / TMPDIR on /tmp.
(dict "ctx" $ "role" "workers"|"devices"). */}}
{{- define "edgestream.env" -}}
{{- $ctx := .ctx -}}
- name: EDGESTREAM__KAFKA__BOOTSTRAP
  value: {{ $ctx.Values.kafka.bootstrap | quote }}
- name: EDGESTREAM__WORKERS__COUNT
  value: {{ $ctx.Values.workers.replicas | quote }}
- name: EDGESTREAM__WORKERS__METRICS_HOST
  value: "0.0.0.0"
- name: EDGESTREAM__RUN__STATE_DIR
  value: /var/lib/edgestream
- name: EDGESTREAM__SERVICE__SHUTDOWN_GRACE_S
  value: {{ $ctx.Values.service.shutdownGraceSeconds | quote }}
- name: EDGESTREAM__SERVICE__LOG_FORMAT
  value: {{ $ctx.Values.service.logFormat | quote }}
{{- include "edgestream.kafkaEnv" . }}
- name: HOME
  value: /tmp
- name: TMPDIR
  value: /tmp
- name: MPLCONFIGDIR
  value: /tmp
{{- with $ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Mounts of every edgestream container; the state volume is added by each component. */}}
{{- define "edgestream.volumeMounts" -}}
- name: job
  mountPath: /etc/edgestream/job.toml
  subPath: job.toml
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "edgestream.volumes" -}}
- name: job
  configMap:
    name: {{ include "edgestream.fullname" . }}-job
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{/* HTTP probe on the metrics port: (dict "ctx" $ "path" "/healthz" "probe" .Values.probes.liveness). */}}
{{- define "edgestream.probe" -}}
httpGet:
  path: {{ .path }}
  port: metrics
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end }}

{{/* Startup, liveness and readiness probes of a long-running process. */}}
{{- define "edgestream.probes" -}}
startupProbe:
  {{- include "edgestream.probe" (dict "path" "/healthz" "probe" .Values.probes.startup) | nindent 2 }}
livenessProbe:
  {{- include "edgestream.probe" (dict "path" "/healthz" "probe" .Values.probes.liveness) | nindent 2 }}
readinessProbe:
  {{- include "edgestream.probe" (dict "path" "/readyz" "probe" .Values.probes.readiness) | nindent 2 }}
{{- end }}

{{/* --- Kafka security (docs/security.md; values kafka.security) ---------------------------
Nothing secret passes through values: the password and the TLS files come from existing
Secrets, projected read-only into /etc/edgestream/kafka/ and named by the kafka.* keys
(EDGESTREAM__KAFKA__SSL_CAFILE, __SASL_PASSWORD_FILE, ...). PLAINTEXT renders nothing.
Each helper takes (dict "ctx" $ "role" "workers"|"devices"): the workers and the server log
in as the workers' principal, the simulator, replay and the MQTT bridge as the devices'. */}}

{{- define "edgestream.kafkaDir" -}}/etc/edgestream/kafka{{- end }}

{{- define "edgestream.validateSecurity" -}}
{{- if hasKey .Values.kafka "credentials" }}
{{- fail "kafka.credentials was a placeholder and is gone: set kafka.security (protocol, workers/devices passwordSecret, tls.secret; README \"Kafka credentials\")" }}
{{- end }}
{{- $sec := .Values.kafka.security }}
{{- if not (has $sec.protocol (list "PLAINTEXT" "SSL" "SASL_SSL")) }}
{{- fail (printf "kafka.security.protocol %q: use PLAINTEXT, SSL or SASL_SSL" (toString $sec.protocol)) }}
{{- end }}
{{- if ne $sec.protocol "PLAINTEXT" }}
{{- if not (has $sec.mechanism (list "SCRAM-SHA-512" "SCRAM-SHA-256")) }}
{{- fail (printf "kafka.security.mechanism %q: use SCRAM-SHA-512 or SCRAM-SHA-256" (toString $sec.mechanism)) }}
{{- end }}
{{- if not (and $sec.tls.secret $sec.tls.caKey) }}
{{- fail (printf "kafka.security.protocol=%s needs kafka.security.tls.secret: an existing Secret holding the CA certificate under tls.caKey" $sec.protocol) }}
{{- end }}
{{- if ne (not $sec.tls.certKey) (not $sec.tls.keyKey) }}
{{- fail "kafka.security.tls.certKey and tls.keyKey go together (a client certificate and its key)" }}
{{- end }}
{{- if eq $sec.protocol "SASL_SSL" }}
{{- $roles := list "workers" }}
{{- if or .Values.simulator.enabled .Values.replay.enabled .Values.bridge.enabled }}
{{- $roles = append $roles "devices" }}
{{- end }}
{{- range $roles }}
{{- $role := get $sec . }}
{{- if not (and $role.username $role.passwordSecret $role.passwordKey) }}
{{- fail (printf "kafka.security.protocol=SASL_SSL needs kafka.security.%s.username and .passwordSecret (an existing Secret holding the password under .passwordKey; edgestream acl apply writes it)" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* EDGESTREAM__KAFKA__ variables of one role; nothing for PLAINTEXT. */}}
{{- define "edgestream.kafkaEnv" -}}
{{- $sec := .ctx.Values.kafka.security }}
{{- $dir := include "edgestream.kafkaDir" .ctx }}
{{- if ne $sec.protocol "PLAINTEXT" }}
- name: EDGESTREAM__KAFKA__SECURITY_PROTOCOL
  value: {{ $sec.protocol | quote }}
- name: EDGESTREAM__KAFKA__SSL_CAFILE
  value: {{ printf "%s/ca.crt" $dir }}
{{- if $sec.tls.certKey }}
- name: EDGESTREAM__KAFKA__SSL_CERTFILE
  value: {{ printf "%s/client.crt" $dir }}
- name: EDGESTREAM__KAFKA__SSL_KEYFILE
  value: {{ printf "%s/client.key" $dir }}
{{- end }}
{{- if eq $sec.protocol "SASL_SSL" }}
{{- $role := get $sec .role }}
- name: EDGESTREAM__KAFKA__SASL_MECHANISM
  value: {{ $sec.mechanism | quote }}
- name: EDGESTREAM__KAFKA__SASL_USERNAME
  value: {{ $role.username | quote }}
- name: EDGESTREAM__KAFKA__SASL_PASSWORD_FILE
  value: {{ printf "%s/password" $dir }}
{{- end }}
{{- end }}
{{- end }}

{{/* The read-only mount of the credential files of one role; nothing for PLAINTEXT. */}}
{{- define "edgestream.kafkaMounts" -}}
{{- if ne .ctx.Values.kafka.security.protocol "PLAINTEXT" }}
- name: kafka-credentials
  mountPath: {{ include "edgestream.kafkaDir" .ctx }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The credential files of one role: the role's password (SASL_SSL) and the TLS files,
projected from their Secrets (mode 0440: the pod's group, fsGroup, reads them). */}}
{{- define "edgestream.kafkaVolumes" -}}
{{- $sec := .ctx.Values.kafka.security }}
{{- if ne $sec.protocol "PLAINTEXT" }}
- name: kafka-credentials
  projected:
    defaultMode: 0440
    sources:
      {{- if eq $sec.protocol "SASL_SSL" }}
      {{- $role := get $sec .role }}
      - secret:
          name: {{ $role.passwordSecret }}
          items:
            - key: {{ $role.passwordKey }}
              path: password
      {{- end }}
      - secret:
          name: {{ $sec.tls.secret }}
          items:
            - key: {{ $sec.tls.caKey }}
              path: ca.crt
            {{- if $sec.tls.certKey }}
            - key: {{ $sec.tls.certKey }}
              path: client.crt
            - key: {{ $sec.tls.keyKey }}
              path: client.key
            {{- end }}
{{- end }}
{{- end }}
