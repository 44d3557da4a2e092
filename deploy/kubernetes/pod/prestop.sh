#!/bin/sh
# preStop of pod kvps-N: drain the node only when the StatefulSet is shrinking past it. A pod that
# stops for a restart, an eviction or a rolling update comes back with its volume and its id, so
# moving all its data out and back would only cost time (and a drain longer than the grace
# period would die mid-move). The first three nodes never drain (they run the metadata group).
#   KVPS_API (https://kubernetes.default.svc), KVPS_STATEFULSET (kvps)
set -eu
ordinal=${HOSTNAME##*-}
[ "$ordinal" -lt 3 ] && exit 0
secret=${KVPS_SECRET:-/etc/kvps-secret}
KVPS_TOKEN=$(awk 'NF == 1 || $2 == "admin" { print $1; exit }' "$secret/token"); export KVPS_TOKEN
replicas=$(python3 - <<'PY'
import json, os, ssl, urllib.request
sa = os.environ.get("KVPS_SERVICEACCOUNT", "/var/run/secrets/kubernetes.io/serviceaccount")
api = os.environ.get("KVPS_API", "https://kubernetes.default.svc")
ns = os.environ["POD_NAMESPACE"]
name = os.environ.get("KVPS_STATEFULSET", "kvps")
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt") if api.startswith("https") else None
req = urllib.request.Request(f"{api}/apis/apps/v1/namespaces/{ns}/statefulsets/{name}",
                             headers={"Authorization": "Bearer " + open(f"{sa}/token").read().strip()})
print(json.load(urllib.request.urlopen(req, timeout=10, context=ctx))["spec"]["replicas"])
PY
)
if [ "$ordinal" -lt "$replicas" ]; then
  echo "kvps-$ordinal stops but stays in the StatefulSet ($replicas replicas): no drain"
  exit 0
fi
id=$(python3 -c 'import json, os, urllib.request
req = urllib.request.Request("http://127.0.0.1:7100/v1/node", headers={"Authorization": "Bearer " + os.environ["KVPS_TOKEN"]})
print(json.load(urllib.request.urlopen(req, timeout=10))["node"])')
exec kvps node drain "$id" --endpoint http://127.0.0.1:7100 --timeout 3000
