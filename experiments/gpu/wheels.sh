#!/usr/bin/env bash
# Vendor wheels on the offline GPU host, carried one numbered folder per device call.
#   bash experiments/gpu/wheels.sh stage     copy every carried .whl/<group>/<n>/ file into /tmp/wheels
#                                            (files outside the repo survive while the machine is warm)
#   bash experiments/gpu/wheels.sh install   re-join split wheels (NAME.part-aa, -ab ...) and install
#                                            everything staged into /tmp/site
#   source experiments/gpu/wheels.sh env     PYTHONPATH for /tmp/site (plus CUTLASS DSL's packages for FA4)
#   bash experiments/gpu/wheels.sh pack NAME GROUP...
#                                            fetch GROUPs (../shared/scripts/vendor-wheels.sh, run with
#                                            pip's offline config unset) and lay them out as .whl/NAME/1, 2, ...:
#                                            wheels over PART_MIB (30) split into NAME.part-aa, -ab ..., the
#                                            files first-fit into folders of at most FOLDER_MIB (40) MiB, so
#                                            each folder travels beside the ~20 MB working tree (64 MiB limit).
#                                            FA4 with cuDNN-frontend: `pack fa4 fa4 cudnn` (three folders).
# Wheels come from `env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null ../shared/scripts/vendor-wheels.sh GROUP`.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
case "${1:-}" in
  pack)
    name=${2:?usage: wheels.sh pack NAME GROUP...}
    shift 2
    [ $# -gt 0 ] || { echo "usage: wheels.sh pack NAME GROUP..." >&2; exit 2; }
    fetch=${VENDOR_WHEELS:-../shared/scripts/vendor-wheels.sh}
    tmp=$(mktemp -d)
    for g in "$@"; do
      env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null bash "$fetch" "$g" "$tmp/dl" >/dev/null || exit 1
    done
    python3 - "$tmp/dl" ".whl/$name" "${PART_MIB:-30}" "${FOLDER_MIB:-40}" <<'PY' || exit 1
import os, shutil, sys
from pathlib import Path

src, dest, part, cap = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]) * 2**20, float(sys.argv[4]) * 2**20
# every downloaded file, split wheels re-joined (vendor-wheels.sh splits at 60 MiB)
whole: dict = {}
for f in sorted(p for p in src.rglob("*") if p.is_file()):
    base = f.name.split(".part-")[0]
    whole.setdefault(base, []).append(f)
pieces = []  # (name, bytes)
for base, parts in sorted(whole.items()):
    data = b"".join(p.read_bytes() for p in sorted(parts))
    if len(data) <= part:
        pieces.append((base, data))
        continue
    n = 0
    for i in range(0, len(data), int(part)):
        suffix = chr(ord("a") + n // 26) + chr(ord("a") + n % 26)
        pieces.append((f"{base}.part-{suffix}", data[i:i + int(part)]))
        n += 1
bins = []  # first fit, largest first
for name, data in sorted(pieces, key=lambda x: -len(x[1])):
    if len(data) > cap:
        sys.exit(f"{name} ({len(data) / 2**20:.1f} MiB) does not fit a folder of {cap / 2**20:.0f} MiB: raise FOLDER_MIB")
    for b in bins:
        if b[0] + len(data) <= cap:
            b[0] += len(data)
            b[1].append((name, data))
            break
    else:
        bins.append([len(data), [(name, data)]])
if dest.exists():
    shutil.rmtree(dest)
for i, (size, files) in enumerate(bins, 1):
    (dest / str(i)).mkdir(parents=True)
    for name, data in files:
        (dest / str(i) / name).write_bytes(data)
    print(f"{dest}/{i}: {size / 2**20:.1f} MiB, {len(files)} files")
PY
    rm -rf "$tmp"
    ;;
  stage)
    mkdir -p /tmp/wheels
    n=0
    for f in .whl/*/*/* .whl/*/*.whl; do [ -f "$f" ] && cp "$f" /tmp/wheels/ && n=$((n + 1)); done
    echo "staged $n files; /tmp/wheels now holds $(ls /tmp/wheels | wc -l)"
    ;;
  install)
    cd /tmp/wheels || exit 1
    for p in *.part-aa; do
      [ -e "$p" ] || continue
      whl=${p%.part-aa}
      cat "$whl".part-* > "$whl" && rm "$whl".part-* && echo "joined $whl"
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheels/*.whl \
      && echo "installed into /tmp/site: $(ls /tmp/wheels/*.whl | wc -l) wheels"
    ;;
  env)
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
    ;;
  *) echo "usage: wheels.sh stage|install|env|pack NAME GROUP..." >&2; exit 2 ;;
esac
