{{/* Object names are fixed, as in deploy/base: the ClusterRole and the CRD are
cluster-wide singletons, so one release per cluster. */}}
{{- define "tpufinetune.name" -}}tpufinetune-operator{{- end -}}

{{- define "tpufinetune.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tpufinetune.name" . }}
{{- end -}}

{{- define "tpufinetune.labels" -}}
{{ include "tpufinetune.selectorLabels" . }}
app.kubernetes.io/part-of: tpufinetune
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}


{{/* The operator's ServiceAccount: the chart's, or one you manage (serviceAccount.create
false and its name). */}}
{{- define "tpufinetune.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (include "tpufinetune.name" .) -}}
{{- end -}}

{{/* true: more than one watched namespace, or a glob: the operator's caches watch
RayClusters, pods and Workloads cluster-wide (read only; deploy/overlays/several-namespaces). */}}
{{- define "tpufinetune.severalNamespaces" -}}
{{- $n := default (list) .Values.settings.namespaces -}}
{{- if or (gt (len $n) 1) (and (eq (len $n) 1) (regexMatch "[*?]" (first $n))) }}true{{ end -}}
{{- end -}}
