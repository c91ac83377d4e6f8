{{/*
Per-group pieces of the Ray pods: container ports and probes. KubeRay would
inject probes that exec wget; these are httpGet probes instead, and they keep
the Serve-proxy check KubeRay adds on RayService workers off (shoal runs no
Serve proxy: the routers bind the ports themselves).
*/}}

{{/* The raylet of the pod answers, through the dashboard agent (port 52365). */}}
{{- define "shoal.rayletCheck" -}}
httpGet:
  path: /api/local_raylet_healthz
  port: 52365
{{- end }}

{{/*
The head's ports, which KubeRay's head Service (ClusterIP, inside the release's
NetworkPolicy) exposes: the GCS (nodes join), the dashboard (KubeRay submits the
Serve config) and Ray's metrics. Not 10001, the Ray Client server: nothing here
uses it, so no Service carries it.
*/}}
{{- define "shoal.headPorts" -}}
- name: gcs-server
  containerPort: 6379
- name: dashboard
  containerPort: 8265
- name: metrics
  containerPort: 8080
{{- end }}

{{/* Ready once the GCS answers; alive while its raylet does. */}}
{{- define "shoal.headProbes" -}}
readinessProbe:
  httpGet:
    path: /api/gcs_healthz
    port: 8265
  initialDelaySeconds: 10
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 10
livenessProbe:
  {{- include "shoal.rayletCheck" . | nindent 2 }}
  initialDelaySeconds: 30
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 120
{{- end }}

{{- define "shoal.workerPorts" -}}
- name: metrics
  containerPort: 8080
{{- end }}

{{/* A worker pod serves no traffic itself: its readiness is its Ray node's. */}}
{{- define "shoal.workerProbes" -}}
readinessProbe:
  {{- include "shoal.rayletCheck" . | nindent 2 }}
  initialDelaySeconds: 10
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 10
livenessProbe:
  {{- include "shoal.rayletCheck" . | nindent 2 }}
  initialDelaySeconds: 30
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 120
{{- end }}

{{- define "shoal.routerPorts" -}}
- name: http
  containerPort: {{ include "shoal.httpPort" . }}
- name: grpc
  containerPort: {{ include "shoal.grpcPort" . }}
- name: metrics
  containerPort: 8080
{{- end }}

{{/*
Ready when the router on the pod answers /health (503 until it serves and
while it drains), so the Services send traffic only there; over HTTPS under
tls. With client certificates required the kubelet, which has none, cannot
ask: readiness is then that the port accepts connections. Alive while the
pod's Ray node is: a router still waiting for its workers is not restarted.
*/}}
{{- define "shoal.routerProbes" -}}
readinessProbe:
  {{- if and .Values.tls.secretName (eq .Values.tls.clientAuth "required") }}
  tcpSocket:
    port: http
  {{- else }}
  httpGet:
    path: /health
    port: http
    {{- if .Values.tls.secretName }}
    scheme: HTTPS
    {{- end }}
  {{- end }}
  {{- toYaml .Values.routerGroup.readinessProbe | nindent 2 }}
livenessProbe:
  {{- include "shoal.rayletCheck" . | nindent 2 }}
  {{- toYaml .Values.routerGroup.livenessProbe | nindent 2 }}
{{- end }}

{{/* Stay up a few seconds after the pod is told to stop, while the Services drop it. */}}
{{- define "shoal.routerLifecycle" -}}
{{- with .Values.routerGroup.preStopSleepSeconds }}
preStop:
  exec:
    command: ["sleep", "{{ . }}"]
{{- end }}
{{- end }}

{{/*
The worker pods' resources: the values' CPU and memory, and gpusPerPod GPUs
(KubeRay turns the GPU limit into `ray start --num-gpus`).
*/}}
{{- define "shoal.workerResources" -}}
{{- $res := deepCopy (.Values.workerGroup.resources | default dict) }}
{{- $gpus := .Values.workerGroup.gpusPerPod | int }}
{{- if gt $gpus 0 }}
{{- $name := .Values.workerGroup.gpuResourceName }}
{{- $_ := set $res "limits" (merge (dict $name $gpus) ($res.limits | default dict)) }}
{{- if $res.requests }}
{{- $_ := set $res "requests" (merge (dict $name $gpus) $res.requests) }}
{{- end }}
{{- end }}
{{- toYaml $res }}
{{- end }}
