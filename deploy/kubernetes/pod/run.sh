#!/bin/sh
# Entry point of pod kvps-N. Nodes 0-2 are cluster.toml's first nodes (they run the metadata group);
# a pod with a higher ordinal joins through kvps-0. Every node listens on 0.0.0.0 (--bind) and is
# reached at its pod DNS name; the namespace comes from the downward API (POD_NAMESPACE).
#   KVPS_DATA (/data)            the pod's volume
#   KVPS_CONFIG (/etc/kvps)      the ConfigMap: cluster.toml with __NAMESPACE__ for the namespace
#                                and __SECRET__ for KVPS_SECRET (written into KVPS_DATA, node-N below it)
#   KVPS_SECRET (/etc/kvps-secret) the Secret: secret and token (never sent over the join)
#   KVPS_SERVICE (kvps), KVPS_DOMAIN (svc.cluster.local)
#   NODE_NAME (downward API)     the machine, whose zone label becomes the node's --zone
#   KVPS_ZONE                    a zone to use instead of the machine's label
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
# The failure domain: the machine's topology.kubernetes.io/zone label, read with the pod's
# ServiceAccount (kvps-read-node-zone in statefulset.yaml). The rebalancer keeps a shard's replicas
# in distinct zones. No label, no NODE_NAME or no answer: no zone (the node is a domain of its own).
zone=${KVPS_ZONE:-}
if [ -z "$zone" ] && [ -n "${NODE_NAME:-}" ]; then
  zone=$(python3 - <<'PY'
import json, os, ssl, sys, urllib.request
sa = os.environ.get("KVPS_SERVICEACCOUNT", "/var/run/secrets/kubernetes.io/serviceaccount")
api = os.environ.get("KVPS_API", "https://kubernetes.default.svc")
try:
    ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt") if api.startswith("https") else None
    req = urllib.request.Request(f"{api}/api/v1/nodes/{os.environ['NODE_NAME']}",
                                 headers={"Authorization": "Bearer " + open(f"{sa}/token").read().strip()})
    node = json.load(urllib.request.urlopen(req, timeout=10, context=ctx))
    print(node["metadata"].get("labels", {}).get("topology.kubernetes.io/zone", ""))
except Exception as exc:  # the node starts without a zone rather than not at all
    print(f"run.sh: no zone for machine {os.environ['NODE_NAME']}: {exc}", file=sys.stderr)
PY
)
fi
echo "kvps-$ordinal: zone '${zone}'"
if [ "$ordinal" -lt 3 ]; then
  sed -e "s/__NAMESPACE__/$ns/g" -e "s|__SECRET__|$secret|g" "$config/cluster.toml" > "$data/cluster.toml"
  # A node whose volume was lost is refused under its id (kvps.node.identity); set
  # KVPS_REPLACE=1 on the pod to bring it back as a replacement (its replicas recover first).
  exec kvps node --config "$data/cluster.toml" --id "$ordinal" --bind 0.0.0.0 --zone "$zone" \
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
  --secret-file "$secret/secret" --zone "$zone"
