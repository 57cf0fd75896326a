#!/usr/bin/env bash
# System packages the test suite needs beyond Python: a JDK and Maven for the real
# Kafka broker (checked, not installed: the machine image provides them) and
# Debian's prometheus (installed if missing, for the dashboard tests) and iproute2
# (`ip`, `tc`, `bridge`: installed if missing, for the edge testbed's namespaces and links) and
# systemd (`systemd-analyze`, `systemd-sysusers`: the checks of deploy/systemd).
set -euo pipefail
missing=()
command -v java >/dev/null || missing+=("java (JDK 17+)")
command -v mvn >/dev/null || missing+=("mvn (Maven)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "edgestream: missing ${missing[*]}: install them (e.g. apt-get install openjdk-17-jdk-headless maven)" >&2
  exit 1
fi
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "edgestream: installing Debian's prometheus package" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >&2
  else
    echo "edgestream: 'prometheus' is not installed and cannot be installed automatically (need root + apt-get)" >&2
    exit 1
  fi
fi
if ! command -v ip >/dev/null || ! command -v tc >/dev/null || ! command -v bridge >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "edgestream: installing Debian's iproute2 package (ip, tc, bridge) for the testbed" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >&2
  else
    echo "edgestream: 'ip'/'tc' (iproute2) are not installed and cannot be installed automatically (need root + apt-get)" >&2
    exit 1
  fi
fi
if ! command -v systemd-analyze >/dev/null || ! command -v systemd-sysusers >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "edgestream: installing Debian's systemd package (systemd-analyze checks the units in deploy/systemd)" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >&2
  else
    echo "edgestream: 'systemd-analyze' is not installed and cannot be installed automatically (need root + apt-get)" >&2
    exit 1
  fi
fi
