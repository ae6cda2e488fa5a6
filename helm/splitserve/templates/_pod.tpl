{{/* Pieces of the head and worker pod templates. Each takes a dict: root (the chart's context)
     and the values it names (node: the head's or a pool's values). */}}

{{/* Scheduling and pod-level settings shared by head and workers. */}}
{{- define "splitserve.podCommon" -}}
{{- $root := .root -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .node.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .node.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The Ray container's image, security context, environment and mounts (head and workers:
     benchmark results and the batch API's store on the head, the compile cache on workers). */}}
{{- define "splitserve.rayContainer" -}}
{{- $root := .root -}}
image: {{ include "splitserve.image" $root }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
securityContext:
  {{- toYaml $root.Values.containerSecurityContext | nindent 2 }}
{{- if or $root.Values.apiKeySecret.name .compileCache }}
env:
  {{- with $root.Values.apiKeySecret.name }}
  - name: SPLITSERVE_API_KEY  # the ingress reads it when cluster.ingress.api_key is unset
    valueFrom:
      secretKeyRef: {name: {{ . }}, key: {{ $root.Values.apiKeySecret.key }}}
  {{- end }}
  {{- if .compileCache }}
  - name: TRITON_CACHE_DIR  # the kernels a worker compiles at start-up, kept for the next (compileCache)
    value: /compile-cache/triton
  {{- end }}
{{- end }}
{{- if or (not $root.Values.model.demo) .head .compileCache }}
volumeMounts:
  {{- if not $root.Values.model.demo }}
  - {name: model, mountPath: /models, readOnly: true}
  {{- end }}
  {{- if .head }}
  - {name: results, mountPath: /results}
  - {name: batches, mountPath: /batches}  # the ClusterConfig's batch.dir
  {{- end }}
  {{- if .compileCache }}
  - {name: compile-cache, mountPath: /compile-cache}
  {{- end }}
{{- end }}
{{- end -}}

{{/* A pod volume (list NAME CLAIM): the existing claim, or an emptyDir of the pod where it is "". */}}
{{- define "splitserve.claimOrEmptyDir" -}}
- name: {{ index . 0 }}
  {{- with index . 1 }}
  persistentVolumeClaim: {claimName: {{ . }}}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end -}}

{{/* The model volume: a read-only claim, or an emptyDir the download init container fills. */}}
{{- define "splitserve.modelVolume" -}}
{{- $model := .Values.model -}}
{{- if $model.pvc.claimName }}
- name: model
  persistentVolumeClaim: {claimName: {{ $model.pvc.claimName }}, readOnly: true}
{{- else if $model.huggingface.id }}
- name: model
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* Downloads the Hugging Face checkpoint into the model volume before Ray starts: the config
     and tokenizer files (*.json, *.jinja), which are all the ingress reads, and with weights (the
     workers) the safetensors, which are all the engine loads (not the .bin or .pth copies some
     repositories also carry). It calls snapshot_download, the function behind `hf download`,
     because its arguments are the same in every huggingface_hub release while the CLI's
     `--include` changed from one flag with several patterns to a repeated flag. */}}
{{- define "splitserve.modelDownload" -}}
{{- $root := .root -}}
{{- $hf := $root.Values.model.huggingface -}}
- name: model-download
  image: {{ include "splitserve.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  command:
    - python
    - -c
    - |
      import sys
      from huggingface_hub import snapshot_download
      repo_id, revision, local_dir, *patterns = sys.argv[1:]
      snapshot_download(repo_id=repo_id, revision=revision or None, local_dir=local_dir,
                        allow_patterns=patterns)
    - {{ $hf.id | quote }}
    - {{ $hf.revision | quote }}
    - {{ include "splitserve.modelDir" $root | quote }}
    - "*.json"
    - "*.jinja"
    {{- if .weights }}
    - "*.safetensors"
    {{- end }}
  env:
    - name: HF_HOME  # the image's home may be read-only; the volume is not
      value: /models/.hf-home
    {{- with $hf.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ . }}, key: {{ $hf.tokenSecret.key }}}
    {{- end }}
  volumeMounts:
    - {name: model, mountPath: /models}
{{- end -}}

{{/* Caps the power of the pod's GPUs before the worker starts. Setting a GPU's power limit
     needs root and the host's GPU devices, so this one container runs privileged as root; it
     requests the pod's GPUs so the device plugin hands it the same GPUs as the worker. */}}
{{- define "splitserve.powerCap" -}}
- name: power-cap
  image: {{ include "splitserve.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: [nvidia-smi, -pl, {{ int .pool.powerCapWatts | quote }}]
  securityContext:
    privileged: true
    runAsUser: 0
    runAsNonRoot: false
  resources:
    limits: {nvidia.com/gpu: {{ int .pool.gpusPerPod }}}
{{- end -}}

{{/* A pool's worker group: rayStartParams give Ray exactly the pool's GPUs, CPUs and resource, so
     the pod holds gpusPerPod / tensorParallelSize workers' ranks (one per GPU) and nothing more. */}}
{{- define "splitserve.workerGroup" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $pool := .pool -}}
{{- $gpus := int $pool.gpusPerPod -}}
{{- $nodeSelector := deepCopy $pool.nodeSelector -}}
{{- with $pool.gpuProduct }}{{ $_ := set $nodeSelector $root.Values.gpuProductLabel . }}{{ end -}}
{{- $resources := deepCopy $pool.resources -}}
{{- $limits := dict -}}
{{- if hasKey $resources "limits" }}{{ $limits = $resources.limits }}{{ end -}}
{{- $_ := set $limits "nvidia.com/gpu" $gpus -}}
{{- $_ := set $resources "limits" $limits -}}
- groupName: {{ $role }}
  # A fixed size: the CLS owns the pools' workers, so Ray's autoscaler has nothing to add.
  replicas: {{ int $pool.replicas }}
  minReplicas: {{ int $pool.replicas }}
  maxReplicas: {{ int $pool.replicas }}
  rayStartParams:
    num-gpus: {{ $gpus | quote }}
    num-cpus: {{ mul $gpus $pool.cpusPerRank | quote }}
    # JSON in single quotes, the form KubeRay writes itself: it passes rayStartParams to `ray start`
    # through bash, and parses this one (quotes trimmed) to add accelerator resources; the escaped form
    # '"{\"x\": 1}"' of older docs passes bash but fails that parse.
    resources: {{ dict (include "splitserve.poolResource" $role) $gpus | toJson | squote | quote }}
  template:
    metadata:
      labels:
        {{- include "splitserve.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: ray-worker
        splitserve.io/pool: {{ $role }}
    spec:
      {{- include "splitserve.podCommon" (dict "root" $root "node" $pool "nodeSelector" $nodeSelector) | trim | nindent 6 }}
      {{- if or $pool.powerCapWatts $root.Values.model.huggingface.id }}
      initContainers:
        {{- if $pool.powerCapWatts }}
        {{- include "splitserve.powerCap" (dict "root" $root "pool" $pool) | nindent 8 }}
        {{- end }}
        {{- if $root.Values.model.huggingface.id }}
        {{- include "splitserve.modelDownload" (dict "root" $root "weights" true) | nindent 8 }}
        {{- end }}
      {{- end }}
      containers:
        - name: ray-worker
          {{- include "splitserve.rayContainer" (dict "root" $root "compileCache" true) | nindent 10 }}
          resources:
            {{- toYaml $resources | nindent 12 }}
      volumes:
        {{- with include "splitserve.modelVolume" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- include "splitserve.claimOrEmptyDir" (list "compile-cache" $root.Values.compileCache.claimName) | nindent 8 }}
{{- end -}}
