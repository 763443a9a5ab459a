#!/usr/bin/env bash
# An MLflow tracking server for cluster runs: a database backend and an artifact root,
# both from the environment (no credentials in this file), bound to 127.0.0.1.
#
#   MLFLOW_BACKEND_STORE_URI=postgresql://mlflow@db:5432/mlflow \
#   MLFLOW_ARTIFACTS_DESTINATION=s3://YOUR-BUCKET/mlflow \
#   cluster/mlflow_server.sh
#
# Defaults (a laptop): sqlite:///$PWD/mlflow-server.db and $PWD/mlartifacts. Database
# passwords come from the environment the server runs in (PGPASSWORD or ~/.pgpass for
# PostgreSQL), S3 credentials from the instance role / AWS_* env, never from here.
#
# How workers reach it: the job's driver and rank 0 (a worker) both log, so every node
# needs MLFLOW_TRACKING_URI pointing at an address it can reach.
#   * local cluster (cluster/local_cluster.py): all nodes are this machine, so
#     MLFLOW_TRACKING_URI=http://127.0.0.1:5000 works as is.
#   * cloud / Kubernetes: run the server inside the cluster's network and keep it off
#     the internet: MLFLOW_HOST=0.0.0.0 only behind a private network / ClusterIP
#     Service, then MLFLOW_TRACKING_URI=http://mlflow.NAMESPACE.svc:5000 from a secret
#     (cluster/kuberay/raycluster.yaml). Open the UI with an SSH tunnel or
#     `kubectl port-forward svc/mlflow 5000:5000`.
#   Artifacts are proxied through the server (--serve-artifacts), so workers need no
#   credentials for the artifact store.
set -euo pipefail

HOST="${MLFLOW_HOST:-127.0.0.1}"
PORT="${MLFLOW_PORT:-5000}"
BACKEND="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$PWD/mlflow-server.db}"
ARTIFACTS="${MLFLOW_ARTIFACTS_DESTINATION:-$PWD/mlartifacts}"
MLFLOW="${MLFLOW:-$(dirname "$0")/../.venv/bin/mlflow}"
command -v "$MLFLOW" >/dev/null || MLFLOW=mlflow

if [ "$HOST" != "127.0.0.1" ] && [ "$HOST" != "localhost" ]; then
  echo "mlflow_server.sh: binding to $HOST: make sure only the cluster's network reaches it" >&2
fi

exec "$MLFLOW" server \
  --host "$HOST" --port "$PORT" \
  --backend-store-uri "$BACKEND" \
  --artifacts-destination "$ARTIFACTS" --serve-artifacts \
  --workers "${MLFLOW_WORKERS:-2}"
