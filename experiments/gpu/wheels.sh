#!/usr/bin/env bash
# Vendor wheels on the offline GPU host, carried one numbered folder per device call.
#   bash experiments/gpu/wheels.sh stage     copy every carried .whl/<group>/<n>/ file into /tmp/wheels
#                                            (files outside the repo survive while the machine is warm)
#   bash experiments/gpu/wheels.sh install   re-join split wheels (NAME.part-aa, -ab ...) and install
#                                            everything staged into /tmp/site
#   source experiments/gpu/wheels.sh env     PYTHONPATH for /tmp/site (plus CUTLASS DSL's packages for FA4)
# Wheels come from `env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null ../shared/scripts/vendor-wheels.sh GROUP`.
case "${1:-}" in
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
  *) echo "usage: wheels.sh stage|install|env" >&2; exit 2 ;;
esac
