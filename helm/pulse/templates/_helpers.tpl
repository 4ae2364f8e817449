{{/* Names and labels. */}}
{{- define "pulse.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* RayService names get suffixes from KubeRay (-head-svc, -raycluster-xxxxx): keep room for them. */}}
{{- define "pulse.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "pulse.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pulse.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pulse.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pulse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pulse.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pulse.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* image: pass (list $root $override) where $override is {} or {repository, tag}. */}}
{{- define "pulse.image" -}}
{{- $root := index . 0 -}}
{{- $over := index . 1 | default dict -}}
{{- $repo := $over.repository | default $root.Values.image.repository -}}
{{- $tag := $over.tag | default $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "pulse.configMapName" -}}
{{- .Values.pulse.configMap.name | default (printf "%s-config" (include "pulse.fullname" .)) -}}
{{- end -}}

{{- define "pulse.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "pulse.fullname" .)) -}}
{{- end -}}

{{- define "pulse.redisSecretKey" -}}
{{- if .Values.redis.auth.existingSecret -}}{{ .Values.redis.auth.existingSecretKey }}{{- else -}}redis-password{{- end -}}
{{- end -}}

{{/* The enabled worker groups, as a dict name -> group. */}}
{{- define "pulse.enabledGroups" -}}
{{- $out := dict -}}
{{- range $name, $g := .Values.rayService.workerGroups -}}
{{- if $g.enabled -}}{{- $_ := set $out $name $g -}}{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
Pulse's config as the pods read it: the user's pulse.config, plus what the chart knows better
(the gateway's bind address and port, and the worker layout when one device type is deployed).
*/}}
{{- define "pulse.config" -}}
{{- $cfg := deepCopy (.Values.pulse.config | default dict) -}}
{{- $server := get $cfg "server" | default dict -}}
{{- $_ := set $server "host" "0.0.0.0" -}}
{{- $_ := set $server "port" (int .Values.gateway.port) -}}
{{- /* Pulse joins KubeRay's cluster; with ray_address set, workers listen on the pod network, not loopback. */ -}}
{{- if not (hasKey $server "ray_address") -}}{{- $_ := set $server "ray_address" "auto" -}}{{- end -}}
{{- $_ := set $cfg "server" $server -}}
{{- $groups := include "pulse.enabledGroups" . | fromJson -}}
{{- $workers := get $cfg "workers" | default dict -}}
{{- if eq (len $groups) 1 -}}
{{- range $name, $g := $groups -}}
{{- if not (hasKey $workers "count") -}}{{- $_ := set $workers "count" (int $g.replicas) -}}{{- end -}}
{{- if not (hasKey $workers "resources") -}}{{- $_ := set $workers "resources" (dict $name 1) -}}{{- end -}}
{{- if not (hasKey $workers "device_profile") -}}{{- $_ := set $workers "device_profile" $name -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := set $cfg "workers" $workers -}}
{{- if .Values.opentelemetry.enabled -}}
{{- $tel := get $cfg "telemetry" | default dict -}}
{{- $_ := set $tel "traces_exporter" "otlp" -}}
{{- $_ := set $tel "service_name" .Values.opentelemetry.serviceName -}}
{{- $_ := set $cfg "telemetry" $tel -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
Serve config (RayService.spec.serveConfigV2): the application of deploy/serve_config.yaml. Pulse's
gateway serves clients itself; Serve's proxy runs on the head only because KubeRay health-checks it.
*/}}
{{- define "pulse.serveConfig" -}}
proxy_location: HeadOnly
http_options:
  host: 0.0.0.0
  port: {{ .Values.rayService.serveProxyPort }}
applications:
  - name: pulse
    import_path: {{ .Values.rayService.importPath }}
    route_prefix: null
{{- end -}}

{{/* Environment shared by every Ray container (head and workers). */}}
{{- define "pulse.env" -}}
- name: PULSE_CONFIG
  value: /etc/pulse/pulse.yaml
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
# Ray's own processes in the pod, as `pulse serve` sets them for its local instance (workers/ray_env.py,
# CONTROL_PLANE_ENV): the Serve controller reconciles once a second (Pulse's replica counts are fixed), and the
# raylet prestarts no idle Python worker per core (Pulse runs no tasks; ~80 MiB each). pulse.extraEnv, listed
# after, overrides them.
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "1"
- name: RAY_prestart_worker_first_driver
  value: "0"
{{- if .Values.redis.enabled }}
- name: PULSE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pulse.redisSecretName" . }}
      key: {{ include "pulse.redisSecretKey" . }}
# Kubernetes expands $(PULSE_REDIS_PASSWORD): the password never sits in the ConfigMap.
- name: PULSE_REDIS__URL
  value: {{ printf "redis://:$(PULSE_REDIS_PASSWORD)@%s-redis:%d/0" (include "pulse.fullname" .) (int .Values.redis.port) | quote }}
{{- end }}
{{- with .Values.opentelemetry }}
{{- if .enabled }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ .serviceName | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- $attrs := list "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" }}
{{- range $k, $v := .resourceAttributes }}{{ $attrs = append $attrs (printf "%s=%s" $k $v) }}{{ end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- if .headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ .headersSecret.name }}
      key: {{ .headersSecret.key }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.pulse.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "pulse.volumeMounts" -}}
- name: pulse-config
  mountPath: /etc/pulse
  readOnly: true
- name: ray-logs
  mountPath: /tmp/ray
{{- if .Values.modelVolume.enabled }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: {{ .Values.modelVolume.readOnly }}
{{- end }}
{{- end -}}

{{- define "pulse.volumes" -}}
- name: pulse-config
  configMap:
    name: {{ include "pulse.configMapName" . }}
- name: ray-logs
  emptyDir: {}
{{- if .Values.modelVolume.enabled }}
- name: models
{{- if .Values.modelVolume.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelVolume.existingClaim }}
    readOnly: {{ .Values.modelVolume.readOnly }}
{{- else }}
  hostPath:
    path: {{ .Values.modelVolume.hostPath }}
    type: Directory
{{- end }}
{{- end }}
{{- end -}}

{{/* Restricted-profile container security; the image runs as uid 1000. */}}
{{- define "pulse.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
{{- end -}}
