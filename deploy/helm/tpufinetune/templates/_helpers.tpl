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

{{/* The operator's rules on the runs' namespaced objects: in the ClusterRole when it
watches every namespace, else in a Role of the watched namespace (rbac.namespaced,
role-watched.yaml). Two parts, to keep the ClusterRole's order that of deploy/base. */}}
{{- define "tpufinetune.runRules1" }}
  - apiGroups: [tpufinetune.dev]
    resources: [tpufinetunes]
    verbs: [get, list, watch, patch]
  - apiGroups: [tpufinetune.dev]
    resources: [tpufinetunes/status]
    verbs: [patch]
  - apiGroups: [ray.io]
    resources: [rayclusters]
    verbs: [get, list, watch, create, delete]
  - apiGroups: [""]
    resources: [pods]
    verbs: [list, watch]
{{- end -}}

{{- define "tpufinetune.runRules2" }}
  - apiGroups: [kueue.x-k8s.io]
    resources: [workloads]
    verbs: [list, watch]
  - apiGroups: [""]
    resources: [secrets]
    verbs: [create]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [create]
  - apiGroups: [""]
    resources: [events]
    verbs: [create]
{{- end -}}

{{/* true: the runs' rules go in a Role of settings.namespace, not the ClusterRole. */}}
{{- define "tpufinetune.namespacedRBAC" -}}
{{- if and .Values.settings.namespace .Values.rbac.namespaced }}true{{ end -}}
{{- end -}}
