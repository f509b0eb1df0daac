#!/usr/bin/env bash
# The programs `make test` starts for real besides Python: redis-server (or valkey-server) for the shared store,
# headless Chromium and chromedriver for the live slot page, Node.js >= 20 with npm for the real pi and npm
# clients. What is missing comes from Debian's packages when this user may install (root, or passwordless
# sudo); otherwise ONE line says what to install and the exit status stops `make test`, so no test is skipped
# for a program the machine could have. REDIS_SERVER=/path/to/redis-server uses that binary instead of PATH's.
set -euo pipefail

say() { printf 'make test: %s\n' "$*" >&2; }
have() { command -v "$1" >/dev/null 2>&1; }
node_major() { node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0; }
node_ok() { have node && have npm && [ "$(node_major)" -ge 20 ]; }
# Debian 12's nodejs is 18, too old for pi; a release whose nodejs is 20 or newer can provide it.
apt_node_ok() {
    local v
    v=$(apt-cache policy nodejs 2>/dev/null | awk '/Candidate:/ {print $2}')
    [[ "$v" =~ ^([0-9]+:)?([0-9]+)\. ]] && [ "${BASH_REMATCH[2]}" -ge 20 ]
}

if [ -n "${REDIS_SERVER:-}" ] && ! { [ -f "$REDIS_SERVER" ] && [ -x "$REDIS_SERVER" ]; }; then
    say "REDIS_SERVER=$REDIS_SERVER is not an executable file: point it at redis-server or valkey-server, or unset it"
    exit 1
fi

missing() {  # the Debian packages of what is missing now, one per line
    if [ -z "${REDIS_SERVER:-}" ] && ! have redis-server && ! have valkey-server; then echo redis-server; fi
    have chromium || echo chromium
    have chromedriver || echo chromium-driver
    if ! node_ok; then printf 'nodejs\nnpm\n'; fi
}

mapfile -t pkgs < <(missing)
[ ${#pkgs[@]} -eq 0 ] && exit 0

by_hand=""  # what Debian's packages cannot provide here
if [[ " ${pkgs[*]} " == *" nodejs "* ]] && ! apt_node_ok; then
    by_hand="Node.js >= 20 with npm (nodejs.org or NodeSource; this system's nodejs package is older)"
    mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | grep -vx -e nodejs -e npm || true)
fi
what="sudo apt-get install ${pkgs[*]}${by_hand:+, and install $by_hand}"  # used when pkgs is not empty

if [ ${#pkgs[@]} -gt 0 ]; then
    if ! have apt-get; then
        say "install ${pkgs[*]} (Debian's names; valkey-server does instead of redis-server)${by_hand:+ and $by_hand}"
        exit 1
    elif [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif have sudo && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        list="${pkgs[*]}"
        say "${list// /, } missing and this user cannot install (not root, no passwordless sudo); run: $what"
        exit 1
    fi
    say "installing ${pkgs[*]} from Debian's packages (the suite starts them for real)"
    log=$(mktemp -t slotkeeper-apt.XXXXXX)
    if ! { "${sudo[@]}" apt-get update -qq \
            && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${pkgs[@]}"; } >"$log" 2>&1; then
        say "apt-get install ${pkgs[*]} failed (its output: $log); install them, then run make test again"
        exit 1
    fi
    rm -f "$log"
fi
if [ -n "$by_hand" ]; then
    say "install $by_hand, then run make test again"
    exit 1
fi
mapfile -t left < <(missing)
if [ ${#left[@]} -gt 0 ]; then
    say "still not on PATH after apt-get install: ${left[*]} (PATH=$PATH)"
    exit 1
fi
