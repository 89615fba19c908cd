{{/*
Worker pod template, shared by the StatefulSet and the DaemonSet (worker.yaml).
*/}}

{{/* Container resources plus huge pages and the RDMA device resource. */}}
{{- define "kvstore.worker.resources" -}}
{{- $w := .Values.worker -}}
{{- $res := deepCopy ($w.resources | default dict) -}}
{{- $requests := get $res "requests" | default dict -}}
{{- $limits := get $res "limits" | default dict -}}
{{- if $w.hugepages.enabled -}}
{{- $amount := include "kvstore.mibQuantity" (include "kvstore.worker.hugepagesMiB" .) -}}
{{- $key := printf "hugepages-%s" $w.hugepages.pageSize -}}
{{- $_ := set $requests $key $amount -}}
{{- $_ := set $limits $key $amount -}}
{{- end -}}
{{- if $w.rdma.enabled -}}
{{- $_ := set $requests $w.rdma.resourceName (int $w.rdma.count) -}}
{{- $_ := set $limits $w.rdma.resourceName (int $w.rdma.count) -}}
{{- end -}}
{{- if $requests }}{{ $_ := set $res "requests" $requests }}{{ end -}}
{{- if $limits }}{{ $_ := set $res "limits" $limits }}{{ end -}}
{{- with $res }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* Shared container security context, the worker's overrides, and IPC_LOCK for RDMA. */}}
{{- define "kvstore.worker.securityContext" -}}
{{- $w := .Values.worker -}}
{{- $sc := deepCopy .Values.containerSecurityContext -}}
{{- /* Explicit merge: mergeOverwrite may skip false and 0, the very values an override needs. */ -}}
{{- range $key, $value := deepCopy ($w.containerSecurityContext | default dict) -}}
{{- if and (kindIs "map" $value) (kindIs "map" (get $sc $key)) -}}
{{- range $k, $v := $value }}{{ $_ := set (get $sc $key) $k $v }}{{ end -}}
{{- else -}}
{{- $_ := set $sc $key $value -}}
{{- end -}}
{{- end -}}
{{- if and $w.rdma.enabled $w.rdma.ipcLock -}}
{{- $caps := get $sc "capabilities" | default dict -}}
{{- $add := get $caps "add" | default list -}}
{{- if not (has "IPC_LOCK" $add) }}{{ $add = append $add "IPC_LOCK" }}{{ end -}}
{{- $_ := set $caps "add" $add -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/* Anti-affinity mode: none for DaemonSets, hard when StatefulSet pods share a hostPath. */}}
{{- define "kvstore.worker.antiAffinityMode" -}}
{{- $w := .Values.worker -}}
{{- if eq $w.kind "DaemonSet" -}}
none
{{- else if and $w.ssd.enabled (eq $w.ssd.type "hostPath") -}}
hard
{{- else -}}
{{- $w.podAntiAffinity -}}
{{- end -}}
{{- end -}}

{{/* Node-local mode: the hand-over socket's directory, on the node and in the pods alike
(the release's namespace and full name appended, so releases never share one). */}}
{{- define "kvstore.worker.socketDir" -}}
{{- printf "%s/%s.%s" (trimSuffix "/" .Values.worker.nodeLocal.hostPath) .Release.Namespace (include "kvstore.fullname" .) -}}
{{- end -}}

{{- define "kvstore.worker.podTemplate" -}}
{{- $w := .Values.worker -}}
metadata:
  labels:
    {{- include "kvstore.labels" (dict "ctx" $ "component" "worker") | nindent 4 }}
    {{- with $w.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $w.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "kvstore.serviceAccountName" . }}
  automountServiceAccountToken: false
  {{- /* Service links would inject KVSTORE_*_PORT=tcp://... and clash with the daemon's env config. */}}
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ int $w.terminationGracePeriodSeconds }}
  {{- if $w.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- with $w.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "kvstore.affinity" (dict "ctx" $ "component" "worker" "affinity" $w.affinity "mode" (include "kvstore.worker.antiAffinityMode" .)) }}
  affinity:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with $w.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $uid := int (.Values.containerSecurityContext.runAsUser | default 10001) }}
  {{- $gid := int (.Values.containerSecurityContext.runAsGroup | default 10001) }}
  {{- $ssdInit := and $w.ssd.enabled (eq $w.ssd.type "hostPath") $w.ssd.hostPath.initPermissions }}
  {{- $sockInit := and $w.nodeLocal.enabled $w.nodeLocal.initPermissions }}
  {{- if or $ssdInit $sockInit }}
  initContainers:
  {{- end }}
  {{- if $sockInit }}
    {{- /* Root with CAP_CHOWN and CAP_FOWNER only: the socket directory to the worker's
    uid/gid, mode 0750 (engine pods run as the same uid: docs/KUBERNETES.md). */}}
    - name: socket-permissions
      image: {{ include "kvstore.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - sh
        - -c
        - chown {{ $uid }}:{{ $gid }} "$0" && chmod 0750 "$0"
        - {{ include "kvstore.worker.socketDir" . }}
      securityContext:
        runAsUser: 0
        runAsGroup: 0
        runAsNonRoot: false
        allowPrivilegeEscalation: false
        privileged: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
          add: ["CHOWN", "FOWNER"]
        seccompProfile:
          type: RuntimeDefault
      resources:
        requests:
          cpu: 10m
          memory: 16Mi
        limits:
          memory: 64Mi
      volumeMounts:
        - name: handover
          mountPath: {{ include "kvstore.worker.socketDir" . }}
  {{- end }}
  {{- if $ssdInit }}
    {{- /* Root, but with CAP_CHOWN only: hands the hostPath directory to the daemon's user. */}}
    - name: ssd-permissions
      image: {{ include "kvstore.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - chown
        - "{{ int (.Values.containerSecurityContext.runAsUser | default 10001) }}:{{ int (.Values.containerSecurityContext.runAsGroup | default 10001) }}"
        - /data
      securityContext:
        runAsUser: 0
        runAsGroup: 0
        runAsNonRoot: false
        allowPrivilegeEscalation: false
        privileged: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
          add: ["CHOWN"]
        seccompProfile:
          type: RuntimeDefault
      resources:
        requests:
          cpu: 10m
          memory: 16Mi
        limits:
          memory: 64Mi
      volumeMounts:
        - name: data
          mountPath: /data
  {{- end }}
  containers:
    - name: worker
      image: {{ include "kvstore.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - worker
        - {{ printf "--master=%s" (include "kvstore.masterAddresses" .) | quote }}
        - --host=0.0.0.0
        - --advertise-host=$(POD_IP)
        {{- /* DaemonSet pod names change on every restart; the node name is stable. */}}
        - --id={{ ternary "$(NODE_NAME)" "$(POD_NAME)" (eq $w.kind "DaemonSet") }}
        - --grpc-port={{ int $w.ports.grpc }}
        - --tcp-port={{ int $w.ports.tcp }}
        - --metrics-port={{ int .Values.metrics.port }}
        - --dram-size={{ $w.dram.size }}
        {{- if .Values.master.datagramBeats }}
        - --datagram-beats
        {{- end }}
        {{- if $w.nodeLocal.enabled }}
        - --shm-dir={{ include "kvstore.worker.socketDir" . }}
        {{- end }}
        {{- if $w.hugepages.enabled }}
        - --huge-pages={{ include "kvstore.worker.hugePageFlag" . }}
        {{- end }}
        {{- if $w.ssd.enabled }}
        - --ssd-path=/data
        - --ssd-size={{ $w.ssd.size }}
        {{- end }}
        {{- with $w.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        {{- include "kvstore.downwardEnv" . | nindent 8 }}
        {{- with $w.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ int $w.ports.grpc }}
          protocol: TCP
        - name: tcp
          containerPort: {{ int $w.ports.tcp }}
          protocol: TCP
        - name: metrics
          containerPort: {{ int .Values.metrics.port }}
          protocol: TCP
      {{- if $w.startupProbe.enabled }}
      startupProbe:
        {{- include "kvstore.grpcProbe" (dict "probe" $w.startupProbe "port" $w.ports.grpc) | nindent 8 }}
      {{- end }}
      {{- if $w.livenessProbe.enabled }}
      livenessProbe:
        {{- include "kvstore.grpcProbe" (dict "probe" $w.livenessProbe "port" $w.ports.grpc) | nindent 8 }}
      {{- end }}
      {{- if $w.readinessProbe.enabled }}
      readinessProbe:
        {{- include "kvstore.grpcProbe" (dict "probe" $w.readinessProbe "port" $w.ports.grpc) | nindent 8 }}
      {{- end }}
      {{- with include "kvstore.worker.resources" . }}
      resources:
        {{- . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "kvstore.worker.securityContext" . | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: dshm
          mountPath: /dev/shm
        {{- if $w.nodeLocal.enabled }}
        - name: handover
          mountPath: {{ include "kvstore.worker.socketDir" . }}
        {{- end }}
        {{- if $w.ssd.enabled }}
        - name: data
          mountPath: /data
        {{- end }}
        {{- with $w.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir:
        sizeLimit: 64Mi
    {{- /* /dev/shm holds only the arena's hand-over socket: the arena is a memfd, in no
    file system, of memory or (worker.hugepages) huge pages. */}}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: 16Mi
    {{- if $w.nodeLocal.enabled }}
    {{- /* Node-local mode: the hand-over socket where engine pods on this node mount it. */}}
    - name: handover
      hostPath:
        path: {{ include "kvstore.worker.socketDir" . }}
        type: DirectoryOrCreate
    {{- end }}
    {{- if and $w.ssd.enabled (eq $w.ssd.type "hostPath") }}
    - name: data
      hostPath:
        path: {{ $w.ssd.hostPath.path }}
        type: {{ $w.ssd.hostPath.type }}
    {{- else if and $w.ssd.enabled (eq $w.ssd.type "emptyDir") }}
    - name: data
      emptyDir:
        sizeLimit: {{ include "kvstore.worker.pvcSize" . }}
    {{- end }}
    {{- with $w.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
