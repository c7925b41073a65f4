{{/* Chart name, overridable. */}}
{{- define "kvflow-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name of the operator's objects. */}}
{{- define "kvflow-operator.fullname" -}}
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

{{/* Labels that select the operator pod. */}}
{{- define "kvflow-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvflow-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of every object of the chart. */}}
{{- define "kvflow-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvflow-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: kvflow
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "kvflow-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvflow-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
RBAC rules for the objects the operator reads and writes in a watched namespace. They
mirror kvflow.operator.render.CHILD_KINDS (a test checks): create/patch for server-side
apply, list/watch for pruning, status and drift events, delete for pruning. Reading pods is
needed to grant the router's Role (RBAC refuses to grant what the granter lacks); patching
pods is the autoscaler's (pod-deletion-cost annotations before a scale-in) and the
reconciler's (the kvflow.dev/lora-adapters annotation the router loads adapters from).
*/}}
{{- define "kvflow-operator.namespacedRules" -}}
- apiGroups: ["kvflow.dev"]
  resources: ["modeldeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvflow.dev"]
  resources: ["modeldeployments/status"]
  verbs: ["get", "patch"]
- apiGroups: ["kvflow.dev"]
  resources: ["modeldeployments/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# A role over several nodes (nodesPerReplica > 1); harmless where LWS is not installed.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# The internal key of a disaggregated deployment: created once, never read back.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- end -}}
