#!/bin/bash
# Fill .devwheels (git-ignored) with what the device machine lacks for bench/device_all.sh and
# bench/device_data_threads.sh: this checkout's xdc wheel, its pure-Python and manylinux
# dependencies for CPython 3.12, py-spy, and iperf3 as .debs. Run here, where pip and apt
# reach an index; then name .devwheels in the device call's carry.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.devwheels/' .git/info/exclude 2>/dev/null || echo /.devwheels/ >> .git/info/exclude
rm -rf .devwheels && mkdir -p .devwheels
python3 -m pip wheel -q --no-deps -w .devwheels . 2>/dev/null
(cd .devwheels && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  trio outcome sniffio orjson cryptography cffi pycparser pynacl trustme py-spy xxhash &&
  apt-get download -q iperf3 libiperf0 libsctp1 2>/dev/null)
ls .devwheels
du -sh .devwheels
