{{/*
Names. Objects are named after the release, not the chart: learner releases in other
namespaces or clusters must be able to compute the syncer's DNS names from
cluster.syncerRelease alone, so there is no nameOverride/fullnameOverride indirection.
*/}}
{{- define "diloco.syncerName" -}}{{ printf "%s-syncer" .Release.Name }}{{- end -}}
{{- define "diloco.syncerHeadlessName" -}}{{ printf "%s-syncer-headless" .Release.Name }}{{- end -}}
{{- define "diloco.learnerName" -}}{{ printf "%s-learner" .Release.Name }}{{- end -}}
{{- define "diloco.learnerHeadlessName" -}}{{ printf "%s-learner-headless" .Release.Name }}{{- end -}}
{{- define "diloco.configName" -}}{{ printf "%s-config" .Release.Name }}{{- end -}}
{{- define "diloco.dashboardsName" -}}{{ printf "%s-dashboards" .Release.Name }}{{- end -}}

{{- define "diloco.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ default (printf "%s-diloco" .Release.Name) .Values.serviceAccount.name }}
{{- else -}}
{{ default "default" .Values.serviceAccount.name }}
{{- end -}}
{{- end -}}

{{/* Where the processes find things inside their containers. */}}
{{- define "diloco.configDir" -}}/etc/diloco{{- end -}}
{{- define "diloco.configPath" -}}/etc/diloco/cluster.yaml{{- end -}}
{{- define "diloco.stateDir" -}}/var/lib/diloco{{- end -}}
{{- define "diloco.tlsDir" -}}/etc/diloco/tls{{- end -}}

{{- define "diloco.image" -}}
{{ printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end -}}

{{/* Labels. Call with (dict "ctx" $ "component" "syncer"|"learner"|...). */}}
{{- define "diloco.selectorLabels" -}}
app.kubernetes.io/name: diloco
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "diloco.labels" -}}
{{ include "diloco.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ default .ctx.Chart.AppVersion .ctx.Values.image.tag | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: diloco
diloco.dev/run: {{ .ctx.Values.config.run.name | default "diloco" | quote }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The address learners dial for shard .index: the cluster.syncerAddresses entry, or the
shard pod's stable DNS name behind the syncer release's headless Service.
Call with (dict "ctx" $ "index" i).
*/}}
{{- define "diloco.shardAddress" -}}
{{- $v := .ctx.Values -}}
{{- if $v.cluster.syncerAddresses -}}
{{ index $v.cluster.syncerAddresses (int .index) }}
{{- else -}}
{{- $release := default .ctx.Release.Name $v.cluster.syncerRelease -}}
{{- $namespace := default .ctx.Release.Namespace $v.cluster.syncerNamespace -}}
{{ printf "%s-syncer-%d.%s-syncer-headless.%s.svc.%s:%d" $release (int .index) $release $namespace $v.cluster.clusterDomain (int $v.syncer.port) }}
{{- end -}}
{{- end -}}

{{/* The cluster.regions entry of this release's region (learners.region), as YAML. */}}
{{- define "diloco.thisRegion" -}}
{{- $found := dict -}}
{{- range .Values.cluster.regions -}}
{{- if eq .name $.Values.learners.region }}{{ $found = . }}{{ end -}}
{{- end -}}
{{- if not $found -}}
{{- fail (printf "learners.region: %q is not one of cluster.regions (%s); every region that runs learners must be listed there so that all releases render the same learner list" .Values.learners.region (include "diloco.regionNames" .)) -}}
{{- end -}}
{{ toYaml $found }}
{{- end -}}

{{- define "diloco.regionNames" -}}
{{- $names := list -}}
{{- range .Values.cluster.regions }}{{ $names = append $names .name }}{{ end -}}
{{ join ", " $names }}
{{- end -}}

{{/*
The cluster config (services/contract/config/) every process of the run reads: the `config`
values passed through, plus what the chart knows better than a user: the shards (one
per syncer pod), every learner of every region (id <region>-<ordinal>, the same ids the
learner pods compute from their ordinal) and the state directory inside the containers.
Sections are written in a fixed order so the file reads like examples/*.yaml.
*/}}
{{- define "diloco.clusterConfig" -}}
{{- $v := .Values -}}
{{- $run := merge (dict "state_dir" (include "diloco.stateDir" .)) (deepCopy $v.config.run) -}}
{{- $shards := list -}}
{{- range $i := until (int $v.cluster.shards) -}}
{{- $shards = append $shards (dict "address" (include "diloco.shardAddress" (dict "ctx" $ "index" $i)) "metrics_port" $v.syncer.metricsPort "health_port" $v.syncer.healthPort) -}}
{{- end -}}
{{- $learners := list -}}
{{- range $region := $v.cluster.regions -}}
{{- range $i := until (int $region.learners) -}}
{{- $learners = append $learners (dict "id" (printf "%s-%d" $region.name $i) "region" $region.name "metrics_port" $v.learners.metricsPort) -}}
{{- end -}}
{{- end -}}
# Rendered by the diloco Helm chart (release {{ .Release.Name }}) from its values.
# Every release of run {{ $run.name | quote }} renders this same file.
{{ toYaml (dict "run" $run) }}
{{ toYaml (dict "shards" $shards) }}
{{ toYaml (dict "learners" $learners) }}
{{ toYaml (dict "tls" (dict "mode" $v.tls.mode)) }}
{{- range $section := list "sync" "syncer" "trainer" "model" "data" "rpc" "limits" "island" }}
{{- if hasKey $v.config $section }}
{{ toYaml (dict $section (get $v.config $section)) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Volumes and mounts of the TLS Secrets, shared by syncer and learner pods. */}}
{{- /* With learnerIds (learner pods): each of those learners' Secrets in a folder named
  after it; else (shards) the shards' Secret. */ -}}
{{- define "diloco.secretVolumes" -}}
{{- $tls := .ctx.Values.tls }}
{{- if and (eq $tls.mode "mtls") .learnerIds }}
- name: tls
  projected:
    defaultMode: 0440
    sources:
      {{- range .learnerIds }}
      - secret:
          name: {{ printf "%s%s" $tls.learnerSecretPrefix . }}
          items:
            {{- $id := . }}
            {{- range list "ca.crt" "tls.crt" "tls.key" }}
            - {key: {{ . }}, path: {{ printf "%s/%s" $id . }}}
            {{- end }}
      {{- end }}
{{- else if eq $tls.mode "mtls" }}
- name: tls
  secret:
    secretName: {{ $tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "diloco.secretMounts" -}}
{{- if eq .ctx.Values.tls.mode "mtls" }}
- name: tls
  mountPath: {{ include "diloco.tlsDir" .ctx }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Checks across values that a JSON schema cannot express. Each message names the key to
change. Rendered (as nothing) by templates/validate.yaml, so helm lint/template/install
all refuse such values before anything reaches the cluster.
*/}}
{{- define "diloco.validate" -}}
{{- $v := .Values -}}
{{- if not (or $v.syncer.enabled $v.learners.enabled) -}}
{{- fail "syncer.enabled and learners.enabled are both false: this release would deploy nothing" -}}
{{- end -}}
{{- /* <release>-learner-headless and <release>-syncer-<i>-external must stay DNS labels (63). */ -}}
{{- if gt (len .Release.Name) 40 -}}
{{- fail (printf "release name %q is %d characters; at most 40 keep the syncer's and learners' DNS names under 63" .Release.Name (len .Release.Name)) -}}
{{- end -}}
{{- if and $v.syncer.enabled (le (int $v.syncer.terminationGracePeriodSeconds) (int $v.syncer.drainSeconds)) -}}
{{- fail (printf "syncer.terminationGracePeriodSeconds (%d) must be greater than syncer.drainSeconds (%d): Kubernetes would kill a shard before it has drained and flushed its state" (int $v.syncer.terminationGracePeriodSeconds) (int $v.syncer.drainSeconds)) -}}
{{- end -}}
{{- if and (eq $v.tls.mode "mtls") $v.syncer.enabled (not $v.tls.secretName) -}}
{{- fail "tls.secretName: the shards need a Secret with their certificate (tls.mode is mtls)" -}}
{{- end -}}
{{- if and (eq $v.tls.mode "mtls") $v.learners.enabled (not $v.tls.learnerSecretPrefix) -}}
{{- fail "tls.learnerSecretPrefix: each learner needs a Secret <prefix><learner id> with its certificate (tls.mode is mtls)" -}}
{{- end -}}
{{- if and $v.syncer.enabled (eq (int $v.syncer.healthPort) (int $v.syncer.port)) -}}
{{- fail (printf "syncer.healthPort: %d is syncer.port; the plaintext health port needs a port of its own" (int $v.syncer.healthPort)) -}}
{{- end -}}
{{- if and $v.cluster.syncerAddresses (ne (len $v.cluster.syncerAddresses) (int $v.cluster.shards)) -}}
{{- fail (printf "cluster.syncerAddresses has %d entries but cluster.shards is %d: give one address per shard, in shard order" (len $v.cluster.syncerAddresses) (int $v.cluster.shards)) -}}
{{- end -}}
{{- if and $v.syncer.enabled $v.syncer.expose.enabled $v.syncer.expose.externalDnsFromAddresses (not $v.cluster.syncerAddresses) -}}
{{- fail "syncer.expose.externalDnsFromAddresses needs cluster.syncerAddresses (the hostnames to publish)" -}}
{{- end -}}
{{- $names := dict -}}
{{- $total := 0 -}}
{{- range $v.cluster.regions -}}
{{- if hasKey $names .name -}}
{{- fail (printf "cluster.regions: region %q is listed twice; learner ids <region>-<ordinal> would collide" .name) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- $total = add $total (int .learners) -}}
{{- end -}}
{{- if eq (int $total) 0 -}}
{{- fail "cluster.regions: no region runs a learner; the cluster config needs at least one" -}}
{{- end -}}
{{- if $v.learners.enabled -}}
{{- $_ := include "diloco.thisRegion" . -}}
{{- if and (eq $v.learners.workload "Job") $v.learners.persistence.enabled -}}
{{- fail "learners.persistence.enabled needs learners.workload=StatefulSet (a Job has no per-pod volume claims); a Job keeps checkpoints in an emptyDir that survives container restarts" -}}
{{- end -}}
{{- $gpus := int $v.learners.gpus -}}
{{- $nproc := int $v.learners.torchrun.nprocPerNode -}}
{{- if and (gt $gpus 0) (gt $nproc $gpus) -}}
{{- fail (printf "learners.torchrun.nprocPerNode (%d) is more than learners.gpus (%d): nccl needs one GPU per process" $nproc $gpus) -}}
{{- end -}}
{{- $groups := int (dig "island" "replica_groups" 1 $v.config) -}}
{{- if and (gt $groups 1) (gt $nproc 1) -}}
{{- fail (printf "config.island.replica_groups (%d): each replica group is one process, so learners.torchrun.nprocPerNode must be 1 (it is %d)" $groups $nproc) -}}
{{- end -}}
{{- if and (gt $groups 1) (ne (mod $gpus $groups) 0) -}}
{{- fail (printf "learners.gpus (%d) does not split evenly over config.island.replica_groups (%d): each group takes gpus / groups" $gpus $groups) -}}
{{- end -}}
{{- end -}}
{{- /* Relations services/contract/config/ also checks at start-up; caught here before a deploy. */ -}}
{{- $sync := $v.config.sync | default dict -}}
{{- $syncer := $v.config.syncer | default dict -}}
{{- $trainer := $v.config.trainer | default dict -}}
{{- /* Defaults as in services/contract/config/. */ -}}
{{- $fragments := int (dig "fragments" 4 $sync) -}}
{{- if gt (int $v.cluster.shards) $fragments -}}
{{- fail (printf "cluster.shards (%d) is more than config.sync.fragments (%d): a shard would own no fragment" (int $v.cluster.shards) $fragments) -}}
{{- end -}}
{{- $quorum := int (dig "quorum" 1 $syncer) -}}
{{- if gt $quorum $total -}}
{{- fail (printf "config.syncer.quorum (%d) is more than the learners of all cluster.regions (%d)" $quorum $total) -}}
{{- end -}}
{{- $tau := int (dig "overlap_steps" 2 $sync) -}}
{{- $h := int (dig "interval_steps" 24 $sync) -}}
{{- if ge $tau $h -}}
{{- fail (printf "config.sync.overlap_steps (%d) must be smaller than config.sync.interval_steps (%d)" $tau $h) -}}
{{- end -}}
{{- $lease := float64 (dig "lease_seconds" 5.0 $syncer) -}}
{{- $heartbeat := float64 (dig "heartbeat_seconds" 0.5 $trainer) -}}
{{- if lt $lease (mulf $heartbeat 2) -}}
{{- fail (printf "config.syncer.lease_seconds (%v) must be at least twice config.trainer.heartbeat_seconds (%v)" $lease $heartbeat) -}}
{{- end -}}
{{- end -}}
