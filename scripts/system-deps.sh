#!/usr/bin/env bash
# System packages the test suite needs beyond Python: a JDK and Maven for the real
# Kafka broker (checked, not installed: the machine image provides them) and
# Debian's prometheus (installed if missing, for the dashboard tests) and iproute2
# (`ip`, `tc`, `bridge`: installed if missing, for the edge testbed's namespaces and links) and
# systemd (`systemd-analyze`, `systemd-sysusers`: the checks of deploy/systemd) and
# mosquitto + mosquitto-clients (a real MQTT broker and `mosquitto_pub` for the MQTT bridge).
set -euo pipefail
missing=()
command -v java >/dev/null || missing+=("java (JDK 17+)")
command -v mvn >/dev/null || missing+=("mvn (Maven)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "edgestream: missing ${missing[*]}: install them (e.g. apt-get install openjdk-17-jdk-headless maven)" >&2
  exit 1
fi
# ensure PACKAGE WHY COMMAND...: install Debian's PACKAGE (as root, with apt-get) unless
# every COMMAND is on the PATH; fail with one line if it cannot be installed.
ensure() {
  local package="$1" why="$2" cmd
  shift 2
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null && continue
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "edgestream: installing Debian's $package package ($why)" >&2
      apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >&2
      return
    fi
    echo "edgestream: '$cmd' ($package) is not installed and cannot be installed automatically (need root + apt-get)" >&2
    exit 1
  done
}
ensure prometheus "the dashboard tests" prometheus promtool
ensure iproute2 "ip, tc, bridge for the testbed" ip tc bridge
ensure systemd "systemd-analyze checks the units in deploy/systemd" systemd-analyze systemd-sysusers
ensure mosquitto "a real MQTT broker for the MQTT bridge tests" mosquitto
ensure mosquitto-clients "mosquitto_pub, the device in docs/devices.md" mosquitto_pub
