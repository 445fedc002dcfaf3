#!/usr/bin/env bash
# Builds xgrammar's C++ core (the constrained-decoding library behind response_format and forced
# tool calls) from its PyPI source release and installs it under PREFIX (default /usr/local):
# lib/libxgrammar.a, include/xgrammar/, include/dlpack/. Pinned version and checksum; does nothing
# when that version is installed. Needs cmake, g++ and curl (or wget); no Python packages.
set -euo pipefail

version=0.2.9
sha256=87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90
url=https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-$version.tar.gz
prefix=${PREFIX:-/usr/local}
stamp=$prefix/share/xgrammar/VERSION

if [[ -f $stamp && $(cat "$stamp") == "$version" && -f $prefix/lib/libxgrammar.a ]]; then
  echo "install-xgrammar: xgrammar $version present in $prefix"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "install-xgrammar: building xgrammar $version into $prefix"
if command -v curl > /dev/null; then
  curl -fsSL --retry 3 -o "$work/src.tar.gz" "$url"
else
  wget -q -O "$work/src.tar.gz" "$url"
fi
echo "$sha256  $work/src.tar.gz" | sha256sum -c --quiet -
tar -xzf "$work/src.tar.gz" -C "$work"
src=$work/xgrammar-$version

# The release's cmake/config.cmake turns the Python bindings on (they need tvm-ffi); a config.cmake
# in the build folder takes its place. Its -Werror and -flto are overridden: warnings of newer
# compilers are not errors here, and the archive stays usable by any linker.
mkdir -p "$work/build"
cat > "$work/build/config.cmake" << 'EOF'
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
EOF
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" \
  -DCMAKE_CXX_FLAGS="-Wno-error -fno-lto" > "$work/configure.log" ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" -j"$(nproc)" > "$work/build.log" || { tail -50 "$work/build.log"; exit 1; }
cmake --install "$work/build" > /dev/null
mkdir -p "$(dirname "$stamp")"
echo "$version" > "$stamp"
echo "install-xgrammar: xgrammar $version installed in $prefix"
