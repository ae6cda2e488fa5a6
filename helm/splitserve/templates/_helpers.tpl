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

{{/* The Ray resource a pool's worker group advertises and its workers' ranks request. */}}
{{- define "splitserve.poolResource" -}}
splitserve-{{ . }}
{{- end -}}

{{/* A pool's workers: each is tensorParallelSize GPUs of one pod (validate: it divides gpusPerPod). */}}
{{- define "splitserve.poolWorkers" -}}
{{- div (mul .replicas .gpusPerPod) .tensorParallelSize -}}
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
{{- if (.Values.cluster.batch | default dict).dir -}}
{{- fail "cluster.batch.dir: the chart keeps the batch API's store at /batches on the head pod; give head.batchesClaimName a claim to keep it across restarts" -}}
{{- end -}}
{{- if and $model.pvc.claimName (not $model.pvc.path) -}}
{{- fail "model.pvc.path: set the checkpoint directory inside the claim (it holds config.json)" -}}
{{- end -}}
{{- $enabled := list -}}
{{- range $role := list "prompt" "token" "mixed" -}}
{{- $pool := index $.Values.pools $role -}}
{{- if $pool.enabled -}}
{{- $enabled = append $enabled $role -}}
{{- if or (lt (int $pool.replicas) 1) (lt (int $pool.gpusPerPod) 1) -}}
{{- fail (printf "pools.%s: replicas and gpusPerPod must be at least 1 (disable the pool with enabled: false)" $role) -}}
{{- end -}}
{{- $tp := $pool.tensorParallelSize -}}
{{- if or (lt (int $tp) 1) (ne (float64 (int $tp)) (float64 $tp)) -}}
{{- fail (printf "pools.%s.tensorParallelSize=%v: give the GPUs of one worker, a whole number of at least 1" $role $tp) -}}
{{- end -}}
{{- if mod (int $pool.gpusPerPod) (int $tp) -}}
{{- fail (printf "pools.%s.tensorParallelSize=%v does not divide gpusPerPod=%v: a worker's ranks are packed on one node, so each pod must hold whole workers" $role $tp $pool.gpusPerPod) -}}
{{- end -}}
{{- if hasKey $pool "cpusPerWorker" -}}
{{- fail (printf "pools.%s.cpusPerWorker: renamed cpusPerRank (Ray CPUs per rank, that is per GPU; a worker of tensorParallelSize ranks reserves that many times it)" $role) -}}
{{- end -}}
{{- if ne (float64 (int $pool.cpusPerRank)) (float64 $pool.cpusPerRank) -}}
{{- fail (printf "pools.%s.cpusPerRank=%v: use a whole number (Ray counts a node's CPUs in whole units)" $role $pool.cpusPerRank) -}}
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

{{/* The Serve app's args: a ClusterConfig. `resources` are what Ray reserves per rank (a worker
     is tensor_parallel_size ranks): one GPU, cpusPerRank CPUs and one unit of the pool's resource,
     which only that pool's worker group advertises, one unit per GPU. */}}
{{- define "splitserve.clusterConfig" -}}
{{- $pools := list -}}
{{- range $role := list "prompt" "token" "mixed" -}}
{{- $pool := index $.Values.pools $role -}}
{{- if $pool.enabled -}}
{{- $resources := dict "num_cpus" (int $pool.cpusPerRank) "num_gpus" 1 "resources" (dict (include "splitserve.poolResource" $role) 1) -}}
{{- with $pool.acceleratorType }}{{ $_ := set $resources "accelerator_type" . }}{{ end -}}
{{- $workers := int (include "splitserve.poolWorkers" $pool) -}}
{{- $pools = append $pools (dict "role" $role "num_workers" $workers "hardware" $pool.hardware "tensor_parallel_size" (int $pool.tensorParallelSize) "resources" $resources) -}}
{{- end -}}
{{- end -}}
{{- $config := dict "model" (include "splitserve.modelDir" .) "pools" $pools -}}
{{- with include "splitserve.servedModelName" . }}{{ $_ := set $config "served_model_name" . }}{{ end -}}
{{- range $key, $value := .Values.cluster }}{{ if $value }}{{ $_ := set $config $key $value }}{{ end }}{{ end -}}
{{- $_ := set $config "batch" (merge (dict "dir" "/batches") (.Values.cluster.batch | default dict)) -}}
{{- toYaml $config -}}
{{- end -}}
