{{/* Names and labels. */}}
{{- define "shoal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shoal.fullname" -}}
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

{{/*
The RayService's name: KubeRay appends 6 characters for its RayCluster, whose
name must be a DNS-1035 label of at most 53, so at most 47 here.
*/}}
{{- define "shoal.rayServiceName" -}}
{{- $name := include "shoal.fullname" . | trunc 47 | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "the RayService name %q must start with a letter (a DNS-1035 label); set fullnameOverride" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "shoal.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of the chart's own objects (RayService, Services, ...). */}}
{{- define "shoal.labels" -}}
helm.sh/chart: {{ include "shoal.chart" . }}
{{ include "shoal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels of the Ray pods. Not app.kubernetes.io/name: KubeRay sets that one on
its pods (kuberay). The Services select on instance + component; the pods of
both Ray clusters match during a zero-downtime upgrade, and readiness decides.
*/}}
{{- define "shoal.podLabels" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/part-of: {{ include "shoal.name" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every Ray pod of the release (head, workers, routers), of either cluster during an upgrade. */}}
{{- define "shoal.rayPodSelector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "shoal.name" . }}
{{- end }}

{{- define "shoal.routerSelector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- define "shoal.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The routers' ports: shoal's defaults unless the options set them. */}}
{{- define "shoal.httpPort" -}}
{{- .Values.shoal.http_port | default 8000 | int }}
{{- end }}

{{- define "shoal.grpcPort" -}}
{{- .Values.shoal.grpc_port | default 9000 | int }}
{{- end }}

{{/*
The OTEL_* variables, as a YAML map (sorted by name): the pods' env and the
Serve application's runtime_env.env_vars are made from the same map.
*/}}
{{- define "shoal.otelEnv" -}}
{{- $o := .Values.otel }}
{{- $env := dict }}
{{- if $o.enabled }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_ENDPOINT" $o.endpoint }}
{{- with $o.protocol }}{{ $_ := set $env "OTEL_EXPORTER_OTLP_PROTOCOL" . }}{{ end }}
{{- with $o.serviceName }}{{ $_ := set $env "OTEL_SERVICE_NAME" . }}{{ end }}
{{- with $o.sampler }}{{ $_ := set $env "OTEL_TRACES_SAMPLER" . }}{{ end }}
{{- with $o.samplerArg }}{{ $_ := set $env "OTEL_TRACES_SAMPLER_ARG" . }}{{ end }}
{{- range $k, $v := $o.env }}{{ $_ := set $env $k (toString $v) }}{{ end }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/*
The Serve config: what `shoal serve --print-config` prints for the same
options (cluster/serve_config.py). args: the non-null shoal.* values, the
model path, allowed_hosts "*" without an API key, host 0.0.0.0 so the routers
listen on the pod's address, and the device the worker pods have. Not "auto": the application is built when the
head is up, and GPU pods that have not joined yet (or that the autoscaler has
not started) would make it a CPU deployment.
*/}}
{{- define "shoal.serveConfig" -}}
{{- $device := ternary "cuda" "cpu" (gt (int .Values.workerGroup.gpusPerPod) 0) }}
{{- $args := dict "host" "0.0.0.0" "device" $device }}
{{- with .Values.model.path }}{{ $_ := set $args "model" . }}{{ end }}
{{- /* No key: the routers would answer loopback Host names only (against DNS rebinding of a
     laptop's server); behind a Service clients use its names, and the API is open anyway. */}}
{{- if not .Values.apiKeySecret.name }}{{ $_ := set $args "allowed_hosts" "*" }}{{ end }}
{{- range $k, $v := .Values.shoal }}
{{- if not (kindIs "invalid" $v) }}{{ $_ := set $args $k $v }}{{ end }}
{{- end }}
{{- if .Values.kvDisk.enabled }}{{ $_ := set $args "kv_offload_disk_path" .Values.kvDisk.mountPath }}{{ end }}
{{- /* TLS: the files of the Secret mounted in the router pods (shoal.tlsVolume). */}}
{{- with .Values.tls }}
{{- if .secretName }}
{{- $dir := trimSuffix "/" .mountPath }}
{{- $_ := set $args "ssl_certfile" (printf "%s/tls.crt" $dir) }}
{{- $_ := set $args "ssl_keyfile" (printf "%s/tls.key" $dir) }}
{{- if ne .clientAuth "none" }}
{{- $_ := set $args "ssl_ca_certs" (printf "%s/ca.crt" $dir) }}
{{- $_ := set $args "ssl_cert_reqs" (ternary 2 1 (eq .clientAuth "required")) }}
{{- end }}
{{- end }}
{{- end -}}
proxy_location: Disabled
applications:
  - name: shoal
    route_prefix: null
    import_path: shoal.cluster.app:build_app
    {{- with include "shoal.otelEnv" . | fromYaml }}
    runtime_env:
      env_vars:
        {{- toYaml . | nindent 8 }}
    {{- end }}
    args:
      {{- toYaml $args | nindent 6 }}
{{- end }}

{{/*
The worker group's pod counts, from the shoal options: each pod holds
gpusPerPod / tensor_parallel_size workers (one on CPU pods), and the group
spans the workers' range. Fixed workers: min = max = replicas.
*/}}
{{- define "shoal.workerPods" -}}
{{- $s := .Values.shoal }}
{{- $tp := $s.tensor_parallel_size | default 1 | int }}
{{- $gpus := .Values.workerGroup.gpusPerPod | int }}
{{- $per := 1 }}
{{- if gt $gpus 0 }}
{{- if mod $gpus $tp }}
{{- fail (printf "shoal.tensor_parallel_size (%d) must divide workerGroup.gpusPerPod (%d)" $tp $gpus) }}
{{- end }}
{{- $per = div $gpus $tp }}
{{- end }}
{{- $start := $s.num_workers | default 1 | int }}
{{- $low := $start }}
{{- $high := $start }}
{{- if not (kindIs "invalid" $s.max_workers) }}
{{- $low = $s.min_workers | default 1 | int }}
{{- $high = $s.max_workers | int }}
{{- if lt $high $low }}
{{- fail (printf "shoal.max_workers (%d) must be >= shoal.min_workers (%d)" $high $low) }}
{{- end }}
{{- $start = max $low (min $high $start) }}
{{- end }}
workersPerPod: {{ $per }}
replicas: {{ ceil (divf $start $per) | int }}
minReplicas: {{ ceil (divf $low $per) | int }}
maxReplicas: {{ ceil (divf $high $per) | int }}
{{- end }}

{{- define "shoal.autoscaling" -}}
{{- if not (kindIs "invalid" .Values.shoal.max_workers) }}true{{ end }}
{{- end }}

{{/* The model volume, where the model is not in the image. */}}
{{- define "shoal.modelVolumes" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type | default "Directory" }}
{{- end }}
{{- end }}

{{/*
Writable scratch space: the root filesystem is read-only, so each path Ray and
shoal write is an emptyDir: /tmp (Ray's session folder, logs, sockets, spilled
objects), /dev/shm in memory (Ray's object store) and the image user's home
(the CPU kernels' and Triton's caches, compiled on first use).
*/}}
{{- define "shoal.scratchVolumes" -}}
{{- $s := .Values.scratch }}
- name: tmp
  emptyDir:
    {{- with $s.tmpSizeLimit }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
- name: shm
  emptyDir:
    medium: Memory
    {{- with $s.shmSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
- name: home
  emptyDir:
    {{- with $s.homeSizeLimit }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
{{- end }}

{{/*
The KV cache's disk tier (kvDisk), on the worker pods alone: an emptyDir, or
the PersistentVolumeClaim kvDisk.claimName (its blocks then outlive the pods).
*/}}
{{- define "shoal.kvDiskVolume" -}}
{{- if .Values.kvDisk.enabled }}
- name: kv-disk
  {{- if .Values.kvDisk.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.kvDisk.claimName }}
  {{- else }}
  emptyDir:
    {{- with .Values.kvDisk.sizeLimit }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "shoal.kvDiskVolumeMount" -}}
{{- if .Values.kvDisk.enabled }}
- name: kv-disk
  mountPath: {{ .Values.kvDisk.mountPath }}
{{- end }}
{{- end }}

{{- define "shoal.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
- name: home
  mountPath: {{ .Values.scratch.homePath }}
{{- end }}

{{/*
The Kubernetes API token, for the Ray autoscaler alone: pods mount no
service-account token (automountServiceAccountToken: false), and with
autoscaling this projected volume, what Kubernetes would have mounted, goes
only into the autoscaler sidecar (rayClusterConfig.autoscalerOptions), never
into the Ray head container that runs the Serve controller.
*/}}
{{- define "shoal.apiAccessVolume" -}}
- name: kube-api-access
  projected:
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                apiVersion: v1
                fieldPath: metadata.namespace
{{- end }}

{{/*
TLS for the routers: the Secret's files (tls.crt, tls.key, ca.crt), readable
by the pods' group (fsGroup) only, in the router pods alone.
*/}}
{{- define "shoal.tlsVolume" -}}
{{- with .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "shoal.tlsVolumeMount" -}}
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "shoal.modelVolumeMounts" -}}
{{- $m := .Values.model }}
{{- if ne $m.source "image" }}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" $m.mountPath)) $m.path) }}
{{- $why := printf "where the %s volume is mounted" $m.source }}
{{- fail (printf "model.path (%s) must lie under model.mountPath (%s), %s" $m.path $m.mountPath $why) }}
{{- end }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
Environment of a Ray container (arguments: root, component): OTEL_*, extraEnv,
and on the router pods alone the API key from its Secret: only the routers
check it, so the head (which runs the Serve controller) and the workers never hold it.
*/}}
{{- define "shoal.env" -}}
{{- $component := .component }}
{{- with .root }}
{{- /* Pods join after the app is built: build_app trusts the chart's groups
     (routers on the shoal_router pods, GPUs as their pods come) instead of
     the nodes alive at that moment (cluster/app.py, cluster/options.py). */}}
- name: SHOAL_KUBERAY
  value: "1"
{{- with .Values.apiKeySecret }}
{{- if and .name (eq $component "router") }}
- name: SHOAL_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- range $k, $v := include "shoal.otelEnv" . | fromYaml }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
One Ray pod template. Arguments: root (the chart context), component (head,
worker, router), group (its values), container (the container's name), and as
YAML text: resources, ports, probes, lifecycle (optional), extraVolumes and
extraMounts (optional); terminationGrace (optional).
*/}}
{{- define "shoal.podTemplate" -}}
{{- $root := .root }}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "shoal.podLabels" (dict "root" $root "component" .component) | nindent 4 }}
    {{- with $group.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $group.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .terminationGrace }}
  terminationGracePeriodSeconds: {{ . }}
  {{- end }}
  # Nothing in a Ray container talks to the Kubernetes API (see shoal.apiAccessVolume).
  automountServiceAccountToken: false
  containers:
    # KubeRay takes the first container as Ray's and runs `ray start` in it.
    - name: {{ .container }}
      image: {{ include "shoal.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- with .ports }}
      ports:
        {{- . | nindent 8 }}
      {{- end }}
      {{- with include "shoal.env" (dict "root" $root "component" .component) | trim }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      {{- with .resources }}
      resources:
        {{- . | nindent 8 }}
      {{- end }}
      volumeMounts:
        {{- include "shoal.scratchVolumeMounts" $root | nindent 8 }}
        {{- with include "shoal.modelVolumeMounts" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with .extraMounts }}
        {{- . | nindent 8 }}
        {{- end }}
      {{- .probes | nindent 6 }}
      {{- with .lifecycle }}
      lifecycle:
        {{- . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
  volumes:
    {{- include "shoal.scratchVolumes" $root | nindent 4 }}
    {{- with include "shoal.modelVolumes" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with .extraVolumes }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
