#!/usr/bin/env bash
# Installs the Debian 12 packages that colibri-node needs to build and test, if any is missing,
# then xgrammar's C++ core from its source release (install-xgrammar.sh; skipped when present)
# and the Python clients the server is tested with (a virtual environment in
# /opt/colibri-node/client-venv from tests/serve/client-requirements.txt; skipped when current).
# Uses sudo only when not run as root. The CUDA toolkit is optional and not installed here:
# the build enables the CUDA kernels when nvcc is found (COLIBRI_CUDA=AUTO).
# --build-only: what building and running colibri-node needs, not the tests' extras (chromium,
# python3-venv and the client environment); the quick start uses it.
set -euo pipefail

build_only=0
case "${1:-}" in
  "") ;;
  --build-only) build_only=1 ;;
  *)
    echo "install-deps: unknown argument '$1' (--build-only or nothing)" >&2
    exit 2
    ;;
esac

packages=(
  build-essential cmake         # g++ 12, make, CMake >= 3.25
  libopenmpi-dev openmpi-bin    # MPI (Open MPI 4.1), mpirun
  libcereal-dev                 # serialisation of layouts and messages
  nlohmann-json3-dev            # config.json, safetensors headers
  libcli11-dev libfmt-dev       # command line, formatting
  libgtest-dev libgmock-dev     # tests
  libpcre2-dev libutf8proc-dev  # tokenizer: pre-tokenizer regexes (PCRE2 >= 10.40), NFC
  pkg-config                    # finds the two above, cpp-httplib and libnuma
  libcpp-httplib-dev            # HTTP server of --serve (cpp-httplib 0.11)
  libnuma-dev                   # a rank's NUMA node (layout numa column)
  libxxhash-dev                 # the wire checksum (XXH3, header only)
  iproute2 util-linux           # ip netns, tc, unshare: the multihost tests' namespace hosts
  curl ca-certificates          # fetches xgrammar's source release
)
test_packages=(
  python3-venv                  # the openai client tests' virtual environment
  chromium                      # headless browser of the dashboard test (tests/serve)
)
if ((build_only == 0)); then packages+=("${test_packages[@]}"); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${missing[@]}"
fi
"${sudo[@]}" bash "$(dirname "${BASH_SOURCE[0]}")/install-xgrammar.sh"
if ((build_only == 1)); then exit 0; fi
requirements=$(dirname "${BASH_SOURCE[0]}")/../tests/serve/client-requirements.txt
venv=/opt/colibri-node/client-venv
if ! cmp -s "$requirements" "$venv/requirements.txt"; then
  echo "install-deps: the client test environment in $venv"
  "${sudo[@]}" rm -rf "$venv"
  "${sudo[@]}" /usr/bin/python3 -m venv "$venv"
  "${sudo[@]}" "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
  "${sudo[@]}" cp "$requirements" "$venv/requirements.txt"
fi
