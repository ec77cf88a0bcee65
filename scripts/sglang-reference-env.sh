#!/usr/bin/env bash
# Build the SGLang 0.5.23 reference environment: a CPU-only Python 3.11 venv in which the real
# `python -m sglang.launch_server --help` and `python -m sglang.benchmark.serving --help` run.
# gpusim's flag table (gpusim/gpusim/flags/sglang-0.5.23.json) is dumped from it, and
# tests/double/test_flags_match_real.py compares the test double against it.
#
# Usage: scripts/sglang-reference-env.sh [DIR]       (DIR defaults to <repo>/.cache/sglang-ref)
#   Env: SGLANG_REF_PYTHON  interpreter to build with (default: python3.11, else python3; must be 3.11
#                           because the sglang 0.5.23 wheel is cp311)
#
# Idempotent: DIR/venv/.stamp holds a hash of this script (and of where the torchvision stand-in
# lives); when it matches, the script only says so and exits. Anything else is rebuilt from scratch.
#
# Why the install looks like this (docs/SGLANG.md, "Its benchmark client on a machine without a
# GPU"): sglang's declared dependencies pull CUDA torch, flashinfer and ~4.5 GB of NVIDIA
# libraries. Every package below is therefore installed with --no-deps from an exact lock, so pip
# never resolves anything itself: torch is the local CPU wheel (2.13.0+cpu), and torchvision is a
# small stand-in package from this repository, put on the venv's path by a .pth file. The index is
# whatever pip's own configuration says; this script names none.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
dir=${1:-$repo/.cache/sglang-ref}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
venv=$dir/venv
stub=$repo/gpusim/tools/torchvision_stub
started=$SECONDS

say() { printf '==> [%3ds] %s\n' "$((SECONDS - started))" "$*"; }
die() { printf 'sglang-reference-env: %s\n' "$*" >&2; exit 1; }

pick_python() {
  local candidate
  for candidate in "${SGLANG_REF_PYTHON:-}" python3.11 python3; do
    [[ -n $candidate ]] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

# Exact pins. Direct imports first (sglang, torch, triton and what `import sglang` asks for),
# then what those need; resolved once with `pip install --dry-run --report` and frozen here.
write_lock() {
  cat <<'EOF'
# Installed with --no-deps: sglang's own requirements name CUDA wheels.
sglang==0.5.23
# The CPU wheel from the local wheel folder (pip's find-links); never a CUDA build.
torch==2.13.0+cpu
triton==3.9.0
# What `import sglang` and its flag/benchmark modules import.
aiohttp==3.14.5
apache-tvm-ffi==0.1.11
compressed-tensors==0.18.0
datasets==5.2.0
einops==0.8.2
fastapi==0.165.0
gguf==0.19.0
ipython==9.18.1
jsonschema==4.26.0
msgspec==0.23.0
numpy==2.4.6
openai==2.8.0
orjson==3.13.0
partial-json-parser==0.2.1.1.post7
pillow==13.0.0
psutil==7.2.2
pybase64==1.5.1
python-multipart==0.0.34
pyzmq==27.3.0
requests==2.34.2
sentencepiece==0.2.1
setproctitle==1.3.8
soundfile==0.13.1
starlette==1.10.0
tokenizers==0.23.2
tqdm==4.70.1
transformers==5.19.0
uvicorn==0.54.0
uvloop==0.23.0
xgrammar==0.2.7
xxhash==4.1.0
# Their dependencies.
aiohappyeyeballs==2.7.1
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
asttokens==3.0.2
attrs==26.1.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
dill==0.4.1
distro==1.9.0
executing==2.3.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.28.1
huggingface-hub==1.33.0
idna==3.20
ipython-pygments-lexers==1.1.1
jedi==0.20.1
jinja2==3.1.6
jiter==0.19.0
jsonschema-specifications==2025.9.1
loguru==0.7.3
markdown-it-py==4.3.0
markupsafe==3.0.4
matplotlib-inline==0.2.2
mdurl==0.1.2
mpmath==1.3.0
multidict==7.2.1
multiprocess==0.70.19
networkx==3.6.1
opentelemetry-api==1.45.2
packaging==26.4
pandas==3.1.1
parso==0.8.7
pexpect==4.9.0
prompt-toolkit==3.0.53
propcache==0.5.4
ptyprocess==0.7.0
pure-eval==0.2.4
pyarrow==26.0.1
pycparser==3.12
pydantic==2.14.4
pydantic-core==2.50.5
pygments==2.21.0
python-dateutil==4.0.0
pyyaml==6.0.4
referencing==0.37.0
regex==2026.11.19
rich==15.0.0
rpds-py==2026.9.1
safetensors==0.8.0
setuptools==84.2.1
shellingham==1.5.4
sniffio==1.3.1
stack-data==0.6.3
sympy==1.14.0
traitlets==5.16.1
typer==0.29.2
typing-extensions==4.16.0
typing-inspection==0.4.5
tzdata==2026.6
urllib3==2.8.0
wcwidth==0.9.4
yarl==1.25.1
EOF
}

# pip warns once per configured local index folder that lacks a package; that is noise here.
quiet_pip() {
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

smoke() {
  local module=$1
  say "check: python -m $module --help"
  HF_HUB_OFFLINE=1 timeout 300 "$venv/bin/python" -W ignore -m "$module" --help >"$dir/$module.help" 2>&1 \
    || { tail -n 30 "$dir/$module.help" >&2; die "python -m $module --help failed"; }
}

main() {
  [[ -d $stub/torchvision ]] || die "torchvision stand-in missing: $stub/torchvision"
  local key
  key=$(cat "${BASH_SOURCE[0]}" <(printf '%s\n' "$stub") | sha256sum | cut -d' ' -f1)

  exec 9>"$dir/.lock"
  flock 9  # two concurrent `make test` runs must not build into one folder at once
  if [[ -x $venv/bin/python && "$(cat "$venv/.stamp" 2>/dev/null)" == "$key" ]]; then
    say "SGLang reference env is up to date: $venv"
    return 0
  fi

  local python
  python=$(pick_python) || die "need Python 3.11 (sglang 0.5.23 ships cp311 wheels); set SGLANG_REF_PYTHON"
  say "building SGLang 0.5.23 reference env in $venv with $python ($("$python" --version))"
  rm -rf "$venv"
  "$python" -m venv "$venv"

  write_lock >"$dir/requirements.lock"
  say "installing $(grep -c '==' "$dir/requirements.lock") pinned packages with --no-deps (index from pip's config)"
  # --no-compile: byte-compiling ~2 GB of torch/triton/sglang is most of the install CPU; the
  # few modules `--help` imports compile on first use instead.
  quiet_pip install --no-deps --no-compile --only-binary=:all: --progress-bar off --no-input \
    -r "$dir/requirements.lock"

  say "putting the torchvision stand-in on the venv's path: $stub"
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  printf '%s\n' "$stub" >"$site/sglang_ref_torchvision_stub.pth"

  smoke sglang.launch_server
  smoke sglang.benchmark.serving

  printf '%s\n' "$key" >"$venv/.stamp"
  say "done: $venv ($(du -sh "$venv" | cut -f1))"
}

main
