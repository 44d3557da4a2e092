#!/bin/sh
# Entry point of pod kvps-N. Nodes 0-2 are cluster.toml's first nodes (they run the metadata group);
# a pod with a higher ordinal joins through kvps-0. Every node listens on 0.0.0.0 (--bind) and is
# reached at its pod DNS name; the namespace comes from the downward API (POD_NAMESPACE).
#   KVPS_DATA (/data)            the pod's volume
#   KVPS_CONFIG (/etc/kvps)      the ConfigMap: cluster.toml with __NAMESPACE__ for the namespace
#                                and __SECRET__ for KVPS_SECRET (written into KVPS_DATA, node-N below it)
#   KVPS_SECRET (/etc/kvps-secret) the Secret: secret and token (never sent over the join)
#   KVPS_SERVICE (kvps), KVPS_DOMAIN (svc.cluster.local)
set -eu
ordinal=${HOSTNAME##*-}
data=${KVPS_DATA:-/data}
config=${KVPS_CONFIG:-/etc/kvps}
secret=${KVPS_SECRET:-/etc/kvps-secret}
service=${KVPS_SERVICE:-kvps}
domain=${KVPS_DOMAIN:-svc.cluster.local}
ns=${POD_NAMESPACE:?POD_NAMESPACE comes from the downward API}
mkdir -p "$data"
# the first admin token of the file ("TOKEN [ROLE]" lines; a bare token is admin), in the
# environment: not on a command line (ps shows those)
KVPS_TOKEN=$(awk 'NF == 1 || $2 == "admin" { print $1; exit }' "$secret/token"); export KVPS_TOKEN
if [ "$ordinal" -lt 3 ]; then
  sed -e "s/__NAMESPACE__/$ns/g" -e "s|__SECRET__|$secret|g" "$config/cluster.toml" > "$data/cluster.toml"
  # A node whose volume was lost is refused under its id (kvps.node.identity); set
  # KVPS_REPLACE=1 on the pod to bring it back as a replacement (its replicas recover first).
  exec kvps node --config "$data/cluster.toml" --id "$ordinal" --bind 0.0.0.0 \
    ${KVPS_REPLACE:+--replace}
fi
# Joined pods: the same command after a restart gets the same id back (the volume's identity);
# a pod whose volume was lost is a new incarnation and the join is refused until its old id is
# drained (kvps node drain ID): it never comes back under the old id with empty replicas.
# The secret stays off the wire (--secret-file), and so do the tokens: the Secret's token file is
# copied into the volume, where the node and its replicas read it (the join keeps a token file
# that holds the joining token as admin). Without it a joined pod knows the admin token only and
# refuses every other role's token (training jobs push with a write token).
(umask 077 && cp "$secret/token" "$data/token")
exec kvps node join --seed "http://${service}-0.${service}.${ns}.${domain}:7100" --port 7100 \
  --host "${HOSTNAME}.${service}.${ns}.${domain}" --bind 0.0.0.0 --data-dir "$data" \
  --secret-file "$secret/secret"
