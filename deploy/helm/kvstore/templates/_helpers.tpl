{{/*
Names, labels and small computations shared by every template.
*/}}

{{/* Chart name, used in app.kubernetes.io/name. */}}
{{- define "kvstore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Resource name prefix. Cut to 42 characters so that derived names such as
"<prefix>-master-headless" and StatefulSet revision labels stay within 63.
*/}}
{{- define "kvstore.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 42 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* helm.sh/chart label value. */}}
{{- define "kvstore.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels (immutable on StatefulSets and DaemonSets).
Call with (dict "ctx" $ "component" "master").
*/}}
{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstore.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{/*
Standard labels. Call with (dict "ctx" $ "component" "worker"); an empty
component (the shared ServiceAccount) leaves app.kubernetes.io/component out.
*/}}
{{- define "kvstore.labels" -}}
helm.sh/chart: {{ include "kvstore.chart" .ctx }}
{{ include "kvstore.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Values.image.tag | default .ctx.Chart.AppVersion | replace "+" "_" | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvstore
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Container image reference; a digest wins over the tag. */}}
{{- define "kvstore.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvstore.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.masterReplicas" -}}
{{- if .Values.ha.enabled }}{{ int .Values.ha.replicas }}{{ else }}1{{ end -}}
{{- end -}}

{{/* Client-facing master address, host:port. */}}
{{- define "kvstore.masterService" -}}
{{- printf "%s-master.%s.svc.%s:%d" (include "kvstore.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.master.ports.grpc) -}}
{{- end -}}

{{/*
Comma-separated stable addresses of every master pod (through the headless
Service, which publishes not-ready pods too), passed to workers as --master.
*/}}
{{- define "kvstore.masterAddresses" -}}
{{- $fullname := include "kvstore.fullname" . -}}
{{- $addrs := list -}}
{{- range $i := until (int (include "kvstore.masterReplicas" .)) -}}
{{- $addrs = append $addrs (printf "%s-master-%d.%s-master-headless.%s.svc.%s:%d" $fullname $i $fullname $.Release.Namespace $.Values.clusterDomain (int $.Values.master.ports.grpc)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/*
Kubernetes quantity -> whole MiB (rounded down), or "" when it cannot be parsed
(decimal or exponent forms). Accepts plain bytes, k/M/G/T and Ki/Mi/Gi/Ti.
*/}}
{{- define "kvstore.quantityMiB" -}}
{{- $q := toString . -}}
{{- if regexMatch "^[0-9]+(k|M|G|T|Ki|Mi|Gi|Ti)?$" $q -}}
{{- $digits := regexFind "^[0-9]+" $q -}}
{{- $n := int64 $digits -}}
{{- $unit := trimPrefix $digits $q -}}
{{- $bytes := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $mib := dict "Ki" 0 "Mi" 1 "Gi" 1024 "Ti" 1048576 -}}
{{- if hasKey $bytes $unit -}}
{{- div (mul $n (get $bytes $unit)) 1048576 -}}
{{- else if eq $unit "Ki" -}}
{{- div $n 1024 -}}
{{- else -}}
{{- mul $n (get $mib $unit) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* CLI size (512MiB, 4GiB, 1TiB) -> whole MiB; fails on anything else. */}}
{{- define "kvstore.sizeMiB" -}}
{{- $s := toString . -}}
{{- if not (regexMatch "^[0-9]+(MiB|GiB|TiB)$" $s) -}}
{{- fail (printf "size %q must be a whole number of MiB, GiB or TiB, e.g. 4GiB" $s) -}}
{{- end -}}
{{- include "kvstore.quantityMiB" (trimSuffix "B" $s) -}}
{{- end -}}

{{/* Whole MiB -> Kubernetes quantity, in Gi when it divides evenly. */}}
{{- define "kvstore.mibQuantity" -}}
{{- $n := int64 . -}}
{{- if and (gt $n 0) (eq (mod $n 1024) 0) -}}
{{- printf "%dGi" (div $n 1024) -}}
{{- else -}}
{{- printf "%dMi" $n -}}
{{- end -}}
{{- end -}}

{{/* Huge page size as the worker's --huge-pages flag takes it: 2Mi -> 2MiB. */}}
{{- define "kvstore.worker.hugePageFlag" -}}
{{- ternary "2MiB" "1GiB" (eq .Values.worker.hugepages.pageSize "2Mi") -}}
{{- end -}}

{{/* Huge pages requested per worker in MiB: dram.size rounded up to whole pages. */}}
{{- define "kvstore.worker.hugepagesMiB" -}}
{{- $page := ternary 2 1024 (eq .Values.worker.hugepages.pageSize "2Mi") | int64 -}}
{{- $dram := include "kvstore.sizeMiB" .Values.worker.dram.size | int64 -}}
{{- mul (div (add $dram (sub $page 1)) $page) $page -}}
{{- end -}}

{{/* Memory (MiB) a worker needs under its memory limit: the arena (a memfd of shared
memory, charged to the container's memory cgroup) unless it is on huge pages, plus
dram.headroom for the process itself. */}}
{{- define "kvstore.worker.memoryNeedMiB" -}}
{{- $headroom := include "kvstore.sizeMiB" .Values.worker.dram.headroom | int64 -}}
{{- if .Values.worker.hugepages.enabled -}}
{{- $headroom -}}
{{- else -}}
{{- add (include "kvstore.sizeMiB" .Values.worker.dram.size | int64) $headroom -}}
{{- end -}}
{{- end -}}

{{/* PVC size: persistence.size, or ssd.size plus 10% for filesystem overhead. */}}
{{- define "kvstore.worker.pvcSize" -}}
{{- if .Values.worker.ssd.persistence.size -}}
{{- .Values.worker.ssd.persistence.size -}}
{{- else -}}
{{- $mib := include "kvstore.sizeMiB" .Values.worker.ssd.size | int64 -}}
{{- include "kvstore.mibQuantity" (add $mib (div (add $mib 9) 10)) -}}
{{- end -}}
{{- end -}}

{{/*
Pod anti-affinity preset (or the user's affinity, verbatim).
Call with (dict "ctx" $ "component" "master" "affinity" .. "mode" "soft").
*/}}
{{- define "kvstore.affinity" -}}
{{- if .affinity -}}
{{- toYaml .affinity -}}
{{- else if eq .mode "hard" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - labelSelector:
        matchLabels:
          {{- include "kvstore.selectorLabels" . | nindent 10 }}
      topologyKey: kubernetes.io/hostname
{{- else if eq .mode "soft" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        labelSelector:
          matchLabels:
            {{- include "kvstore.selectorLabels" . | nindent 12 }}
        topologyKey: kubernetes.io/hostname
{{- end -}}
{{- end -}}

{{/*
A native gRPC probe on the daemon's health service.
Call with (dict "probe" .Values.master.livenessProbe "port" 7700).
*/}}
{{- define "kvstore.grpcProbe" -}}
grpc:
  port: {{ int .port }}
{{ omit .probe "enabled" | toYaml }}
{{- end -}}

{{/* Downward-API environment shared by every kvstore container. */}}
{{- define "kvstore.downwardEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end -}}

{{/* The masters' UDP beat port: master.ports.beats, or the gRPC port's number when 0. */}}
{{- define "kvstore.beatPort" -}}
{{- $m := .Values.master -}}
{{- if $m.ports.beats }}{{ int $m.ports.beats }}{{ else }}{{ int $m.ports.grpc }}{{ end -}}
{{- end }}
