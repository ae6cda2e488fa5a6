{{/* Names, labels, checks on the values, and the ClusterConfig the Serve app receives. */}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* 40 characters, not Kubernetes' 63: KubeRay derives the RayCluster's name (plus a random
     suffix), its Services (<name>-serve-svc, <name>-head-svc) and its pods' names from it. */}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* KubeRay's Serve Service carries these (spec.serveService): the ServiceMonitor selects them.
     No managed-by: KubeRay, not helm, owns that Service. */}}
{{- define "splitserve.serveServiceLabels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/component: serve
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "splitserve.rayAuthSecret" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/* The Ray resource a pool's worker group advertises and its workers request. */}}
{{- define "splitserve.poolResource" -}}
splitserve-{{ . }}
{{- end -}}

{{/* Fails the install on values that would deploy something other than what they say. */}}
{{- define "splitserve.validate" -}}
{{- $model := .Values.model -}}
{{- $sources := 0 -}}
{{- if $model.demo }}{{ $sources = add1 $sources }}{{ end -}}
{{- if $model.huggingface.id }}{{ $sources = add1 $sources }}{{ end -}}
{{- if $model.pvc.claimName }}{{ $sources = add1 $sources }}{{ end -}}
{{- if ne (int $sources) 1 -}}
{{- fail (printf "model: set exactly one model source, found %d: model.demo=true (smoke install), model.huggingface.id, or model.pvc.claimName (with model.pvc.path)" (int $sources)) -}}
{{- end -}}
{{- if and $model.pvc.claimName (not $model.pvc.path) -}}
{{- fail "model.pvc.path: set the checkpoint directory inside the claim (it holds config.json)" -}}
{{- end -}}
{{- $enabled := list -}}
{{- range $role := list "prompt" "token" "mixed" -}}
{{- $pool := index $.Values.pools $role -}}
{{- if $pool.enabled -}}
{{- $enabled = append $enabled $role -}}
{{- if ne (int $pool.tensorParallelSize) 1 -}}
{{- fail (printf "pools.%s.tensorParallelSize=%v: splitserve has no tensor parallelism yet (one worker is one engine on one GPU); set it to 1 and use a model that fits one GPU" $role $pool.tensorParallelSize) -}}
{{- end -}}
{{- if or (lt (int $pool.replicas) 1) (lt (int $pool.gpusPerPod) 1) -}}
{{- fail (printf "pools.%s: replicas and gpusPerPod must be at least 1 (disable the pool with enabled: false)" $role) -}}
{{- end -}}
{{- if ne (float64 (int $pool.cpusPerWorker)) (float64 $pool.cpusPerWorker) -}}
{{- fail (printf "pools.%s.cpusPerWorker=%v: use a whole number (Ray counts a node's CPUs in whole units)" $role $pool.cpusPerWorker) -}}
{{- end -}}
{{- if and $pool.powerCapWatts (lt (int $pool.powerCapWatts) 1) -}}
{{- fail (printf "pools.%s.powerCapWatts=%v: give watts per GPU, or null for no cap" $role $pool.powerCapWatts) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $enabled -}}
{{- fail "pools: enable at least one of pools.prompt, pools.token, pools.mixed" -}}
{{- end -}}
{{- if ne (has "prompt" $enabled) (has "token" $enabled) -}}
{{- fail "pools: the prompt and token pools go together (or run the mixed pool alone)" -}}
{{- end -}}
{{- range $key, $_ := .Values.cluster -}}
{{- if has $key (list "model" "served_model_name" "pools") -}}
{{- fail (printf "cluster.%s: set it through the chart's model and pools values" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The ClusterConfig's `model`: the directory every pod sees the checkpoint in. */}}
{{- define "splitserve.modelDir" -}}
{{- if .Values.model.demo -}}
demo
{{- else if .Values.model.huggingface.id -}}
/models/{{ .Values.model.huggingface.id }}
{{- else -}}
/models/{{ trimPrefix "/" .Values.model.pvc.path }}
{{- end -}}
{{- end -}}

{{- define "splitserve.servedModelName" -}}
{{- .Values.model.servedModelName | default .Values.model.huggingface.id | default .Values.model.pvc.path -}}
{{- end -}}

{{/* The Serve app's args: a ClusterConfig. Each pool worker takes one GPU and one unit of its
     pool's resource, which only that pool's worker group advertises. */}}
{{- define "splitserve.clusterConfig" -}}
{{- $pools := list -}}
{{- range $role := list "prompt" "token" "mixed" -}}
{{- $pool := index $.Values.pools $role -}}
{{- if $pool.enabled -}}
{{- $resources := dict "num_cpus" (int $pool.cpusPerWorker) "num_gpus" 1 "resources" (dict (include "splitserve.poolResource" $role) 1) -}}
{{- with $pool.acceleratorType }}{{ $_ := set $resources "accelerator_type" . }}{{ end -}}
{{- $workers := mul $pool.replicas $pool.gpusPerPod -}}
{{- $pools = append $pools (dict "role" $role "num_workers" $workers "hardware" $pool.hardware "resources" $resources) -}}
{{- end -}}
{{- end -}}
{{- $config := dict "model" (include "splitserve.modelDir" .) "pools" $pools -}}
{{- with include "splitserve.servedModelName" . }}{{ $_ := set $config "served_model_name" . }}{{ end -}}
{{- range $key, $value := .Values.cluster }}{{ if $value }}{{ $_ := set $config $key $value }}{{ end }}{{ end -}}
{{- toYaml $config -}}
{{- end -}}
