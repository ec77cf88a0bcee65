#!/usr/bin/env bash
# ansible-test sanity and units on the collection as it ships (docs/COLLECTION.md, "ansible-test"),
# without Docker (--local: the project's .venv, which `make` built). ansible-test runs only inside
# a folder named ansible_collections/<namespace>/<name>, so the tarball is built and installed in
# a temporary folder, with the repository's tests/unit and tests/sanity beside it (galaxy.yml's
# build_ignore keeps tests/ out of the tarball).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ansible-galaxy collection build --output-path "$work/dist" "$repo" >/dev/null
ansible-galaxy collection install --force -p "$work" "$work"/dist/*.tar.gz >/dev/null
root="$work/ansible_collections/sglang_fleet/fleet"
mkdir -p "$root/tests"
cp -r "$repo/tests/unit" "$repo/tests/sanity" "$repo/tests/config.yml" "$root/tests/"
# ansible-test keeps its sanity venvs and its pip bootstrap script under ~/.ansible/test: a HOME of
# our own keeps them in the repository's cache (kept between runs) and out of the user's home,
# with the ensurepip stand-in for the get-pip.py it cannot download (scripts/ansible-test-get-pip.py).
export HOME="$repo/.cache/ansible-test-home"
pip_version=$(python3 -c 'from types import SimpleNamespace as N
from ansible_test._internal.python_requirements import get_venv_packages
import sys; print(get_venv_packages(N(version=f"{sys.version_info[0]}.{sys.version_info[1]}"))["pip"])')
mkdir -p "$HOME/.ansible/test/cache"
cp "$repo/scripts/ansible-test-get-pip.py" "$HOME/.ansible/test/cache/get_pip_${pip_version//./_}.py"
cd "$root"
python=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
echo "==> ansible-test sanity (Python $python)"
ansible-test sanity --local --python "$python" --color no "$@"
echo "==> ansible-test units (Python $python)"
ansible-test units --local --python "$python" --color no
