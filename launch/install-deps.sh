#!/usr/bin/env bash
# Installs the Debian 12 packages that colibri-node needs to build and test, if any is missing.
# Uses sudo only when not run as root. The CUDA toolkit is optional and not installed here:
# the build enables the CUDA kernels when nvcc is found (COLIBRI_CUDA=AUTO).
set -euo pipefail

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
  chromium                      # headless browser of the dashboard test (tests/serve)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
echo "install-deps: installing ${missing[*]}"
"${sudo[@]}" apt-get update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends "${missing[@]}"
